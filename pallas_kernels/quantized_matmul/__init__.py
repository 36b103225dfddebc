"""One entry point for `x @ dequantize(w[layer]).T` over a layer-stacked `QuantizedWeight`,
picking the implementation: the C++ kernel on CPU for float32 and a few rows where it
builds, else the XLA reference. `impl="reference"` forces the reference (a
tensor-parallel mesh does: XLA cannot partition a custom call)."""

import jax

from jengine.pallas_kernels.quantized_matmul import cpu
from jengine.pallas_kernels.quantized_matmul.layout import (
    QuantFormat,
    QuantizedWeight,
    dequantize,
)
from jengine.pallas_kernels.quantized_matmul.reference import quantized_matmul_reference

IMPLEMENTATIONS = ("reference", "cpu")


def quantized_matmul(x: jax.Array, w: QuantizedWeight, layer, *, impl: str | None = None):
    """[T, D] @ dequantize([L, F, D][layer]).T -> [T, F] (see `reference.py`)."""
    if impl is None:
        impl = "cpu" if jax.default_backend() == "cpu" and cpu.supports(x, w) else "reference"
        if impl == "cpu" and cpu.KERNEL.load() is not None:
            impl = "reference"
    if impl == "reference":
        return quantized_matmul_reference(x, w, layer)
    if impl == "cpu":
        return cpu.quantized_matmul_cpu(x, w, layer)
    raise ValueError(
        f"unknown quantized-matmul implementation {impl!r}; expected {IMPLEMENTATIONS}"
    )


__all__ = [
    "IMPLEMENTATIONS",
    "QuantFormat",
    "QuantizedWeight",
    "dequantize",
    "quantized_matmul",
    "quantized_matmul_reference",
]
