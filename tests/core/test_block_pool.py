"""Block pool: null block, LRU free queue, reference counts, prefix map, block hashes."""

import pytest

from jengine.core import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from jengine.core.kv_cache_utils import ROOT_BLOCK_HASH, extend_block_hashes, hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def test_null_block_is_never_handed_out_or_freed():
    pool = BlockPool(num_blocks=5)
    assert pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(4)
    assert 0 not in ids(blocks)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block])  # ignored
    pool.touch([pool.null_block])  # ignored
    assert pool.null_block.ref_cnt == 0 and pool.get_num_free_blocks() == 0
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 4
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1)


def test_free_queue_is_lru_and_supports_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    q.remove(blocks[3])
    q.remove(blocks[0])
    q.remove(blocks[5])
    assert ids(q.get_all_free_blocks()) == [1, 2, 4] and len(q) == 3
    q.append(blocks[0])
    assert q.popleft().block_id == 1
    assert ids(q.popleft_n(2)) == [2, 4]
    assert ids(q.get_all_free_blocks()) == [0]
    with pytest.raises(RuntimeError):
        q.remove(blocks[3])  # not in the queue
    with pytest.raises(ValueError):
        q.popleft_n(2)


def test_allocation_order_follows_free_order():
    pool = BlockPool(num_blocks=6)
    a, b, c, d, e = pool.get_new_blocks(5)
    assert ids([a, b, c, d, e]) == [1, 2, 3, 4, 5]
    pool.free_blocks([d, b])
    pool.free_blocks([e])
    # Least recently freed first.
    assert ids(pool.get_new_blocks(3)) == [4, 2, 5]


def test_ref_counts_and_double_free():
    pool = BlockPool(num_blocks=4)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])  # a second owner
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    with pytest.raises(RuntimeError):
        pool.free_blocks([blk])
    # Touching a free block takes it out of the free queue.
    pool.touch([blk])
    assert blk.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert blk not in pool.free_block_queue.get_all_free_blocks()


def test_cached_block_survives_free_until_reused():
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(2)
    hashes = extend_block_hashes([], list(range(8)), block_size=4)
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=0, num_full_blocks=2)
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(reversed(blocks))
    # Free but still findable, and revivable by touch.
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1
    # Allocating everything else evicts the free cached block (blocks[1]) ...
    new = pool.get_new_blocks(2)
    assert blocks[1] in new and blocks[1].block_hash is None
    assert pool.get_cached_block(hashes[1]) is None
    # ... but not the one in use.
    assert pool.get_cached_block(hashes[0]) is blocks[0]


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(num_blocks=4)
    a, b = pool.get_new_blocks(2)
    (h,) = extend_block_hashes([], [1, 2, 3, 4], block_size=4)
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a and b.block_hash is None


def test_caching_disabled_registers_nothing():
    pool = BlockPool(num_blocks=4, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, extend_block_hashes([], [1, 2, 3, 4], 4), 0, 1)
    assert not pool.cached_block_hash_to_block


def test_usage_and_reset_prefix_cache():
    pool = BlockPool(num_blocks=5)
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(0.5)
    pool.cache_full_blocks(blocks, extend_block_hashes([], list(range(8)), 4), 0, 2)
    assert not pool.reset_prefix_cache()  # blocks in use
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    assert pool.reset_prefix_cache()
    assert not pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in pool.blocks)


def test_block_hash_is_chained_deterministic_and_incremental():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])  # stable, seed-free
    # The same tokens after a different parent hash differently.
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], extra_keys=("lora", 1)) != h1
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h1

    tokens = list(range(100, 111))  # 2 full blocks of 4 + 3 tokens
    full = extend_block_hashes([], tokens, 4)
    assert len(full) == 2  # the partial block is not hashed
    assert full == [h := hash_block_tokens(None, tokens[:4]), hash_block_tokens(h, tokens[4:8])]

    incremental: list[int] = []
    for n in range(1, len(tokens) + 2):
        extend_block_hashes(incremental, (tokens + [7])[:n], 4)
    assert incremental == extend_block_hashes([], tokens + [7], 4)
    assert len(incremental) == 3
