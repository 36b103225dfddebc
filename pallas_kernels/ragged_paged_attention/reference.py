"""Ragged paged attention in plain XLA: the kernels' oracle and the portable path.

Where it sits: every kernel (`cpu.cc`, `gpu.py`, `tpu.py`) is tested against it; it serves
on CPU where the C++ kernel does not (no compiler, bfloat16, odd head or page sizes) and
computes the C++ kernel's derivatives. Like every kernel, it is called once per layer with
the queries of one ragged batch (prefill chunks and decodes mixed) and the whole stacked KV
cache. It promises:
- every token attends causally to its own request's context only (its pages in
  `block_tables`, up to its position), never to another request's or an unused page;
- memory O((T / Bq + R) x a few pages): queries are cut into blocks of up to Bq tokens of
  one request, and each block walks its request's pages a few at a time with an online softmax
  (flash-attention style), so nothing of size tokens x context is ever built;
- a step costs what its contexts need, whatever the block-table width: blocks are sorted
  by how far they see and walk their pages in groups of `GROUP_BLOCKS`, each group only
  as far as its longest block (`lax.cond` skips the rest), so short requests batched with
  long ones, and the early blocks of a causal prefill, do not pay for the longest context;
- rows of padding tokens (past `query_start_loc[-1]`) come back as zeros;
- unused cache pages may hold anything, NaN included: masked values never reach the output;
- it is differentiable (static trip counts), so training code can reuse the same forward.

KV cache layout: `[L, 2, K, num_blocks, block_size, H]` (layer, k/v, kv head, page, slot,
head dim). Keeping the kv-head axis ahead of the pages lets a tensor-parallel mesh shard
the cache over kv heads and gives TPU tiles of (block_size, H).
"""

from functools import partial

import jax
import jax.numpy as jnp

from jengine.pallas_kernels.ragged_paged_attention.metadata import (
    QueryBlocks,
    block_token_index,
    decode_blocks,
    in_window,
    query_blocks,
    soft_capped,
)

# Query blocks that walk their pages together, sorted by how far they see.
GROUP_BLOCKS = 16
# Pages one loop step reads per block: two for single-token (decode) blocks, four (64
# tokens at block size 16) for prefill blocks, whose matmuls are then [Bq*G, H] x [H, 64].
# Measured on the 2-core CPU, 56M Llama, 64 decodes with contexts 65-384 (decode step) and
# a 2048-token step of 10 prefill chunks + 54 decodes (mixed step): lockstep walk of all
# blocks in 32-token chunks (the previous version) 182 ms / 1824 ms; groups of 16, one
# page per step 116 ms / 1044 ms; four pages per prefill step 116 ms / ~920 ms. Two pages
# per decode step: 128-request decode step min 186 -> 171 ms, median 220 -> 216 ms (A/B
# in one process, 25 runs each). Groups of 8 or 32 were within noise of 16.
DECODE_PAGES_PER_STEP = 2
PREFILL_PAGES_PER_STEP = 4


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
    new = to_cache_dtype(jnp.stack([k, v], axis=1), kv_cache.dtype)  # [T, 2, K, H]
    return kv_cache.at[layer, :, :, page, offset].set(new)


