"""The masked online-softmax update both Pallas kernels apply to each page. Pure jnp/lax.

Where it sits: traced inside the kernel bodies of `gpu.py` (once per iteration of its
`fori_loop` over pages) and `tpu.py` (once per step of its "arbitrary" page grid axis).
Each kernel loads one query block's [M, H] rows and one page's [S, H] keys and values its
own way (dynamic indexing of the whole cache on GPU, BlockSpec DMAs on TPU) and keeps the
running state where it likes (loop carry on GPU, VMEM scratch on TPU); the math in between
lives here once.

Promises:
- a key is seen by a row only if the row is a real token of the block (its token index
  r >> group_shift is below q_len), the key is causal for it (position <= the token's),
  inside the context (< kv_len) and, with a sliding window, inside the window (a static
  int or this layer's traced one, <= 0 for none);
- with `soft_cap`, scores (after sm_scale) are cap * tanh(score / cap), as Gemma 2's;
- scores are masked with `where` (never an additive bias) and MASK_VALUE, masked
  probabilities are exactly 0, and V slots past kv_len are zeroed before the PV dot, so
  NaN in cache slots a block does not own never reaches its output;
- scores, m, l and the accumulator are float32; the probabilities enter the PV dot in the
  cache's dtype (bf16 for a bf16 cache), as in flash attention; an fp8 cache's keys and
  values are widened to the queries' dtype first, so both dots run in that dtype;
- `finalize` turns rows that saw no key (l == 0, i.e. padding) into zeros.

Axis letters: M rows per block, S slots per page, H head dim.
"""

import jax
import jax.numpy as jnp
from jax import lax

from jengine.pallas_kernels.ragged_paged_attention.metadata import (
    MASK_VALUE,
    in_window,
    soft_capped,
)


def row_tokens(rows: int, block_size: int, group_shift: int) -> jax.Array:
    """[M, S] token index within the block of each row: r >> log2(Gp) (see `RowLayout`)."""
    return lax.shift_right_logical(
        lax.broadcasted_iota(jnp.int32, (rows, block_size), 0), group_shift
    )


def online_softmax_update(
    q: jax.Array,  # [M, H]
    k: jax.Array,  # [S, H]
    v: jax.Array,  # [S, H]
    acc: jax.Array,  # [M, H] float32
    m_prev: jax.Array,  # [M, 1] float32 running max
    l_prev: jax.Array,  # [M, 1] float32 running sum
    *,
    row_token: jax.Array,  # [M, S] from `row_tokens`
    q_len: jax.Array,
    q_pos: jax.Array,
    kv_start: jax.Array,  # context position of the page's first slot
    kv_len: jax.Array,
    sm_scale: float,
    sliding_window,  # None, an int or a traced int32 scalar (<= 0: none)
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold one page of keys and values into the running (acc, m, l) of a query block."""
    if k.dtype.itemsize == 1:  # an fp8 cache
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    rows, block_size = row_token.shape
    # Rows past q_len (and padding rows) see nothing.
    row_pos = q_pos + row_token
    kv_pos = kv_start + lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)
    mask = (row_token < q_len) & (kv_pos <= row_pos) & (kv_pos < kv_len)
    if sliding_window is not None:
        mask &= in_window(kv_pos, row_pos, sliding_window)

    s = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )  # [M, S]
    # `where`, not an additive bias: NaN keys in unused slots must not reach the max.
    s = jnp.where(mask, soft_capped(s * sm_scale, soft_cap), MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    # Masked probabilities are exactly 0 even while a row's max is still MASK_VALUE.
    p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    # Unused slots may hold NaN and 0 * NaN = NaN: zero them before the dot.
    v_pos = kv_start + lax.broadcasted_iota(jnp.int32, v.shape, 0)
    v = jnp.where(v_pos < kv_len, v, jnp.zeros_like(v))
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return alpha * acc + pv, m_next, l_next


def finalize(acc: jax.Array, l: jax.Array, dtype) -> jax.Array:
    """[M, H] output rows: acc / l, zeros for rows that saw no key (l == 0)."""
    return (acc / jnp.where(l > 0, l, 1.0)).astype(dtype)
