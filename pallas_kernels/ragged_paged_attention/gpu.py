"""Ragged paged attention as a Pallas kernel for GPUs (Triton lowering).

Where it sits: `ragged_paged_attention(..., impl="gpu")` calls it on CUDA/ROCm. It keeps every
promise of `reference.ragged_paged_attention_reference` (same arguments, same output) and
matches it to float32 rounding.

How: the wrapper cuts the batch into query blocks of at most Bq tokens of one request
(`metadata.query_blocks`) and lays each block out as M matrix rows per kv head
(`metadata.RowLayout`: Bq tokens x the G q heads that share the kv head). One program per
(query block, kv head) walks its request's pages with a flash-attention online softmax in
float32 (`online_softmax.online_softmax_update`, shared with the TPU kernel) and writes its
[M, H] rows; the wrapper scatters rows back to [T, N, H].

GPU Pallas has no scalar prefetch, so block tables, per-block metadata and the layer index
are ordinary inputs and pages are gathered by dynamic indexing of the whole cache inside
the kernel. The body uses plain ref indexing, `lax.dot_general` and `fori_loop` only, so it
should carry over to Mosaic GPU; the wrapper asks for the Triton backend explicitly.

Triton constraints the wrapper enforces: block_size and H are powers of two >= 16 (they are
dot operand dims); M is a power of two >= 16 by construction.

Axis letters: T tokens, R requests, N q heads, K kv heads, G q heads per kv head (Gp padded),
H head dim, P pages per request, S slots per page, B query blocks, M rows per block.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jengine.pallas_kernels.ragged_paged_attention.metadata import (
    MASK_VALUE,
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


def _kernel(
    # per query block [B] / per request [R, P] / [1] metadata, all in global memory
    request_ref,
    q_len_ref,
    q_pos_ref,
    kv_lens_ref,
    block_tables_ref,
    layer_ref,
    # data
    q_ref,  # [M, H] this block's rows for this kv head
    kv_ref,  # [L, 2, K, num_blocks, S, H] the whole cache
    o_ref,  # [M, H]
    *,
    sm_scale: float,
    group_shift: int,
    has_window: bool,
    soft_cap: float | None,
):
    block, kv_head = pl.program_id(0), pl.program_id(1)
    request = request_ref[block]
    q_len = q_len_ref[block]
    q_pos = q_pos_ref[block]
    kv_len = kv_lens_ref[request]
    num_layers, _, _, num_pages, block_size, _ = kv_ref.shape
    pages_per_request = block_tables_ref.shape[1]
    # Nothing bounds indexing on a GPU but these clamps (tpu.py's `_visible_page` and the
    # reference's gather clamp alike): a stray layer or page id must not leave the cache,
    # nor a kv_len longer than P pages leave the request's row of the table.
    layer = jnp.clip(layer_ref[0], 0, num_layers - 1)
    window = layer_ref[1] if has_window else None
    rows, head_dim = q_ref.shape

    q = q_ref[...]
    row_token = row_tokens(rows, block_size, group_shift)

    def body(page_index, carry):
        acc, m_prev, l_prev = carry
        page = block_tables_ref[request, jnp.minimum(page_index, pages_per_request - 1)]
        page = jnp.clip(page, 0, num_pages - 1)
        return online_softmax_update(
            q,
            kv_ref[layer, 0, kv_head, page],  # [S, H]
            kv_ref[layer, 1, kv_head, page],
            acc,
            m_prev,
            l_prev,
            row_token=row_token,
            q_len=q_len,
            q_pos=q_pos,
            kv_start=page_index * block_size,
            kv_len=kv_len,
            sm_scale=sm_scale,
            sliding_window=window,
            soft_cap=soft_cap,
        )

    first, end = page_range(q_len, q_pos, kv_len, block_size, window)
    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
    )
    acc, _, l = lax.fori_loop(first, end, body, init)
    o_ref[...] = finalize(acc, l, o_ref.dtype)


def _check_shapes(kv_lens, block_tables, query_start_loc, block_size: int, head_dim: int):
    for name, value in (("block_size", block_size), ("head_dim", head_dim)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"the GPU kernel needs {name} to be a power of two >= 16, got {value}")
    # Every block reads its request's row of the table and its kv_len.
    num_requests = kv_lens.shape[0]
    if block_tables.shape[0] < num_requests or block_tables.shape[1] < 1:
        raise ValueError(
            f"block_tables {block_tables.shape} needs a row of pages for each of the "
            f"{num_requests} requests of kv_lens"
        )
    if query_start_loc.shape != (num_requests + 1,):
        raise ValueError(
            f"query_start_loc {query_start_loc.shape} needs one entry more than kv_lens "
            f"{kv_lens.shape}"
        )


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "q_block_size", "soft_cap", "interpret", "num_warps"),
)
def ragged_paged_attention_gpu(
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
    num_warps: int = 4,
) -> jax.Array:
    """Same arguments and result as `ragged_paged_attention_reference`.

    `q_block_size` is rounded up to a power of two; `interpret=True` runs the kernel in the
    Pallas interpreter (any backend, used by the CPU tests), `interpret=pltpu.InterpretParams()`
    in the TPU interpreter, which can raise on every read outside an operand: on a GPU nothing
    would.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, _, block_size, _ = kv_cache.shape
    _check_shapes(kv_lens, block_tables, query_start_loc, block_size, head_dim)
    layout = row_layout(num_q_heads, num_kv_heads, q_block_size)

    kv_lens = kv_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    blocks = query_blocks(query_start_loc, kv_lens, num_tokens, layout.q_block_size)
    token_index = block_token_index(blocks, layout.q_block_size, num_tokens)
    rows = gather_query_rows(q, token_index, num_kv_heads, layout)  # [B, K, M, H]
    num_blocks = rows.shape[0]

    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        group_shift=layout.group_padded.bit_length() - 1,
        has_window=sliding_window is not None,
        soft_cap=soft_cap,
    )
    whole = pl.BlockSpec()  # whole array in global memory, indexed dynamically in the kernel
    row_spec = pl.BlockSpec(
        (pl.squeezed, pl.squeezed, layout.rows, head_dim), lambda b, h: (b, h, 0, 0)
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads),
        in_specs=[whole] * 6 + [row_spec, whole],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(rows.shape, q.dtype),
        compiler_params=(
            pltriton.CompilerParams(num_warps=num_warps, num_stages=2)
            if isinstance(interpret, bool)
            else pltpu.CompilerParams()  # what the TPU interpreter takes
        ),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(
        blocks.request,
        blocks.q_len,
        blocks.q_pos,
        kv_lens,
        block_tables.astype(jnp.int32),
        layer_window(layer, sliding_window),
        rows,
        kv_cache,
    )
    return scatter_query_rows(out, token_index, num_tokens, layout)
