"""Block pool: every KV block, its reference count, the LRU free queue and the prefix map.

Where it sits: owned by the KV cache manager, which asks it for new blocks, hands back
freed ones and looks up cached ones by content hash. The runner only ever sees block ids.

What it promises:
- Block 0 is the null block: never handed out, never freed. Padded slots in a batch write
  their K/V there, so padding can never corrupt a real request's cache.
- A block is in the free queue exactly when its ref_cnt is 0. A free block may still be
  *cached* (its hash maps to it), so a later request with the same prefix can take it back
  (``touch``) instead of recomputing; it is evicted (hash dropped) only when
  ``get_new_blocks`` reuses it, and blocks are reused least-recently-freed first.
- Everything is O(1) per block: the free queue is an intrusive doubly linked list.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jengine.core.kv_cache_utils import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while the block is in the prefix map
        # Intrusive links of the free queue: no per-operation allocation, O(1) removal.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        # Not the neighbours themselves: printing them would walk the whole list.
        cached = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={cached})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is evicted first, freed blocks join the tail.

    A plain deque cannot remove from the middle in O(1), which ``touch`` needs when a prefix
    hit revives a free cached block. Two sentinel nodes remove the empty-list edge cases.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail; for tests and debugging."""
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        # The null block is kept out of the free queue for good; its ref_cnt stays 0.
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    # -- allocation -------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, evicting cached ones."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
        return blocks

    def _maybe_evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            # Identity check: with duplicates skipped in cache_full_blocks a hash maps to
            # one block, but stay safe if that ever changes.
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (cached) blocks; free ones leave the free queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 join the free queue's tail
        in the given order (so the first given is evicted first)."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # -- prefix cache -----------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under their hashes."""
        if not self.enable_caching:
            return
        table = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # came from a prefix hit: already registered
            block_hash = block_hashes[i]
            if block_hash in table:
                # Two requests computed the same prefix at once; the first copy stays the
                # findable one and this block is an ordinary private block.
                continue
            block.block_hash = block_hash
            table[block_hash] = block

    def reset_prefix_cache(self, in_use_too: bool = False) -> bool:
        """Forget all cached hashes. Only when no block is in use, unless `in_use_too` (a
        weight update: every cached K/V is stale); returns False when nothing was
        forgotten."""
        if not in_use_too and self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    # -- accounting -------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable (non-null) blocks held by requests."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)
