"""Ragged paged attention in plain XLA: the CPU production path and the kernels' oracle.

Where it sits: the model calls it once per layer with the queries of one ragged batch
(prefill chunks and decodes mixed) and the whole stacked KV cache. It promises:
- every token attends causally to its own request's context only (its pages in
  `block_tables`, up to its position), never to another request's or an unused page;
- memory O((T / Bq + R) x chunk): queries are cut into blocks of up to Bq tokens of one
  request, and each block walks its request's pages a chunk at a time with an online
  softmax (flash-attention style), so nothing of size tokens x context is ever built;
- chunks past the longest context in the batch are skipped at run time (`lax.cond`), so
  a step costs what its contexts need whatever the block-table width, and the block
  table does not have to be bucketed;
- rows of padding tokens (past `query_start_loc[-1]`) come back as zeros;
- unused cache pages may hold anything, NaN included: masked values never reach the output;
- it is differentiable (static trip count), so training code can reuse the same forward.

KV cache layout: `[L, 2, K, num_blocks, block_size, H]` (layer, k/v, kv head, page, slot,
head dim). Keeping the kv-head axis ahead of the pages lets a tensor-parallel mesh shard
the cache over kv heads and gives TPU tiles of (block_size, H).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.metadata import block_token_index, query_blocks

# Context tokens one loop iteration reads per query block. Small chunks keep the gathered
# pages in cache between the gather and the two einsums; measured on the 2-core CPU
# (8 layers, 64 decodes, context 300): 16-32 tokens ~240 ms, 128 ~370 ms, one shot ~700 ms.
KV_CHUNK_TOKENS = 32


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
      q_block_size: Bq, the tokens one walk over a request's pages serves; 1 is best for
        decode-only steps.
      sliding_window: if set, a token sees only the last `sliding_window` positions.
    Returns:
      [T, N, H] attention output in q's dtype.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[4]
    group = num_q_heads // num_kv_heads
    pages_per_request = block_tables.shape[1]
    chunk_pages = max(1, min(pages_per_request, KV_CHUNK_TOKENS // block_size))
    num_chunks = -(-pages_per_request // chunk_pages)
    chunk_tokens = chunk_pages * block_size

    blocks = query_blocks(query_start_loc, kv_lens, num_tokens, q_block_size)
    token_offsets = jnp.arange(q_block_size, dtype=jnp.int32)
    token_index = block_token_index(blocks, q_block_size, num_tokens)  # unused: out of range
    q_blocks = q.at[token_index].get(mode="fill", fill_value=0).astype(jnp.float32)
    q_blocks = q_blocks.reshape(*token_index.shape, num_kv_heads, group, head_dim)
    q_blocks = q_blocks * sm_scale  # [B, Q, K, G, H]

    num_blocks = token_index.shape[0]
    pages = block_tables[blocks.request]  # [B, P]
    pages = jnp.pad(pages, ((0, 0), (0, num_chunks * chunk_pages - pages_per_request)))
    block_kv_lens = kv_lens[blocks.request]  # [B]
    q_pos = blocks.q_pos[:, None] + token_offsets[None, :]  # [B, Q]
    # The furthest any block can see; chunks past it are skipped.
    visible = jnp.where(
        blocks.q_len > 0, jnp.minimum(blocks.q_pos + blocks.q_len, block_kv_lens), 0
    )
    num_chunks_needed = (jnp.max(visible) + chunk_tokens - 1) // chunk_tokens
    kv_cache = jnp.asarray(kv_cache)

    def attend_chunk(carry, chunk):
        row_max, denom, acc = carry
        chunk_page_ids = jax.lax.dynamic_slice_in_dim(pages, chunk * chunk_pages, chunk_pages, 1)
        # Index the layer inside the gather: a `kv_cache[layer]` slice taken outside the loop
        # would be materialized, copying a whole layer of the cache per call.
        # (The advanced indices come first: [B, chunk_pages, 2, K, S, H].)
        kv = kv_cache[layer, :, :, chunk_page_ids].transpose(2, 3, 0, 1, 4, 5)
        kv = kv.reshape(2, num_kv_heads, num_blocks, chunk_tokens, head_dim).astype(jnp.float32)
        k, v = kv[0], kv[1]  # [K, B, C, H]
        kv_pos = chunk * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)
        kv_valid = kv_pos[None, :] < block_kv_lens[:, None]  # [B, C]
        mask = kv_valid[:, None, :] & (kv_pos[None, None, :] <= q_pos[:, :, None])  # [B, Q, C]
        if sliding_window is not None:
            mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        # Unused pages may hold NaN: zero them so 0-probability * NaN cannot poison the sum.
        v = jnp.where(kv_valid[None, :, :, None], v, 0)
        scores = jnp.einsum("bqkgh,kbch->bkgqc", q_blocks, k)
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
        # Rows that have seen no visible key yet keep a finite reference point.
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0)
        probs = jnp.exp(scores - safe_max[..., None])
        correction = jnp.exp(jnp.where(jnp.isfinite(row_max), row_max, safe_max) - safe_max)
        denom = denom * correction + jnp.sum(probs, axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("bkgqc,kbch->bkgqh", probs, v)
        return new_max, denom, acc

    def step(carry, chunk):
        carry = jax.lax.cond(chunk < num_chunks_needed, attend_chunk, lambda c, _: c, carry, chunk)
        return carry, None

    shape = (num_blocks, num_kv_heads, group, q_block_size)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    (_, denom, acc), _ = jax.lax.scan(step, init, jnp.arange(num_chunks, dtype=jnp.int32))
    out = acc / jnp.where(denom > 0, denom, 1)[..., None]  # [B, K, G, Q, H]
    out = out.transpose(0, 3, 1, 2, 4).reshape(*token_index.shape, num_q_heads, head_dim)

    result = jnp.zeros_like(q)
    return result.at[token_index].set(out.astype(q.dtype), mode="drop")
