"""Query-block metadata shared by the attention kernels, on small hand-checked batches.

The main batch: three requests with 5, 1 and 0 new tokens (the last one is padding), kv
lengths 5, 10 and 0, and two padding tokens after the real six (T = 8), cut into query
blocks of Bq = 4 tokens. That needs ceil(5/4) + ceil(1/4) = 3 blocks; the static bound is
min(T, T // Bq + R) = min(8, 2 + 3) = 5, so two blocks stay unused.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jengine.pallas_kernels.ragged_paged_attention.metadata import (
    RowLayout,
    block_token_index,
    decode_blocks,
    gather_query_rows,
    num_query_blocks,
    page_range,
    query_blocks,
    row_layout,
    scatter_query_rows,
)

QUERY_START_LOC = jnp.array([0, 5, 6, 6], jnp.int32)
KV_LENS = jnp.array([5, 10, 0], jnp.int32)
NUM_TOKENS, Q_BLOCK = 8, 4


def main_blocks():
    return query_blocks(QUERY_START_LOC, KV_LENS, NUM_TOKENS, Q_BLOCK)


def test_num_query_blocks_bound():
    assert num_query_blocks(8, 3, 4) == 5
    assert num_query_blocks(8, 8, 1) == 8  # never more blocks than tokens
    assert num_query_blocks(512, 64, 16) == 96
    assert num_query_blocks(0, 0, 16) == 1  # at least one block


def test_query_blocks_split_each_request():
    blocks = main_blocks()
    # Blocks 0 and 1 are request 0's tokens 0-3 and 4; block 2 is request 1's single
    # token; blocks 3 and 4 are unused: request 0, q_len 0.
    np.testing.assert_array_equal(blocks.request, [0, 0, 1, 0, 0])
    np.testing.assert_array_equal(blocks.q_len, [4, 1, 1, 0, 0])
    np.testing.assert_array_equal(blocks.q_start[:3], [0, 4, 5])
    # Request 1's new token is the last of its 10: context position 9.
    np.testing.assert_array_equal(blocks.q_pos[:3], [0, 4, 9])


def test_query_blocks_leave_out_requests_given_zero():
    """`q_lens` selects requests (each 0 or its whole query length)."""
    q_lens = jnp.array([0, 1, 0], jnp.int32)
    blocks = query_blocks(QUERY_START_LOC, KV_LENS, NUM_TOKENS, Q_BLOCK, q_lens)
    np.testing.assert_array_equal(blocks.request, [1, 0, 0, 0, 0])
    np.testing.assert_array_equal(blocks.q_len, [1, 0, 0, 0, 0])
    assert int(blocks.q_start[0]) == 5 and int(blocks.q_pos[0]) == 9


def test_decode_blocks_one_per_request():
    query_start_loc = jnp.array([0, 1, 2, 3], jnp.int32)
    kv_lens = jnp.array([3, 1, 0], jnp.int32)
    blocks = decode_blocks(query_start_loc, kv_lens, jnp.array([True, False, True]))
    np.testing.assert_array_equal(blocks.request, [0, 1, 2])
    np.testing.assert_array_equal(blocks.q_start, [0, 1, 2])
    np.testing.assert_array_equal(blocks.q_len, [1, 0, 1])
    np.testing.assert_array_equal(blocks.q_pos, [2, 0, 0])  # kv_len - 1, never negative


def test_block_token_index_marks_unused_slots_out_of_range():
    index = block_token_index(main_blocks(), Q_BLOCK, NUM_TOKENS)
    np.testing.assert_array_equal(
        index,
        [
            [0, 1, 2, 3],
            [4, 8, 8, 8],
            [5, 8, 8, 8],
            [8, 8, 8, 8],
            [8, 8, 8, 8],
        ],
    )


@pytest.mark.parametrize(
    "sliding_window, expected",
    [
        # block 0 sees tokens 0-3 (pages 0-1), block 1 token 4 (page 2), block 2 up to
        # position 9 (pages 0-4); unused blocks see nothing.
        (None, ([0, 0, 0, 0, 0], [2, 3, 5, 0, 0])),
        # a window of 3 starts at position 2 for block 1 (page 1), 7 for block 2 (page 3)
        (3, ([0, 1, 3, 0, 0], [2, 3, 5, 0, 0])),
    ],
)
def test_page_range(sliding_window, expected):
    blocks = main_blocks()
    first, end = page_range(blocks.q_len, blocks.q_pos, KV_LENS[blocks.request], 2, sliding_window)
    np.testing.assert_array_equal(first, expected[0])
    np.testing.assert_array_equal(end, expected[1])


def test_page_range_never_reads_past_the_context_or_starts_after_the_end():
    # A block whose tokens run past kv_len reads only up to kv_len.
    first, end = page_range(jnp.int32(4), jnp.int32(6), jnp.int32(7), 4, None)
    assert (int(first), int(end)) == (0, 2)
    # An empty block far into a sliding window is empty, not inverted.
    first, end = page_range(jnp.int32(0), jnp.int32(40), jnp.int32(41), 4, 3)
    assert (int(first), int(end)) == (0, 0)


def test_row_layout():
    assert row_layout(8, 2, 3) == RowLayout(q_block_size=4, group=4, group_padded=4, rows=16)
    assert row_layout(6, 2, 16) == RowLayout(16, 3, 4, 64)  # group 3 padded to 4
    assert row_layout(32, 8, 1) == RowLayout(1, 4, 4, 16)  # at least 16 rows
    assert row_layout(4, 4, 0) == RowLayout(1, 1, 1, 16)
    with pytest.raises(ValueError, match="not a multiple"):
        row_layout(4, 3, 1)


def test_gather_and_scatter_query_rows_round_trip():
    num_q_heads, num_kv_heads, head_dim = 6, 2, 2  # groups of 3, padded to 4
    layout = row_layout(num_q_heads, num_kv_heads, Q_BLOCK)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((NUM_TOKENS, num_q_heads, head_dim)).astype(np.float32)
    token_index = block_token_index(main_blocks(), layout.q_block_size, NUM_TOKENS)

    rows = np.asarray(gather_query_rows(jnp.asarray(q), token_index, num_kv_heads, layout))
    assert rows.shape == (5, num_kv_heads, layout.rows, head_dim)
    # Row r of block b, kv head k: token r // Gp of the block, q head k * G + r % Gp.
    expected = np.zeros_like(rows)
    for b, tokens in enumerate(np.asarray(token_index)):
        for k in range(num_kv_heads):
            for r in range(layout.rows):
                slot, head = divmod(r, layout.group_padded)
                if slot < Q_BLOCK and head < layout.group and tokens[slot] < NUM_TOKENS:
                    expected[b, k, r] = q[tokens[slot], k * layout.group + head]
    np.testing.assert_array_equal(rows, expected)
    # Spot checks: token 1's first q head of kv head 1 (q head 3) is row 1 * Gp = 4; row 3
    # is the padded fourth head of token 0.
    assert rows[0, 1, 4].tolist() == q[1, 3].tolist()
    assert not rows[0, 1, 3].any()

    back = np.asarray(scatter_query_rows(jnp.asarray(rows), token_index, NUM_TOKENS, layout))
    np.testing.assert_array_equal(back[:6], q[:6])
    assert not back[6:].any(), "padding tokens come back as zeros"
