"""Query-block metadata shared by the reference and both Pallas kernels.

A ragged batch holds the new tokens of R requests back to back (`query_start_loc`). Every
implementation cuts each request's queries into blocks of at most `q_block_size` tokens
that belong to one request only, so a block reads the pages of exactly one request. The
number of blocks is static: a request of q_len tokens needs ceil(q_len / Bq) blocks, so
T tokens over R requests need at most min(T, T // Bq + R) blocks. Unused blocks have
q_len 0 and point at request 0; every implementation masks them out.

The Pallas kernels also share how a block becomes matrix rows (`RowLayout`,
`gather_query_rows`, `scatter_query_rows`) and which pages a block can see (`page_range`);
the per-page softmax math they share lives in `online_softmax.py`.

Axis letters: T tokens, R requests, B query blocks, Q tokens per block, P pages per request,
N q heads, K kv heads, G q heads per kv head (Gp padded), H head dim, M rows per block.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# Finite stand-in for -inf in the Pallas kernels: exp(MASK - MASK) must not be NaN for
# rows that have seen no key yet.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class QueryBlocks(NamedTuple):
    request: jax.Array  # [B] int32: which request the block belongs to
    q_start: jax.Array  # [B] int32: first token of the block in the flat batch
    q_len: jax.Array  # [B] int32: tokens in the block (0 for unused blocks)
    q_pos: jax.Array  # [B] int32: context position of the block's first token


def num_query_blocks(num_tokens: int, num_requests: int, q_block_size: int) -> int:
    """Static upper bound on the number of query blocks of a ragged batch."""
    return max(1, min(num_tokens, num_tokens // q_block_size + num_requests))


def query_blocks(
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    num_tokens: int,
    q_block_size: int,
    q_lens: jax.Array | None = None,
) -> QueryBlocks:
    """Split each request's queries into blocks of at most `q_block_size` tokens.

    `q_lens` ([R], each 0 or the request's whole query length) leaves out the requests
    given 0; by default every request is split.
    """
    num_requests = kv_lens.shape[0]
    num_blocks = num_query_blocks(num_tokens, num_requests, q_block_size)
    full_q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [R]
    if q_lens is None:
        q_lens = full_q_lens
    blocks_per_request = (q_lens + q_block_size - 1) // q_block_size
    first_block = jnp.cumsum(blocks_per_request) - blocks_per_request  # exclusive cumsum
    block_ids = jnp.arange(num_blocks, dtype=jnp.int32)
    # A block belongs to the last request whose first block is at or before it. All
    # comparisons at once: the default binary search is a loop, and on a GPU each of a
    # loop's log2(R) turns is launched from the host, in every layer.
    ends = first_block + blocks_per_request
    request = jnp.searchsorted(ends, block_ids, side="right", method="compare_all")
    in_use = request < num_requests
    request = jnp.where(in_use, request, 0).astype(jnp.int32)
    index_in_request = block_ids - first_block[request]
    offset = index_in_request * q_block_size
    q_len = jnp.clip(q_lens[request] - offset, 0, q_block_size)
    q_len = jnp.where(in_use, q_len, 0).astype(jnp.int32)
    q_start = (query_start_loc[request] + offset).astype(jnp.int32)
    # The first new token of a request sits at context position kv_len - q_len.
    q_pos = (kv_lens[request] - full_q_lens[request] + offset).astype(jnp.int32)
    return QueryBlocks(request, q_start, q_len, q_pos)


def decode_blocks(query_start_loc: jax.Array, kv_lens: jax.Array, selected: jax.Array):
    """One single-token block per request ([R] blocks), empty where `selected` is False."""
    request = jnp.arange(kv_lens.shape[0], dtype=jnp.int32)
    q_len = selected.astype(jnp.int32)
    q_pos = jnp.maximum(kv_lens - 1, 0).astype(jnp.int32)
    return QueryBlocks(request, query_start_loc[:-1].astype(jnp.int32), q_len, q_pos)


class RowLayout(NamedTuple):
    """How the Pallas kernels lay one query block out as matrix rows for one kv head.

    Row r of a block holds token r // Gp of the block and q head r % Gp of the kv head's
    group; Gp is the group size G = N / K padded to a power of two and M = max(16, Bq * Gp)
    rows, so the row count suits both Triton (powers of two, dot operands >= 16) and TPU
    sublane tiling. Rows of padded heads or tokens hold zeros and are dropped on the way out.
    """

    q_block_size: int  # Bq, a power of two
    group: int  # G
    group_padded: int  # Gp
    rows: int  # M


def row_layout(num_q_heads: int, num_kv_heads: int, q_block_size: int) -> RowLayout:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} q heads are not a multiple of {num_kv_heads} kv heads")
    group = num_q_heads // num_kv_heads
    q_block_size = 1 << (max(q_block_size, 1) - 1).bit_length()
    group_padded = 1 << (group - 1).bit_length()
    return RowLayout(q_block_size, group, group_padded, max(16, q_block_size * group_padded))


def block_token_index(blocks: QueryBlocks, q_block_size: int, num_tokens: int) -> jax.Array:
    """[B, Q] flat token index of each block slot; `num_tokens` (out of range) when unused."""
    offsets = jnp.arange(q_block_size, dtype=jnp.int32)
    index = blocks.q_start[:, None] + offsets[None, :]
    return jnp.where(offsets[None, :] < blocks.q_len[:, None], index, num_tokens)


def gather_query_rows(
    q: jax.Array, token_index: jax.Array, num_kv_heads: int, layout: RowLayout
) -> jax.Array:
    """[T, N, H] queries -> [B, K, M, H] kernel rows (see `RowLayout`), zeros where unused."""
    num_tokens, _, head_dim = q.shape
    num_blocks, q_block_size = token_index.shape
    q = q.reshape(num_tokens, num_kv_heads, layout.group, head_dim)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, layout.group_padded - layout.group), (0, 0)))
    rows = q.at[token_index].get(mode="fill", fill_value=0)  # [B, Q, K, Gp, H]
    rows = rows.transpose(0, 2, 1, 3, 4)
    rows = rows.reshape(num_blocks, num_kv_heads, q_block_size * layout.group_padded, head_dim)
    extra = layout.rows - rows.shape[2]
    return jnp.pad(rows, ((0, 0), (0, 0), (0, extra), (0, 0)))


def scatter_query_rows(
    out: jax.Array, token_index: jax.Array, num_tokens: int, layout: RowLayout
) -> jax.Array:
    """Inverse of `gather_query_rows`: [B, K, M, H] -> [T, N, H], zeros for padding tokens."""
    num_blocks, num_kv_heads, _, head_dim = out.shape
    q_block_size = token_index.shape[1]
    out = out[:, :, : q_block_size * layout.group_padded]
    out = out.reshape(num_blocks, num_kv_heads, q_block_size, layout.group_padded, head_dim)
    out = out[:, :, :, : layout.group].transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_blocks, q_block_size, num_kv_heads * layout.group, head_dim)
    result = jnp.zeros((num_tokens, *out.shape[2:]), out.dtype)
    return result.at[token_index].set(out, mode="drop")


def page_range(
    q_len: jax.Array,
    q_pos: jax.Array,
    kv_len: jax.Array,
    block_size: int,
    sliding_window,
) -> tuple[jax.Array, jax.Array]:
    """[first, end) pages of its request that a query block can see (scalars, empty if unused).

    The last token of the block sits at q_pos + q_len - 1, so nothing past it is read; with a
    sliding window nothing before the first token's window is read either.
    """
    # lax.div (truncating) on non-negative values: `//` lowers through `sign`, which the
    # TPU lowering cannot emit without a TPU attached.
    size = jnp.int32(block_size)
    visible = jnp.maximum(jnp.minimum(q_pos + q_len, kv_len), 0)
    end = jnp.where(q_len > 0, lax.div(visible + size - 1, size), 0)
    if sliding_window is None:
        return jnp.zeros_like(end), end
    window = jnp.asarray(sliding_window, jnp.int32)
    first = jnp.where(window > 0, lax.div(jnp.maximum(q_pos - window + 1, 0), size), 0)
    return jnp.minimum(first, end), end


def layer_window(layer, sliding_window) -> jax.Array:
    """[2] int32: the cache layer a kernel reads and its sliding window (0: none), the
    kernels' one small operand for both (a layer scan passes each layer's own)."""
    window = 0 if sliding_window is None else sliding_window
    return jnp.stack([jnp.asarray(layer, jnp.int32).reshape(()), jnp.asarray(window, jnp.int32)])


def in_window(kv_pos: jax.Array, row_pos: jax.Array, sliding_window) -> jax.Array:
    """Whether a key at `kv_pos` is inside the window of a row at `row_pos`: it is one of
    the last `sliding_window` positions. The window is static (an int) or traced (a
    per-layer int32 scalar); <= 0 means no window for that layer."""
    window = jnp.asarray(sliding_window, jnp.int32)
    return (window <= 0) | (kv_pos > row_pos - window)


def soft_capped(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    """Gemma 2's attention logit soft-capping: cap * tanh(scores / cap) (scores already
    scaled by sm_scale), before masking."""
    if soft_cap is None:
        return scores
    return soft_cap * jnp.tanh(scores / soft_cap)
