"""`x @ dequantize(w[layer]).T` on CPU: the C++ kernel in `cpu.cc`, called through the XLA
FFI, for one weight or several that multiply the same x in one call.

Where it sits: `quantized_matmul` picks it on the CPU backend for float32 x with at most
`MAX_ROWS` rows (decode steps, batched decode steps, verifications, short prefill chunks),
in place of the XLA reference, which stays its oracle and the path for everything else
(long prefill chunks, where the reference's dequantized layer serves enough rows to pay
for itself). It promises the reference's result to float32 rounding, reads only
`w[layer]`'s packed bytes (no float copy of the layer), and takes derivatives with respect
to x through the reference.

Why a C++ kernel: XLA:CPU writes a float32 copy of a dequantized weight before its dot
reads it, so a decode step would read 4-8x the bytes the quantized weights hold, and a
batched one packs that copy once more (bench/README.md has the options measured).
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jengine.pallas_kernels.native_build import NativeKernel
from jengine.pallas_kernels.quantized_matmul.layout import QuantizedWeight
from jengine.pallas_kernels.quantized_matmul.reference import quantized_matmul_reference

TARGET_NAME = "jengine_quantized_matmul"
KERNEL = NativeKernel(
    Path(__file__).with_name("cpu.cc"),
    symbol="JengineQuantizedMatmul",
    target=TARGET_NAME,
    what="CPU quantized-matmul kernel",
)
GROUP = 32
MAX_ROWS = 256
_KINDS = {"int8": 0, "uint4": 1, "fp8": 2}


def supports(x, w: QuantizedWeight) -> bool:
    """Whether the kernel takes these operands (arrays or `jax.ShapeDtypeStruct`s)."""
    dim = w.shape[-1]
    group = dim // w.scales.shape[-1] if w.scales.shape[-1] else 0
    return (
        len(x.shape) == 2
        and len(w.values.shape) == 3
        and x.shape[1] == dim
        and x.dtype == jnp.float32
        and x.shape[0] <= MAX_ROWS
        and group > 0
        and dim % GROUP == 0
        and dim % group == 0
        and (group % GROUP == 0 or group == GROUP // 2)
    )


def quantized_matmul_cpu(
    x: jax.Array, w: QuantizedWeight, layer, *, kernel: NativeKernel = KERNEL
) -> jax.Array:
    """See `reference.quantized_matmul_reference`."""
    return quantized_matmuls_cpu(x, (w,), layer, kernel=kernel)[0]


def quantized_matmuls_cpu(
    x: jax.Array, ws, layer, *, integer_x: bool = True, kernel: NativeKernel = KERNEL
) -> tuple[jax.Array, ...]:
    """`x @ dequantize(w[layer]).T` for each w of `ws` (formats may differ) in one kernel
    call, each result as its own call gives, bit for bit. `integer_x`: 4-bit weights
    multiply x as integers where the CPU has AVX-512 VNNI or is an AVX2 CPU without
    AVX-512 (`integer_x.h`: exact to 2^-23 of each run of 32 inputs' largest |x|;
    SmolLM2's 30 Q4_1 layers 4.25 against 4.91 ms with VNNI, bench/README.md); False
    keeps float x for every weight. `kernel`: the build to call (the tests pass an AVX2
    CPU's)."""
    for w in ws:
        if not supports(x, w):
            raise ValueError(
                f"the CPU quantized-matmul kernel takes float32 x [T <= {MAX_ROWS}, D] and a "
                f"weight [L, F, D], D a multiple of {GROUP}, in groups of a multiple of "
                f"{GROUP} inputs or of {GROUP // 2}; got x "
                f"{x.dtype}{tuple(x.shape)}, a {w.format.name} weight {w.shape}"
            )
    kernel.require()
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return _matmuls(x, tuple(ws), layer, integer_x, kernel.target)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _matmuls(x, ws, layer, integer_x, target):
    # A format without mins passes a one-element stand-in (the kernel does not read it).
    operands = []
    for w in ws:
        mins = w.mins if w.mins is not None else jnp.zeros((1,), jnp.float32)
        operands += [w.values, w.scales, mins]
    call = jax.ffi.ffi_call(
        target, [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype) for w in ws]
    )
    return tuple(
        call(
            x,
            layer,
            *operands,
            kinds=np.array([_KINDS[w.format.kind] for w in ws], np.int64),
            has_mins=np.array([w.mins is not None for w in ws], np.int64),
            integer_x=np.int64(integer_x),
        )
    )


@_matmuls.defjvp
def _matmuls_jvp(integer_x, target, primals, tangents):
    # The kernel has no derivative of its own; the reference computes the same function.
    x, ws, layer = primals

    def reference(x):
        return tuple(quantized_matmul_reference(x, w, layer[0]) for w in ws)

    return jax.jvp(reference, (x,), tangents[:1])