def to_cache_dtype(x: jax.Array, dtype) -> jax.Array:
    """`x` in the cache's dtype. Into an fp8 cache values saturate at the format's largest
    finite value, as vLLM's uncalibrated (scale 1) fp8 cache writes them: a plain cast
    turns what lies past it into NaN (e4m3fn has no infinity) or infinity (e5m2)."""
    if jnp.dtype(dtype).itemsize == 1:
        limit = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -limit, limit)
    return x.astype(dtype)


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
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
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
      q_block_size: Bq, the tokens one walk over a request's pages serves. With Bq > 1,
        requests with one new token still get blocks of one (their own walk) and longer
        ones blocks of Bq; Bq = 1 (decode-only steps) gives every token its own block.
      sliding_window: if set, a token sees only the last `sliding_window` positions: an
        int, or a traced int32 scalar (a layer's own window inside a layer scan, <= 0
        for a layer without one).
      soft_cap: if set, scores (after sm_scale) become cap * tanh(score / cap) (Gemma 2).
    Returns:
      [T, N, H] attention output in q's dtype.
    """
    if q_block_size == 1:
        decodes = query_blocks(query_start_loc, kv_lens, q.shape[0], 1)
        block_sets = [(decodes, 1, DECODE_PAGES_PER_STEP)]
    else:
        # Decodes (one new token) get blocks of one token, longer requests blocks of
        # q_block_size: a decode alone in a block of Bq rows would cost Bq times the
        # matrix work for the same pages.
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        decodes = decode_blocks(query_start_loc, kv_lens, q_lens == 1)
        longer = query_blocks(
            query_start_loc, kv_lens, q.shape[0], q_block_size, jnp.where(q_lens > 1, q_lens, 0)
        )
        block_sets = [
            (decodes, 1, DECODE_PAGES_PER_STEP),
            (longer, q_block_size, PREFILL_PAGES_PER_STEP),
        ]
    result = jnp.zeros_like(q)
    for blocks, block_q, pages_per_step in block_sets:
        token_index, out = _attend_blocks(
            q,
            kv_cache,
            layer,
            kv_lens,
            block_tables,
            blocks,
            block_q,
            pages_per_step,
            sm_scale,
            sliding_window,
            soft_cap,
        )
        result = result.at[token_index].set(out.astype(q.dtype), mode="drop")
    return result


def _pad_to(x: jax.Array, width: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (0, width - x.shape[1])))


def _gather_pages(kv_cache: jax.Array, layer, kv: int, page_ids: jax.Array) -> jax.Array:
    """Keys (kv=0) or values (kv=1) of one layer's pages: [GS, C] ids -> [GS, K, C * S, H].

    The output is laid out for a matmul batched over (block, kv head), so nothing is
    transposed after the gather. The layer is indexed inside the gather: a `kv_cache[layer]`
    slice taken outside the loop would be materialized, a copy of a whole layer per call.
    """
    _, _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    num_blocks, num_pages = page_ids.shape
    index = jnp.stack(
        [
            jnp.broadcast_to(jnp.asarray(layer, jnp.int32), page_ids.shape),
            jnp.full(page_ids.shape, kv, jnp.int32),
            page_ids,
        ],
        axis=-1,
    )
    dims = jax.lax.GatherDimensionNumbers(
        offset_dims=(1, 3, 4),  # [GS, K, C, S, H]: K, S and H come from the slice
        collapsed_slice_dims=(0, 1, 3),
        start_index_map=(0, 1, 3),
    )
    pages = jax.lax.gather(
        kv_cache,
        index,
        dims,
        slice_sizes=(1, 1, num_kv_heads, 1, block_size, head_dim),
        mode=jax.lax.GatherScatterMode.CLIP,
    )
    return pages.reshape(num_blocks, num_kv_heads, num_pages * block_size, head_dim)


def _attend_pages(kv_cache, layer, step_tokens, window, soft_cap, group_xs, carry, step):
    """One online-softmax step of a group of query blocks over their next `step_tokens`
    keys (`pages_per_step` pages of each block's request)."""
    row_max, denom, acc = carry
    page_ids = group_xs["pages"][:, step]  # [GS, pages_per_step]
    k = _gather_pages(kv_cache, layer, 0, page_ids).astype(jnp.float32)
    v = _gather_pages(kv_cache, layer, 1, page_ids).astype(jnp.float32)
    kv_pos = step * step_tokens + jnp.arange(step_tokens, dtype=jnp.int32)
    kv_valid = kv_pos[None, :] < group_xs["kv_lens"][:, None]  # [GS, C]
    q_pos = group_xs["q_pos"]
    mask = kv_valid[:, None, :] & (kv_pos[None, None, :] <= q_pos[:, :, None])  # [GS, rows, C]
    if window is not None:
        mask &= in_window(kv_pos[None, None, :], q_pos[:, :, None], window)
    # Unused slots may hold NaN: zero them so 0-probability * NaN cannot poison the sum.
    v = jnp.where(kv_valid[:, None, :, None], v, 0)
    scores = soft_capped(jnp.einsum("bkmh,bksh->bkms", group_xs["q"], k), soft_cap)
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
    # Rows that have seen no visible key yet keep a finite reference point.
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0)
    probs = jnp.exp(scores - safe_max[..., None])
    correction = jnp.exp(jnp.where(jnp.isfinite(row_max), row_max, safe_max) - safe_max)
    denom = denom * correction + jnp.sum(probs, axis=-1)
    acc = acc * correction[..., None] + jnp.einsum("bkms,bksh->bkmh", probs, v)
    return new_max, denom, acc


