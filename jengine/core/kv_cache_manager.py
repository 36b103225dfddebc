"""KV cache manager: which blocks each request holds, and prefix-cache lookups.

Where it sits: the scheduler asks it, per request and per step, "how much of this request
is already cached?" (``get_computed_blocks``) and "give this request room for n more
tokens" (``allocate_slots``); it frees a request's blocks when the request finishes or is
preempted. The block ids it hands out become the runner's block tables.

What it promises:
- ``allocate_slots`` is all or nothing: it returns None and changes nothing when the pool
  cannot cover the request, so the scheduler can preempt and retry.
- A prefix hit is a run of whole cached blocks and never the whole sequence: the last token
  is always recomputed, because sampling needs its logits.
- Full blocks are registered in the prefix cache as soon as they are scheduled (as vLLM
  does). A later request in the *same* step may then hit them, so the runner must write the
  K/V of all scheduled tokens of a layer before any attention of that layer reads the cache.
- Blocks of a freed request go to the free queue tail-block first, so the end of a
  sequence is evicted before its (more shareable) beginning.
- ``allocate_slots(request, n, num_lookahead_tokens=a)`` changes nothing and returns []
  whenever ``request.num_computed_tokens + n + a <= no_op_limit.get(request_id, 0)`` (its
  blocks hold the tokens and no block fills): most decode steps. The scheduler checks this
  itself to skip the call.
"""

from __future__ import annotations

import time

from jengine.core.block_pool import BlockPool, KVCacheBlock
from jengine.core.kv_cache_utils import cdiv, extend_block_hashes
from jengine.request import Request

# A request's count of cached blocks that no count of its full blocks passes: it caches no
# more (its K/V outlived a weight update).
_NEVER_CACHED = 1 << 62


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        enable_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix map.
        self.num_cached_blocks: dict[str, int] = {}
        # Per request: the computed + new token count up to which allocate_slots is a no-op.
        self.no_op_limit: dict[str, int] = {}
        # Counters since the last take_prefix_cache_stats(), in tokens (vLLM's unit).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._lora_removals: dict[int, int] = {}  # forget_lora's counts

    # -- queries ----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_usable_blocks(self) -> int:
        """All blocks but the null block: the free count once every request has ended."""
        return self.num_blocks - 1

    def num_blocks_to_grow(self, request: Request, num_tokens: int) -> int:
        """Blocks the request lacks to hold `num_tokens` tokens (within max_model_len)."""
        num_tokens = min(num_tokens, self.max_model_len)
        held = len(self.req_to_blocks.get(request.request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """(queries, hits) in tokens since the previous call."""
        stats = (self.prefix_cache_queries, self.prefix_cache_hits)
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        return stats

    # -- prefix hits ------------------------------------------------------------------

    def _update_block_hashes(self, request: Request) -> None:
        if self.enable_caching:
            # An adapter changes every block's K/V: its id is part of each hash, so the
            # same prompt under two adapters (or none) shares nothing. A cache salt is
            # too: a tenant's salt keeps others from timing hits on its prompts.
            lora_id, salt = request.lora_id, request.cache_salt
            if lora_id:
                extra = (lora_id, self._lora_removals.get(lora_id, 0), salt)
            else:
                extra = None if salt is None else (0, salt)
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, extra)

    def _may_hit(self, request: Request) -> bool:
        # Prompt logprobs need the logits of every prompt position, so nothing may be skipped.
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks that prefixes the request's tokens.

        Returns the blocks (not yet referenced: pass them to ``allocate_slots``) and the
        number of tokens they cover. No side effects beyond extending the request's hashes,
        so a request that then fails to get blocks can simply ask again next step.
        """
        if not self._may_hit(request):
            return [], 0
        self._update_block_hashes(request)
        # At most num_tokens - 1 tokens: the last one must run through the model.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """At a request's first admission: its cached-token count, when it was first
        scheduled, and its lookup counted for metrics (not per retry, nor again when a
        preempted request is admitted back and finds its own blocks: vLLM's prefix-cache
        metrics leave those out too)."""
        if request.num_cached_tokens >= 0:
            return
        request.num_cached_tokens = num_hit_tokens
        request.scheduled_time = time.monotonic()
        if self._may_hit(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # -- allocation -------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        new_computed_blocks / num_new_computed_tokens: a prefix hit from
        ``get_computed_blocks``, taken over by the request here.
        num_lookahead_tokens: slots past those for a draft model's own K/V; they are
        allocated (within max_model_len) but hold no known token, so never hashed.
        Returns the newly allocated blocks (possibly empty), or None, with nothing changed,
        when there are not enough free blocks.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        request_id = request.request_id
        if (
            not new_computed_blocks
            and request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
            <= self.no_op_limit.get(request_id, 0)
        ):
            return []
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_slots = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_to_allocate = (
            cdiv(num_slots, self.block_size) - len(req_blocks) - len(new_computed_blocks)
        )
        # Hit blocks that sit in the free queue stop being free once taken, so they count
        # against the free pool just like new blocks.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_to_allocate > self.block_pool.get_num_free_blocks() - num_revived:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]  # leave no trace on failure
            return None

        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks.setdefault(request.request_id, 0)
            # Hit blocks are already in the prefix map.
            self.num_cached_blocks[request.request_id] += len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_to_allocate, 0))
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Only tokens we know can be hashed; scheduled-but-unsampled ones cannot.
            num_known = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            num_full = num_known // self.block_size
            num_cached = self.num_cached_blocks.get(request.request_id, 0)
            if num_full > num_cached:
                self._update_block_hashes(request)
                self.block_pool.cache_full_blocks(
                    req_blocks, request.block_hashes, num_cached, num_full
                )
                self.num_cached_blocks[request.request_id] = num_full
        limit = len(req_blocks) * self.block_size
        if self.enable_caching:
            # One token short of filling the next block, which must then be registered.
            num_cached = self.num_cached_blocks.get(request_id, 0)
            limit = min(limit, (num_cached + 1) * self.block_size - 1)
        self.no_op_limit[request_id] = limit
        return new_blocks

    def free(self, request: Request) -> None:
        """Release all blocks of a finished or preempted request (cached ones stay findable)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.no_op_limit.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def forget_lora(self, lora_id: int) -> None:
        """An adapter was removed: one added later under its id (another adapter, maybe)
        hashes apart from the K/V it computed, which the pool then evicts as any other."""
        self._lora_removals[lora_id] = self._lora_removals.get(lora_id, 0) + 1

    def reset_prefix_cache(self, in_use_too: bool = False) -> bool:
        """Forget every cached prefix; False (nothing forgotten) while a request holds
        blocks, unless `in_use_too` (a weight update: all K/V computed so far is stale).
        Then the requests holding blocks cache none of their blocks to come either, whose
        K/V mixes the old weights' with the new (their blocks forgotten now make them
        unreachable only until a new request caches the same first blocks again)."""
        if in_use_too:
            for request_id in self.req_to_blocks:
                self.num_cached_blocks[request_id] = _NEVER_CACHED
        return self.block_pool.reset_prefix_cache(in_use_too)
