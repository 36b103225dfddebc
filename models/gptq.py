"""GPTQ's rounding (Frantar et al., 2022) of a stack of weights to fp8 (e4m3, one scale per
output row): the same format and matmul as rounding to nearest, with each rounding error
pushed onto the inputs not yet rounded, weighted by how those inputs vary together.

Where it sits: `models/loader.quantized_params` calls `gptq_fp8` for each linear weight of
the layer stack with `--quantization fp8`, after `models/calibration.py` has measured the
Gram matrix of each weight's inputs (the model's own samples through the float model).

Promises:
- the result has `quantize.FP8`'s arrays and scales (max|w| / 448 per row), so it runs
  through the same kernels as a weight rounded to nearest; only which way each value
  rounds differs;
- rounding column j of W [F, D] to Q[:, j] leaves the error e = (W[:, j] - Q[:, j]) /
  U[j, j], and the columns after j move by -e U[j, j+1:], where U is the upper Cholesky
  factor of the inverse of the damped Gram matrix H = X^T X + 1% mean(diag H) I: the least
  squares update of the rest for the output error ||X (W - Q)^T||, done in blocks of
  BLOCK columns (GPTQ's lazy batch updates), columns in order of falling input energy
  (GPTQ's "act order"); an input never seen (diag H = 0) is rounded to nearest;
- every layer of the stack at once (vectorized over the leading axis), on the host but for
  the factorization.
Measured on SmolLM2 over 11K tokens of three texts (bench/README.md): perplexity +1.6%
rounded to nearest, +0.7% so (each text within 1%).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models.quantize import FP8, quantize

DAMPING = 0.01  # of the Gram matrix's mean diagonal, added to it (GPTQ's default)
BLOCK = 32  # columns rounded between two updates of all later ones
_LARGEST = 448.0  # e4m3's largest value


def gptq_fp8(weight: np.ndarray, gram: np.ndarray) -> dict[str, np.ndarray]:
    """Weights [L, F, D] and their inputs' Gram matrices [L, D, D] -> `quantize.FP8`'s
    arrays: values [L, F, D] (e4m3) and scales [L, F, 1] (float32)."""
    scales = quantize(weight, FP8)["scales"]  # [L, F, 1]: as rounding to nearest has them
    num_columns = weight.shape[-1]
    # Columns in order of falling input energy (GPTQ's "act order"): the ones that matter
    # most are rounded first, while the most columns are left to take their errors.
    order = np.argsort(-np.diagonal(gram, axis1=1, axis2=2), axis=-1, kind="stable")
    # Columns as rows, [L, D, F], in that order: each step below reads and writes whole
    # rows of memory (1.4-1.7x faster than strided columns of [L, F, D], the same codes).
    columns = np.asarray(weight, np.float32).transpose(0, 2, 1)
    columns = np.take_along_axis(columns, order[:, :, None], axis=1)
    upper = np.asarray(_upper_cholesky_of_inverse(jnp.asarray(gram), jnp.asarray(order)))
    codes = np.empty(columns.shape, jnp.float8_e4m3fn)
    row_scales = scales[..., 0]  # [L, F]
    # Every layer at once, on the host: XLA's CPU backend ran this loop of small steps
    # 3x slower than numpy (measured: SmolLM2's down_proj, 21 s against 6).
    for start in range(0, num_columns, BLOCK):
        end = min(start + BLOCK, num_columns)
        block = columns[:, start:end]  # a view: its updates land in `columns`
        errors = np.empty_like(block)
        for i in range(end - start):
            column = start + i
            code = np.clip(block[:, i] / row_scales, -_LARGEST, _LARGEST).astype(codes.dtype)
            codes[:, column] = code
            errors[:, i] = (block[:, i] - code.astype(np.float32) * row_scales) / upper[
                :, column, column, None
            ]
            # The block's later columns take this column's error (U's row i is zero
            # before i: earlier columns do not move).
            block[:, i + 1 :] -= upper[:, column, column + 1 : end, None] * errors[:, i, None]
        # The later columns take this block's errors at once (GPTQ's lazy batch update).
        columns[:, end:] -= np.matmul(upper[:, start:end, end:].transpose(0, 2, 1), errors)
    codes = codes.transpose(0, 2, 1)
    values = np.take_along_axis(codes, np.argsort(order)[:, None, :], axis=-1)
    return {"values": values, "scales": scales}


@jax.jit
def _upper_cholesky_of_inverse(gram: jax.Array, order: jax.Array) -> jax.Array:
    """U, upper triangular, with U^T U = H^-1 for the Gram matrix H [L, D, D] in `order`
    and damped (an input never seen: its own row and column, no error spread to or from
    it), in one Cholesky factorization and one
    triangular inverse: with J the reversal of the columns, J H J = L L^T gives
    H^-1 = (J L^-T J)(J L^-1 J), so U = J L^-1 J."""
    gram = jnp.take_along_axis(jnp.take_along_axis(gram, order[:, :, None], 1), order[:, None], 2)
    diagonal = jnp.diagonal(gram, axis1=1, axis2=2)
    unseen = diagonal == 0
    damping = DAMPING * jnp.mean(jnp.where(unseen, 1.0, diagonal), axis=-1)
    gram = gram + jnp.eye(gram.shape[-1]) * (unseen[:, :, None] + damping[:, None, None])
    lower = jnp.linalg.cholesky(gram[:, ::-1, ::-1])
    eye = jnp.broadcast_to(jnp.eye(gram.shape[-1]), gram.shape)
    inverse = jax.lax.linalg.triangular_solve(lower, eye, left_side=True, lower=True)
    return inverse[:, ::-1, ::-1]
