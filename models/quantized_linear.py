"""A quantized weight as model parameters: the packed values, scales and mins of one
(layer-stacked) linear weight, held by the model in place of a float `nnx.Param`.

Where it sits: `DecoderForCausalLM` builds one for each weight its config names in
`quantization` (`models/quantize.py` fills them at load); the forward pass reads it as a
`QuantizedWeight` (`pallas_kernels/quantized_matmul/layout.py`) through `matmul`, and
`embedding_rows` gathers rows of a quantized embedding. Its arrays are ordinary
parameters: `nnx.state(model, nnx.Param)` holds them as `<name>.values`, `.scales`,
`.mins`, so loading, tensor-parallel sharding and `update_weights` treat them like any
weight; the format is static (in the graphdef), so swapping values never recompiles.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jengine.pallas_kernels import quantized_matmuls, stacked_matmuls
from jengine.pallas_kernels.quantized_matmul import QuantFormat, QuantizedWeight, dequantize


class QuantizedLinear(nnx.Module):
    """A [*rows, dim] weight in `format` (zeros until loaded)."""

    def __init__(self, format: QuantFormat, rows: tuple[int, ...], dim: int):
        self.format = format
        for name, (shape, dtype) in format.shapes(rows, dim).items():
            setattr(self, name, nnx.Param(jnp.zeros(shape, dtype)))

    def weight(self) -> QuantizedWeight:
        mins = self.mins.value if self.format.has_mins else None
        return QuantizedWeight(self.values.value, self.scales.value, mins, self.format)


def param_value(param):
    """What the forward pass reads of a weight: the array, or a `QuantizedWeight`."""
    return param.weight() if isinstance(param, QuantizedLinear) else param.value


def matmul(x: jax.Array, w, layer, *, impl: str | None = None) -> jax.Array:
    """x @ w[layer].T for a float [L, F, D] array or a `QuantizedWeight`."""
    return matmuls(x, (w,), layer, impl=impl)[0]


def matmuls(x: jax.Array, ws, layer, *, impl: str | None = None) -> tuple[jax.Array, ...]:
    """`matmul(x, w, layer)` for each w of `ws` (a layer's q, k and v; its gate and up): one
    kernel call where they are all float or all quantized, so a decode step hands its
    threads work 3 times a layer rather than 6 (same results either way)."""
    quantized = [isinstance(w, QuantizedWeight) for w in ws]
    if all(quantized):
        return quantized_matmuls(x, ws, layer, impl=impl)
    if not any(quantized):
        return stacked_matmuls(x, ws, layer, impl=impl)
    return tuple(matmul(x, w, layer, impl=impl) for w in ws)


def embedding_rows(table, ids: jax.Array, dtype) -> jax.Array:
    """table[ids] for a float [V, D] table or a quantized one (the rows dequantized)."""
    if isinstance(table, QuantizedWeight):
        return dequantize(table.map(lambda a: a[ids]), dtype)
    return table[ids]


def leading_axis(w):
    """w[None]: a [V, D] weight as a one-layer stack (no copy)."""
    return w.map(lambda a: a[None]) if isinstance(w, QuantizedWeight) else w[None]
