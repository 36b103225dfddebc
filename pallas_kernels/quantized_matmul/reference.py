"""`x @ dequantize(w[layer]).T` in plain XLA: the quantized kernels' oracle and the
portable path.

Where it sits: the model's linear layers call `quantized_matmul` with a `QuantizedWeight`
stacked over layers and the scan step's layer index; this runs wherever a kernel does not
(many rows, tensor-parallel meshes, GPU and TPU through XLA's fusion of the dequantize into
the dot's operand). It reads `w[layer]`'s packed arrays and dequantizes that layer only.
"""

import jax

from jengine.pallas_kernels.quantized_matmul.layout import QuantizedWeight, dequantize


def quantized_matmul_reference(x: jax.Array, w: QuantizedWeight, layer) -> jax.Array:
    """[T, D] @ dequantize([L, F, D][layer]).T -> [T, F] in x's dtype."""
    return x @ dequantize(w.map(lambda a: a[layer]), x.dtype).T
