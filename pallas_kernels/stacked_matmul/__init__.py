"""One entry point for `x @ w[layer].T` over layer-stacked weights, picking the
implementation: the C++ kernel on CPU for float32 and a few rows where it builds, else the
XLA reference. `impl="reference"` forces the reference (a tensor-parallel mesh does: XLA
cannot partition a custom call)."""

import jax

from jengine.pallas_kernels.stacked_matmul import cpu
from jengine.pallas_kernels.stacked_matmul.reference import stacked_matmul_reference

IMPLEMENTATIONS = ("reference", "cpu")


def stacked_matmul(x: jax.Array, w: jax.Array, layer, *, impl: str | None = None) -> jax.Array:
    """[T, D] @ [L, F, D][layer].T -> [T, F] (see `reference.py`)."""
    if impl is None:
        impl = "cpu" if jax.default_backend() == "cpu" and cpu.supports(x, w) else "reference"
        if impl == "cpu" and cpu.KERNEL.load() is not None:
            impl = "reference"
    if impl == "reference":
        return stacked_matmul_reference(x, w, layer)
    if impl == "cpu":
        return cpu.stacked_matmul_cpu(x, w, layer)
    raise ValueError(f"unknown stacked-matmul implementation {impl!r}; expected {IMPLEMENTATIONS}")


__all__ = ["IMPLEMENTATIONS", "stacked_matmul", "stacked_matmul_reference"]
