"""One entry point for `x @ w[layer].T` over layer-stacked weights, picking the
implementation: the C++ kernel on CPU for float32 and up to `cpu.MAX_ROWS` rows where it
builds, else the XLA reference. `impl="reference"` forces the reference (a tensor-parallel
mesh does: XLA cannot partition a custom call). `stacked_matmuls` takes several weights
that multiply the same x (a layer's q, k and v): the CPU kernel computes them in one call."""

import jax

from jengine.pallas_kernels.stacked_matmul import cpu
from jengine.pallas_kernels.stacked_matmul.reference import stacked_matmul_reference

IMPLEMENTATIONS = ("reference", "cpu")


def stacked_matmul(x: jax.Array, w: jax.Array, layer, *, impl: str | None = None) -> jax.Array:
    """[T, D] @ [L, F, D][layer].T -> [T, F] (see `reference.py`)."""
    return stacked_matmuls(x, (w,), layer, impl=impl)[0]


def stacked_matmuls(x: jax.Array, ws, layer, *, impl: str | None = None) -> tuple[jax.Array, ...]:
    """`stacked_matmul(x, w, layer)` for each w of `ws`, in one kernel call where the CPU
    kernel takes them all."""
    if impl is None:
        on_cpu = jax.default_backend() == "cpu" and all(cpu.supports(x, w) for w in ws)
        impl = "cpu" if on_cpu and cpu.KERNEL.load() is None else "reference"
    if impl == "reference":
        return tuple(stacked_matmul_reference(x, w, layer) for w in ws)
    if impl == "cpu":
        return cpu.stacked_matmuls_cpu(x, ws, layer)
    raise ValueError(f"unknown stacked-matmul implementation {impl!r}; expected {IMPLEMENTATIONS}")


__all__ = ["IMPLEMENTATIONS", "stacked_matmul", "stacked_matmul_reference", "stacked_matmuls"]
