"""Ragged paged attention in plain XLA: the CPU production path and the kernels' oracle.

Where it sits: the model calls it once per layer with the queries of one ragged batch
(prefill chunks and decodes mixed) and the whole stacked KV cache. It promises:
- every token attends causally to its own request's context only (its pages in
  `block_tables`, up to its position), never to another request's or an unused page;
- memory O((T / Bq + R) x context): the pages are gathered once per query block of up
  to Bq tokens of one request, never once per token;
- rows of padding tokens (past `query_start_loc[-1]`) come back as zeros;
- unused cache pages may hold anything, NaN included: masked values never reach the output.

KV cache layout: `[L, 2, K, num_blocks, block_size, H]` (layer, k/v, kv head, page, slot,
head dim). Keeping the kv-head axis ahead of the pages lets a tensor-parallel mesh shard
the cache over kv heads and gives TPU tiles of (block_size, H).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.metadata import query_blocks


def update_kv_cache(
    kv_cache: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Write the new keys and values ([T, K, H] each) into their slots of one layer.

    `slot_mapping[t] = page * block_size + offset`; padding tokens point into the null
    page 0, whose contents are never read as context.
    """
    block_size = kv_cache.shape[4]
    page = slot_mapping // block_size
    offset = slot_mapping % block_size
    new = jnp.stack([k, v], axis=1).astype(kv_cache.dtype)  # [T, 2, K, H]
    return kv_cache.at[layer, :, :, page, offset].set(new)


def ragged_paged_attention_reference(
    q: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array | int,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    *,
    sm_scale: float,
    q_block_size: int = 16,
    sliding_window: int | None = None,
) -> jax.Array:
    """Attention of a ragged batch over a paged KV cache.

    Args:
      q: [T, N, H] queries of all scheduled tokens, requests back to back.
      kv_cache: [L, 2, K, num_blocks, block_size, H] with this step's K/V already written.
      layer: which layer of the cache to read.
      kv_lens: [R] context length of each request including this step's tokens
        (0 for padding requests).
      block_tables: [R, P] page ids of each request; entries past its context are ignored.
      query_start_loc: [R + 1] cumulative query lengths (padding requests have q_len 0).
      sm_scale: softmax scale, usually head_dim ** -0.5.
      q_block_size: Bq, the tokens one gathered copy of a request's pages serves;
        1 is best for decode-only steps.
      sliding_window: if set, a token sees only the last `sliding_window` positions.
    Returns:
      [T, N, H] attention output in q's dtype.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[4]
    group = num_q_heads // num_kv_heads
    pages_per_request = block_tables.shape[1]
    context = pages_per_request * block_size

    blocks = query_blocks(query_start_loc, kv_lens, num_tokens, q_block_size)
    token_offsets = jnp.arange(q_block_size, dtype=jnp.int32)
    token_valid = token_offsets[None, :] < blocks.q_len[:, None]  # [B, Q]
    token_index = blocks.q_start[:, None] + token_offsets[None, :]
    token_index = jnp.where(token_valid, token_index, num_tokens)  # out of range: dropped
    q_blocks = q.at[token_index].get(mode="fill", fill_value=0)  # [B, Q, N, H]
    q_blocks = q_blocks.reshape(*token_index.shape, num_kv_heads, group, head_dim)

    # One gather of the request's pages per query block: [2, K, B, P, S, H] -> [2, B, K, C, H]
    pages = block_tables[blocks.request]  # [B, P]
    kv = jnp.asarray(kv_cache)[layer][:, :, pages]
    kv = kv.reshape(2, num_kv_heads, -1, context, head_dim).transpose(0, 2, 1, 3, 4)
    k, v = kv[0], kv[1]

    kv_pos = jnp.arange(context, dtype=jnp.int32)
    q_pos = blocks.q_pos[:, None] + token_offsets[None, :]  # [B, Q]
    kv_valid = kv_pos[None, :] < kv_lens[blocks.request][:, None]  # [B, C]
    mask = kv_valid[:, None, :] & (kv_pos[None, None, :] <= q_pos[:, :, None])  # [B, Q, C]
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    # Unused pages may hold NaN: zero them so 0-probability * NaN cannot poison the sum.
    v = jnp.where(kv_valid[:, None, :, None], v, 0)

    scores = jnp.einsum("bqkgh,bkch->bkgqc", q_blocks.astype(jnp.float32), k.astype(jnp.float32))
    scores = jnp.where(mask[:, None, None], scores * sm_scale, -jnp.inf)
    # Rows with no visible key (unused blocks) would be all -inf: keep them finite.
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1)
    out = jnp.einsum("bkgqc,bkch->bqkgh", probs, v.astype(jnp.float32))
    out = out.reshape(*token_index.shape, num_q_heads, head_dim).astype(q.dtype)

    result = jnp.zeros_like(q)
    return result.at[token_index].set(out, mode="drop")
