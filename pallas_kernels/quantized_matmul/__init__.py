"""One entry point for `x @ dequantize(w[layer]).T` over a layer-stacked `QuantizedWeight`,
picking the implementation: the C++ kernel on CPU for float32 and up to `cpu.MAX_ROWS` rows
where it builds, else the XLA reference. `impl="reference"` forces the reference (a
tensor-parallel mesh does: XLA cannot partition a custom call). `quantized_matmuls` takes
several weights that multiply the same x (a layer's q, k and v): the CPU kernel computes
them in one call."""

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
    return quantized_matmuls(x, (w,), layer, impl=impl)[0]


def quantized_matmuls(x: jax.Array, ws, layer, *, impl: str | None = None):
    """`quantized_matmul(x, w, layer)` for each w of `ws`, in one kernel call where the CPU
    kernel takes them all."""
    if impl is None:
        on_cpu = jax.default_backend() == "cpu" and all(cpu.supports(x, w) for w in ws)
        impl = "cpu" if on_cpu and cpu.KERNEL.load() is None else "reference"
    if impl == "reference":
        return tuple(quantized_matmul_reference(x, w, layer) for w in ws)
    if impl == "cpu":
        return cpu.quantized_matmuls_cpu(x, ws, layer)
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
    "quantized_matmuls",
]
