"""`x @ w[layer].T` in plain XLA: the stacked-matmul kernel's oracle and the portable path.

Where it sits: the model's linear layers keep their weights stacked over layers in the
layout Hugging Face stores them, [L, out, in], and call `stacked_matmul` with the layer
index of the scan step; this is what runs wherever the CPU kernel does not (GPU, TPU,
bfloat16, tensor-parallel meshes, many rows), and what the kernel is tested against.
It promises the product in x's dtype, reading only `w[layer]`.
"""

import jax


def stacked_matmul_reference(x: jax.Array, w: jax.Array, layer) -> jax.Array:
    """[T, D] @ [L, F, D][layer].T -> [T, F]."""
    return x @ w[layer].T
