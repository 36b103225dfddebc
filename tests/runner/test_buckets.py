"""Padding buckets: every step maps to a warmed-up shape, waste is bounded, counts are small."""

import itertools

import pytest

from jengine.runner.buckets import BucketSpec, next_power_of_two, token_buckets


def test_buckets_cover_every_step_and_bound_waste():
    spec = BucketSpec.create(
        max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512, block_size=16
    )
    shapes = set(spec.all_shapes())
    assert len(shapes) == 26  # (7 request + 6 token buckets) x 2 page buckets
    for num_reqs, extra, pages in itertools.product([1, 3, 17, 64], [0, 1, 100, 448], [1, 5, 32]):
        num_tokens = min(num_reqs + extra, 512)
        shape = spec.shape_for(num_tokens, num_reqs, pages)
        assert shape in shapes
        assert shape.num_tokens >= num_tokens and shape.num_reqs >= num_reqs
        assert shape.num_pages >= pages
        # Padding waste below 2x (beyond the smallest buckets).
        assert shape.num_tokens < 2 * max(num_tokens, 16)
        assert shape.num_pages < 4 * max(pages, 8)
        assert shape.is_decode == (num_tokens == num_reqs)


def test_decode_steps_use_one_token_query_blocks():
    spec = BucketSpec.create(8, 64, 128, 16)
    shape = spec.shape_for(5, 5, 3)
    assert (shape.num_tokens, shape.num_reqs, shape.q_block_size) == (8, 8, 1)


def test_helpers():
    assert [next_power_of_two(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert token_buckets(100) == [16, 32, 64, 100]
    with pytest.raises(ValueError):
        BucketSpec.create(8, 64, 128, 16).shape_for(65, 2, 1)
