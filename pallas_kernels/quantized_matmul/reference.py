"""`x @ dequantize(w[layer]).T` in plain XLA: the quantized kernels' oracle and the
portable path.

Where it sits: the model's linear layers call `quantized_matmul` with a `QuantizedWeight`
stacked over layers and the scan step's layer index; this runs wherever a kernel does not
(many rows, tensor-parallel meshes, GPU and TPU through XLA's fusion of the dequantize into
the dot's operand). It reads `w[layer]`'s packed arrays and dequantizes that layer only.
"""

import jax
import jax.numpy as jnp

from jengine.pallas_kernels.quantized_matmul.layout import QuantizedWeight, dequantize


def quantized_matmul_reference(x: jax.Array, w: QuantizedWeight, layer) -> jax.Array:
    """[T, D] @ dequantize([L, F, D][layer]).T -> [T, F] in x's dtype."""
    w = w.map(lambda a: a[layer])
    if w.format.kind == "uint4":
        return _uint4_matmul(x, w)
    return x @ dequantize(w, x.dtype).T


def _uint4_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """The same product for 4-bit weights, as two: the low nibbles (inputs 0-15 of each
    run of 32) with those inputs of x, the high ones with the rest. Each half dequantizes
    elementwise, which XLA fuses into the dot's operand; interleaving the halves back into
    input order first (`dequantize`) costs XLA:CPU a copy 3x slower than the product."""
    rows, run_bytes = w.values.shape
    runs = run_bytes // 16
    runs_per_group = runs // w.scales.shape[-1]

    def per_run(a):  # [rows, G] -> [rows, runs, 1]: a group's scale for each of its runs
        return jnp.repeat(a.astype(jnp.float32), runs_per_group, axis=-1)[..., None]

    blocks = w.values.reshape(rows, runs, 16)
    halves = x.reshape(*x.shape[:-1], runs, 2, 16)
    out = None
    for half, q in enumerate((blocks & 0x0F, blocks >> 4)):
        dense = q.astype(jnp.float32) * per_run(w.scales)
        if w.mins is not None:
            dense = dense + per_run(w.mins)
        part = halves[..., half, :].reshape(*x.shape[:-1], -1) @ (
            dense.reshape(rows, -1).astype(x.dtype).T
        )
        out = part if out is None else out + part
    return out
