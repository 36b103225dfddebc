"""Ragged paged attention as a Pallas kernel for TPUs (Mosaic lowering).

Where it sits: `ragged_paged_attention(..., impl="tpu")` calls it on TPU. It keeps every
promise of `reference.ragged_paged_attention_reference` (same arguments, same output) and
matches it to float32 rounding.

How: the wrapper cuts the batch into query blocks of at most Bq tokens of one request
(`metadata.query_blocks`) and lays each block out as M matrix rows per kv head
(`metadata.RowLayout`). The grid is (query block, kv head, page): block tables, per-block
metadata and the layer index are scalar-prefetch operands (SMEM), so the K and V BlockSpecs
pick page `block_tables[request, p]` of the right layer and kv head and Pallas pipelines
the page DMAs. The page axis is "arbitrary": an online softmax in VMEM scratch (float32,
`online_softmax.online_softmax_update`, shared with the GPU kernel) carries across it, and
the output block is written once, after the last page. Pages a block cannot see (past its
last token, before its sliding window) map to the nearest visible page, so the pipeline
does not fetch them again, and their step is skipped.

Tiling: the kv block is the trailing (S, H) pair of the cache, so S should be a multiple of
8 (16 for bf16) and H 64 or 128 or a multiple of 128. Scalar prefetch lives in SMEM: the
flattened block table (R x P int32) must fit there.

Axis letters: T tokens, R requests, N q heads, K kv heads, G q heads per kv head (Gp padded),
H head dim, P pages per request, S slots per page, B query blocks, M rows per block.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jengine.pallas_kernels.ragged_paged_attention.metadata import (
    MASK_VALUE,
    RowLayout,
    block_token_index,
    gather_query_rows,
    layer_window,
    page_range,
    query_blocks,
    row_layout,
    scatter_query_rows,
)
from jengine.pallas_kernels.ragged_paged_attention.online_softmax import (
    finalize,
    online_softmax_update,
    row_tokens,
)

# m and l live lane-broadcast in (M, 128) scratch: Mosaic handles full-lane tiles best.
LANES = 128


def _visible_page(
    block,
    page_index,
    request_ref,
    q_len_ref,
    q_pos_ref,
    kv_lens_ref,
    block_tables_ref,
    *,
    pages_per_request: int,
    num_pages: int,
    block_size: int,
    window,
):
    """Cache page for grid step `page_index` of `block`, clamped to the pages it can see."""
    request = request_ref[block]
    first, end = page_range(
        q_len_ref[block], q_pos_ref[block], kv_lens_ref[request], block_size, window
    )
    # Repeating the previous page index makes the pipeline skip the copy.
    page_index = jnp.clip(page_index, first, jnp.maximum(end - 1, first))
    page_index = jnp.minimum(page_index, pages_per_request - 1)
    page = block_tables_ref[request * pages_per_request + page_index]
    return jnp.clip(page, 0, num_pages - 1)  # never DMA outside the cache


def _kernel(
    # scalar prefetch (SMEM)
    request_ref,  # [B]
    q_len_ref,  # [B]
    q_pos_ref,  # [B]
    kv_lens_ref,  # [R]
    block_tables_ref,  # [R * P]
    layer_ref,  # [2]: the layer and its sliding window (0: none)
    # blocks (VMEM)
    q_ref,  # [M, H]
    k_ref,  # [S, H]
    v_ref,  # [S, H]
    o_ref,  # [M, H]
    # scratch (VMEM)
    m_ref,  # [M, LANES]
    l_ref,  # [M, LANES]
    acc_ref,  # [M, H]
    *,
    sm_scale: float,
    group_shift: int,
    has_window: bool,
    soft_cap: float | None,
):
    window = layer_ref[1] if has_window else None
    block, page_index = pl.program_id(0), pl.program_id(2)
    request = request_ref[block]
    q_len = q_len_ref[block]
    q_pos = q_pos_ref[block]
    kv_len = kv_lens_ref[request]
    block_size = k_ref.shape[0]
    rows = q_ref.shape[0]
    first, end = page_range(q_len, q_pos, kv_len, block_size, window)

    @pl.when(page_index == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((page_index >= first) & (page_index < end))
    def _step():
        # All lanes of m and l hold the same value; a lane max turns them back into columns.
        acc, m_next, l_next = online_softmax_update(
            q_ref[...],
            k_ref[...],
            v_ref[...],
            acc_ref[...],
            jnp.max(m_ref[...], axis=1, keepdims=True),  # [M, 1]
            jnp.max(l_ref[...], axis=1, keepdims=True),
            row_token=row_tokens(rows, block_size, group_shift),
            q_len=q_len,
            q_pos=q_pos,
            kv_start=page_index * block_size,
            kv_len=kv_len,
            sm_scale=sm_scale,
            sliding_window=window,
            soft_cap=soft_cap,
        )
        acc_ref[...] = acc
        m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l_next, l_ref.shape)

    @pl.when(page_index == pl.num_programs(2) - 1)
    def _finish():
        l = jnp.max(l_ref[...], axis=1, keepdims=True)
        o_ref[...] = finalize(acc_ref[...], l, o_ref.dtype)


def _grid_spec(
    kv_cache_shape: tuple[int, ...],
    layout: RowLayout,
    num_blocks: int,
    pages_per_request: int,
    has_window: bool,
) -> pltpu.PrefetchScalarGridSpec:
    """The (query block, kv head, page) grid after the 6 scalar-prefetch operands: q and
    output rows per (block, kv head), the K and V page `_visible_page` picks, and the
    m / l / acc scratch."""
    _, _, num_kv_heads, num_pages, block_size, head_dim = kv_cache_shape
    visible_page = functools.partial(
        _visible_page,
        pages_per_request=pages_per_request,
        num_pages=num_pages,
        block_size=block_size,
    )

    def row_map(b, h, p, *_):
        return b, h, 0, 0

    def kv_map(which):
        def index_map(b, h, p, request, q_len, q_pos, kv_lens, tables, layer):
            window = layer[1] if has_window else None
            page = visible_page(b, p, request, q_len, q_pos, kv_lens, tables, window=window)
            return layer[0], which, h, page, 0, 0

        return index_map

    squeezed = pl.squeezed
    row_spec = pl.BlockSpec((squeezed, squeezed, layout.rows, head_dim), row_map)
    kv_block = (squeezed,) * 4 + (block_size, head_dim)
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(num_blocks, num_kv_heads, pages_per_request),
        in_specs=[
            row_spec,
            pl.BlockSpec(kv_block, kv_map(0)),
            pl.BlockSpec(kv_block, kv_map(1)),
        ],
        out_specs=row_spec,
        scratch_shapes=[
            pltpu.VMEM((layout.rows, LANES), jnp.float32),
            pltpu.VMEM((layout.rows, LANES), jnp.float32),
            pltpu.VMEM((layout.rows, head_dim), jnp.float32),
        ],
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "q_block_size", "soft_cap", "interpret"))
def ragged_paged_attention_tpu(
    q: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array | int,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    *,
    sm_scale: float,
    q_block_size: int = 16,
    sliding_window=None,
    soft_cap: float | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Same arguments and result as `ragged_paged_attention_reference`.

    `q_block_size` is rounded up to a power of two; `interpret=True` runs the kernel in the
    Pallas interpreter (any backend, used by the CPU tests), `interpret=pltpu.InterpretParams()`
    in the TPU interpreter, which also simulates the page DMAs.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[2]
    num_requests, pages_per_request = block_tables.shape
    layout = row_layout(num_q_heads, num_kv_heads, q_block_size)

    kv_lens = kv_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    blocks = query_blocks(query_start_loc, kv_lens, num_tokens, layout.q_block_size)
    token_index = block_token_index(blocks, layout.q_block_size, num_tokens)
    rows = gather_query_rows(q, token_index, num_kv_heads, layout)  # [B, K, M, H]
    num_blocks = rows.shape[0]

    has_window = sliding_window is not None
    grid_spec = _grid_spec(kv_cache.shape, layout, num_blocks, pages_per_request, has_window)
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        group_shift=layout.group_padded.bit_length() - 1,
        has_window=sliding_window is not None,
        soft_cap=soft_cap,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(
        blocks.request,
        blocks.q_len,
        blocks.q_pos,
        kv_lens,
        block_tables.astype(jnp.int32).reshape(num_requests * pages_per_request),
        layer_window(layer, sliding_window),
        rows,
        kv_cache,
        kv_cache,
    )
    return scatter_query_rows(out, token_index, num_tokens, layout)