def _attend_blocks(
    q,
    kv_cache,
    layer,
    kv_lens,
    block_tables,
    blocks: QueryBlocks,
    q_block_size: int,
    pages_per_step: int,
    sm_scale: float,
    sliding_window,
    soft_cap: float | None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of one set of query blocks: ([B, Q] token index, [B, Q, N, H] f32 output)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[4]
    group = num_q_heads // num_kv_heads
    pages_per_step = min(pages_per_step, block_tables.shape[1])
    num_steps = -(-block_tables.shape[1] // pages_per_step)
    step_tokens = pages_per_step * block_size
    rows = group * q_block_size  # matrix rows of one block and kv head: (q head, token)

    # Sort the blocks by how far they see (longest first), then cut them into groups.
    visible = jnp.where(
        blocks.q_len > 0, jnp.minimum(blocks.q_pos + blocks.q_len, kv_lens[blocks.request]), 0
    )
    order = jnp.argsort(-visible)
    num_blocks = blocks.request.shape[0]
    group_size = min(GROUP_BLOCKS, num_blocks)
    num_groups = -(-num_blocks // group_size)
    padding = num_groups * group_size - num_blocks  # padded blocks have q_len 0
    blocks = QueryBlocks(*(jnp.pad(field[order], (0, padding)) for field in blocks))
    visible = jnp.pad(visible[order], (0, padding))

    def grouped(x):  # [groups * group_size, ...] -> [groups, group_size, ...]
        return x.reshape(num_groups, group_size, *x.shape[1:])

    token_index = block_token_index(blocks, q_block_size, num_tokens)  # unused: out of range
    q_blocks = q.at[token_index].get(mode="fill", fill_value=0).astype(jnp.float32) * sm_scale
    q_blocks = q_blocks.reshape(-1, q_block_size, num_kv_heads, group, head_dim)
    q_blocks = q_blocks.transpose(0, 2, 3, 1, 4).reshape(-1, num_kv_heads, rows, head_dim)
    token_offsets = jnp.tile(jnp.arange(q_block_size, dtype=jnp.int32), group)
    xs = dict(
        q=grouped(q_blocks),  # [groups, GS, K, rows, H]
        q_pos=grouped(blocks.q_pos[:, None] + token_offsets[None, :]),  # [groups, GS, rows]
        # [groups, GS, steps, pages_per_step]
        pages=grouped(_pad_to(block_tables[blocks.request], num_steps * pages_per_step)).reshape(
            num_groups, group_size, num_steps, pages_per_step
        ),
        kv_lens=grouped(kv_lens[blocks.request]),  # [groups, GS]
        # Sorted, so a group's first block sees furthest.
        steps_needed=(grouped(visible)[:, 0] + step_tokens - 1) // step_tokens,  # [groups]
    )
    kv_cache = jnp.asarray(kv_cache)

    def attend_group(_, group_xs):
        def walk(carry, step):
            carry = jax.lax.cond(
                step < group_xs["steps_needed"],
                partial(
                    _attend_pages, kv_cache, layer, step_tokens, sliding_window, soft_cap, group_xs
                ),
                lambda c, _: c,
                carry,
                step,
            )
            return carry, None

        shape = (group_size, num_kv_heads, rows)
        init = (
            jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32),
        )
        steps = jnp.arange(num_steps, dtype=jnp.int32)
        (_, denom, acc), _ = jax.lax.scan(walk, init, steps)
        return None, acc / jnp.where(denom > 0, denom, 1)[..., None]

    _, out = jax.lax.scan(attend_group, None, xs)  # [groups, GS, K, rows, H]
    out = out.reshape(-1, num_kv_heads, group, q_block_size, head_dim).transpose(0, 3, 1, 2, 4)
    return token_index, out.reshape(*token_index.shape, num_q_heads, head_dim)
