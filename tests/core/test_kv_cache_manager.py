"""KV cache manager: allocation, all-or-nothing failure, prefix hits, free order, leaks."""

import pytest

from jengine.core import KVCacheManager
from tests.core.core_helpers import make_request

BS = 4


def manager(num_blocks=16, max_model_len=64, enable_caching=True):
    return KVCacheManager(BS, num_blocks, max_model_len, enable_caching)


def run_prefill(kv, request):
    """Schedule a request's whole prompt (with any prefix hit) as the scheduler would."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit, hit_blocks, num_hit)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit


def test_allocate_grows_by_whole_blocks():
    kv = manager()
    req = make_request("a", 10)
    assert len(kv.allocate_slots(req, 10)) == 3  # ceil(10 / 4)
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == []  # still fits in block 3
    req.num_computed_tokens = 12
    assert len(kv.allocate_slots(req, 1)) == 1
    assert len(kv.get_block_ids("a")) == 4
    kv.free(req)
    assert kv.num_free_blocks == kv.num_usable_blocks
    with pytest.raises(ValueError):
        kv.allocate_slots(req, 0)


def test_allocation_is_capped_at_max_model_len():
    kv = manager(max_model_len=10)
    req = make_request("a", 8)
    assert len(kv.allocate_slots(req, 20)) == 3  # slots for 10 tokens, not 20


def test_lookahead_slots_are_allocated_but_never_hashed():
    """A draft model's slots past the scheduled tokens: allocated (within max_model_len),
    part of the no-op check, and no block of them reaches the prefix cache."""
    kv = manager(max_model_len=16)
    a = make_request("a", [5, 6, 7])
    assert len(kv.allocate_slots(a, 3, num_lookahead_tokens=3)) == 2  # 6 slots
    assert kv.block_pool.cached_block_hash_to_block == {}  # block 0 holds no 4th token
    a.num_computed_tokens = 3
    a.append_output_token_ids(8)
    assert kv.allocate_slots(a, 1, num_lookahead_tokens=3) == []  # 7 slots fit in 2 blocks
    assert len(kv.block_pool.cached_block_hash_to_block) == 1  # block 0: 4 known tokens
    a.num_computed_tokens = 4
    assert len(kv.allocate_slots(a, 1, num_lookahead_tokens=5)) == 1  # 10 slots
    assert len(kv.allocate_slots(a, 1, num_lookahead_tokens=50)) == 1  # capped at 16
    assert len(kv.get_block_ids("a")) == 4


def test_failed_allocation_changes_nothing():
    kv = manager(num_blocks=5)  # 4 usable
    a = make_request("a", 8)
    kv.allocate_slots(a, 8)
    b = make_request("b", 12)
    assert kv.allocate_slots(b, 12) is None
    assert kv.num_free_blocks == 2
    assert kv.get_block_ids("b") == [] and "b" not in kv.req_to_blocks
    assert len(kv.allocate_slots(b, 8)) == 2


def test_prefix_hit_covers_full_blocks_only_and_never_the_last_token():
    kv = manager()
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    a = make_request("a", prompt)
    assert run_prefill(kv, a) == 0
    a_ids = kv.get_block_ids("a")
    kv.free(a)

    # The same prompt hits the two full blocks; the partial third block is not cached.
    b = make_request("b", prompt)
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in blocks] == a_ids[:2]
    # A longer prompt with the same start: still just the 2 full blocks of the first one.
    c = make_request("c", prompt + [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(c)[1] == 8
    # A prompt of exactly 2 blocks: only 1 block may hit, the last token must run.
    d = make_request("d", prompt[:8])
    assert kv.get_computed_blocks(d)[1] == 4
    # Diverging in the second block: only the first block hits.
    e = make_request("e", prompt[:4] + [0] * 7)
    assert kv.get_computed_blocks(e)[1] == 4
    # Nothing in common.
    assert kv.get_computed_blocks(make_request("f", [1] * 11))[1] == 0


def test_prefix_hit_is_shared_and_ref_counted():
    kv = manager()
    prompt = list(range(100, 117))  # 4 full blocks + 1
    a = make_request("a", prompt)
    run_prefill(kv, a)
    b = make_request("b", prompt)
    assert run_prefill(kv, b) == 16
    a_ids, b_ids = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert a_ids[:4] == b_ids[:4] and a_ids[4] != b_ids[4]
    free_before = kv.num_free_blocks
    kv.free(a)
    assert kv.num_free_blocks == free_before + 1  # shared blocks still held by b
    kv.free(b)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_hit_on_free_cached_blocks_counts_against_free_pool():
    kv = manager(num_blocks=6)  # 5 usable
    prompt = list(range(100, 117))  # 17 tokens = 5 blocks
    a = make_request("a", prompt)
    run_prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 5
    # b hits 4 free cached blocks and needs 2 more: 6 > 5, so it must fail cleanly.
    b = make_request("b", prompt + [1, 2, 3, 4])
    hit, n = kv.get_computed_blocks(b)
    assert n == 16
    assert kv.allocate_slots(b, b.num_tokens - n, hit, n) is None
    assert kv.num_free_blocks == 5 and all(blk.ref_cnt == 0 for blk in hit)
    assert kv.get_computed_blocks(b)[1] == 16  # still cached


def test_no_prefix_hits_with_prompt_logprobs_or_caching_disabled():
    kv = manager()
    prompt = list(range(100, 113))
    run_prefill(kv, make_request("a", prompt))
    assert kv.get_computed_blocks(make_request("b", prompt))[1] == 12
    assert kv.get_computed_blocks(make_request("c", prompt, prompt_logprobs=1))[1] == 0

    off = manager(enable_caching=False)
    run_prefill(off, make_request("a", prompt))
    assert off.get_computed_blocks(make_request("b", prompt))[1] == 0
    assert not off.block_pool.cached_block_hash_to_block


def test_freed_request_is_evicted_tail_first():
    kv = manager(num_blocks=5)  # 4 usable
    a = make_request("a", list(range(100, 116)))  # exactly the 4 blocks
    run_prefill(kv, a)
    a_ids = kv.get_block_ids("a")
    kv.free(a)
    assert [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()] == a_ids[::-1]
    # Reusing one block evicts a's *last* block; its first three blocks still hit.
    kv.allocate_slots(make_request("x", 1), 1)
    assert kv.get_computed_blocks(make_request("b", list(range(100, 117))))[1] == 12


def test_blocks_are_cached_as_they_fill_during_decode():
    kv = manager()
    a = make_request("a", [5, 6, 7])
    kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    for t in [8, 9, 10, 11, 12]:  # decoding fills block 0, then block 1
        a.append_output_token_ids(t)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert len(a.block_hashes) == 2
    b = make_request("b", [5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert kv.get_computed_blocks(b)[1] == 8


@pytest.mark.parametrize("enable_caching", [True, False])
def test_allocate_is_a_no_op_up_to_the_limit(enable_caching):
    kv = manager(enable_caching=enable_caching)
    a = make_request("a", [5, 6, 7, 8, 9])  # blocks: [5 6 7 8] [9 . . .]
    kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    # Caching: the limit stops one token short of filling block 1 (it must be hashed then).
    assert kv.no_op_limit["a"] == (7 if enable_caching else 8)
    free, cached = kv.num_free_blocks, dict(kv.block_pool.cached_block_hash_to_block)
    for t in [10, 11]:  # decode up to the limit: nothing changes
        a.append_output_token_ids(t)
        assert kv.allocate_slots(a, 1) == []
        a.num_computed_tokens += 1
        assert kv.num_free_blocks == free
        assert kv.block_pool.cached_block_hash_to_block == cached
    a.append_output_token_ids(12)  # fills block 1
    assert kv.allocate_slots(a, 1) == []
    a.num_computed_tokens += 1
    assert len(kv.block_pool.cached_block_hash_to_block) == len(cached) + enable_caching
    a.append_output_token_ids(13)  # needs block 2
    assert len(kv.allocate_slots(a, 1)) == 1
    kv.free(a)
    assert "a" not in kv.no_op_limit


def test_prefix_stats_count_admitted_lookups():
    kv = manager()
    prompt = list(range(100, 109))
    run_prefill(kv, make_request("a", prompt))
    b = make_request("b", prompt)
    _, n = kv.get_computed_blocks(b)
    kv.record_prefix_lookup(b, n)
    assert kv.take_prefix_cache_stats() == (9, 8)
    assert kv.take_prefix_cache_stats() == (0, 0)
