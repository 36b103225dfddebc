"""`x @ w[layer].T` on CPU: the C++ kernel in `cpu.cc`, called through the XLA FFI, for one
weight or several that multiply the same x in one call.

Where it sits: `stacked_matmul` picks it on the CPU backend for float32 operands with at
most `MAX_ROWS` rows (decode steps, batched ones, verifications), in place of the XLA reference,
which stays its oracle and the path for everything else. It promises the reference's
result to float32 rounding, reads only `w[layer]` (no copy of it), and takes derivatives
through the reference.

Why a C++ kernel: under the model's layer scan XLA:CPU copies each layer's weights out of
the stacked array before its dot reads them, so a decode step read every weight twice and
wrote it once, and its GEMM packs the copy anew every call (bench/README.md has the
measurements).
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from jengine.pallas_kernels.native_build import NativeKernel
from jengine.pallas_kernels.stacked_matmul.reference import stacked_matmul_reference

TARGET_NAME = "jengine_stacked_matmul"
KERNEL = NativeKernel(
    Path(__file__).with_name("cpu.cc"),
    symbol="JengineStackedMatmul",
    target=TARGET_NAME,
    what="CPU stacked-matmul kernel",
)
LANES = 8
MAX_ROWS = 128  # past this XLA's GEMM is as fast or faster (cpu.cc)


def supports(x, w) -> bool:
    """Whether the kernel takes these operands (arrays or `jax.ShapeDtypeStruct`s)."""
    return (
        len(x.shape) == 2
        and len(w.shape) == 3
        and x.shape[1] == w.shape[2]
        and x.dtype == jnp.float32
        and w.dtype == jnp.float32
        and x.shape[1] % LANES == 0
        and x.shape[0] <= MAX_ROWS
    )


def stacked_matmul_cpu(x: jax.Array, w: jax.Array, layer, *, kernel: NativeKernel = KERNEL):
    """See `reference.stacked_matmul_reference`."""
    return stacked_matmuls_cpu(x, (w,), layer, kernel=kernel)[0]


def stacked_matmuls_cpu(
    x: jax.Array, ws, layer, *, kernel: NativeKernel = KERNEL
) -> tuple[jax.Array, ...]:
    """`x @ w[layer].T` for each w of `ws` in one kernel call (each result as its own call
    gives, bit for bit): the work of all of them is shared out between the threads at once.
    `kernel`: the build to call (the tests pass an AVX2 CPU's)."""
    for w in ws:
        if not supports(x, w):
            raise ValueError(
                f"the CPU stacked-matmul kernel takes float32 x [T <= {MAX_ROWS}, D] and w "
                f"[L, F, D] with D a multiple of {LANES}; got x {x.dtype}{tuple(x.shape)}, "
                f"w {w.dtype}{tuple(w.shape)}"
            )
    kernel.require()
    return _matmuls(x, tuple(ws), jnp.asarray(layer, jnp.int32).reshape(1), kernel.target)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _matmuls(x, ws, layer, target):
    results = [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype) for w in ws]
    return tuple(jax.ffi.ffi_call(target, results)(x, layer, *ws))


@_matmuls.defjvp
def _matmuls_jvp(target, primals, tangents):
    # The kernel has no derivative of its own; the reference computes the same function.
    x, ws, layer = primals

    def reference(x, ws):
        return tuple(stacked_matmul_reference(x, w, layer[0]) for w in ws)

    return jax.jvp(reference, (x, ws), tangents[:2])
