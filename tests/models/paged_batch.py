"""A minimal host-side pager for model tests: runs chunks of sequences as one ragged batch.

It stands in for the scheduler and runner (which have their own tests): each request gets
pages from a shuffled pool, the cache starts as NaN so stray reads show, and batches are
padded with extra tokens and empty requests like the runner pads them, always to the same
shape (as the runner pads to its buckets): one compile per model and query block size,
shared by every pager over that model.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jengine.models import AttentionMetadata

# Every step's padded shape: tokens, requests and pages per request.
NUM_TOKENS = 32
NUM_REQUESTS = 6
PAGES_PER_REQUEST = 8


@partial(jax.jit, static_argnums=(0, 1))
def _forward(graphdef, impl, state, *args, lora_slots=None):
    return nnx.merge(graphdef, state)(*args, attention_impl=impl, lora_slots=lora_slots)


class PagedSequences:
    def __init__(self, model, sequences, *, block_size=4, num_blocks=64, seed=0, impl=None):
        self.model = model
        self.sequences = sequences
        self.block_size = block_size
        self.computed = [0] * len(sequences)
        rng = np.random.default_rng(seed)
        self.free = [int(p) for p in rng.permutation(np.arange(1, num_blocks))]  # 0 is null
        self.pages = [[] for _ in sequences]
        shape = model.kv_cache_shape(num_blocks, block_size)
        self.kv_cache = jnp.full(shape, jnp.nan, dtype=model.dtype)
        self._graphdef, self._state = nnx.split(model)
        self._impl = impl

    def step(self, chunks, *, q_block_size=4, lora=None):
        """Run {seq index: num new tokens} as one batch; returns {seq index: logits [n, V]}.
        `lora`: {seq index: LoRA slot} for a model with adapter slots (others: slot 0)."""
        ids, positions, slots, q_starts, kv_lens, tables = [], [], [], [0], [], []
        lora_slots = []
        for index, count in chunks.items():
            while len(self.pages[index]) * self.block_size < self.computed[index] + count:
                self.pages[index].append(self.free.pop())
        width = PAGES_PER_REQUEST
        for index, count in chunks.items():
            start = self.computed[index]
            for pos in range(start, start + count):
                ids.append(self.sequences[index][pos])
                positions.append(pos)
                lora_slots.append((lora or {}).get(index, 0))
                page = self.pages[index][pos // self.block_size]
                slots.append(page * self.block_size + pos % self.block_size)
            q_starts.append(q_starts[-1] + count)
            kv_lens.append(start + count)
            tables.append(self.pages[index] + [0] * (width - len(self.pages[index])))
            self.computed[index] += count
        num_real = len(ids)
        pad_tokens, pad_requests = NUM_TOKENS - num_real, NUM_REQUESTS - len(chunks)
        assert pad_tokens > 0 and pad_requests > 0, "a step must leave room for padding"
        assert max(map(len, self.pages)) <= width, "a sequence outgrew PAGES_PER_REQUEST"
        ids += [0] * pad_tokens
        positions += [0] * pad_tokens
        slots += [0] * pad_tokens  # the null page absorbs padding writes
        q_starts += [q_starts[-1]] * pad_requests
        kv_lens += [0] * pad_requests
        tables += [[0] * width] * pad_requests
        metadata = AttentionMetadata(
            slot_mapping=jnp.asarray(slots, jnp.int32),
            kv_lens=jnp.asarray(kv_lens, jnp.int32),
            block_tables=jnp.asarray(tables, jnp.int32),
            query_start_loc=jnp.asarray(q_starts, jnp.int32),
            q_block_size=q_block_size,
        )
        hidden, self.kv_cache = _forward(
            self._graphdef,
            self._impl,
            self._state,
            jnp.asarray(ids, jnp.int32),
            jnp.asarray(positions, jnp.int32),
            self.kv_cache,
            metadata,
            lora_slots=None if lora is None else jnp.asarray(lora_slots + [0] * pad_tokens),
        )
        logits = np.asarray(self.model.compute_logits(hidden))
        assert np.all(logits[num_real:] == logits[num_real:]), "padding rows must stay finite"
        out, offset = {}, 0
        for index, count in chunks.items():
            out[index] = logits[offset : offset + count]
            offset += count
        return out
