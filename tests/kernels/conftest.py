"""Ragged test batches shared by the attention kernel tests.

`make_batch` (a fixture returning a factory) builds one ragged batch over a paged KV cache
the way the engine lays it out, with traps: every cache slot a request does not own holds
NaN (unused pages, the tail of a request's last page, the null page 0, the other layer),
block-table entries past a request's context point at NaN pages, and padding tokens carry
NaN queries. Any read a kernel should not make then shows up as NaN in its output.
"""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest


class Batch(NamedTuple):
    q: np.ndarray  # [T, N, H]
    kv_cache: np.ndarray  # [L, 2, K, num_pages, S, H]
    layer: int
    kv_lens: np.ndarray  # [R]
    block_tables: np.ndarray  # [R, P]
    query_start_loc: np.ndarray  # [R + 1]

    @property
    def args(self):
        """The positional arguments of every implementation, as device arrays."""
        return (
            jnp.asarray(self.q),
            jnp.asarray(self.kv_cache),
            self.layer,
            jnp.asarray(self.kv_lens),
            jnp.asarray(self.block_tables),
            jnp.asarray(self.query_start_loc),
        )


def build_batch(
    seed: int,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    pad_tokens: int = 0,
    extra_pages: int = 1,
    dtype=np.float32,
) -> Batch:
    """Requests with `q_lens` new tokens each and `kv_lens` context (both including padding
    requests, which have 0 and 0); `pad_tokens` padding tokens follow the real ones."""
    rng = np.random.default_rng(seed)
    assert all(0 <= q <= kv for q, kv in zip(q_lens, kv_lens, strict=True))
    num_layers, layer = 2, 1
    pages_needed = [-(-kv // block_size) for kv in kv_lens]
    pages_per_request = max(pages_needed) + extra_pages
    num_pages = 1 + sum(pages_needed) + 3  # null page 0 + owned pages + never-used pages
    shape = (num_layers, 2, num_kv_heads, num_pages, block_size, head_dim)
    kv_cache = np.full(shape, np.nan, np.float32)

    # Owned pages are scattered over the cache in random order; page 0 is never owned.
    pool = rng.permutation(np.arange(1, num_pages))
    block_tables = np.zeros((len(q_lens), pages_per_request), np.int32)
    next_page = 0
    for r, (kv_len, needed) in enumerate(zip(kv_lens, pages_needed, strict=True)):
        pages = pool[next_page : next_page + needed]
        next_page += needed
        block_tables[r, :needed] = pages
        # Entries past the context: the null page or pages nobody owns, all NaN.
        block_tables[r, needed:] = rng.choice([0, *pool[-3:]], pages_per_request - needed)
        for j in range(kv_len):
            page, slot = pages[j // block_size], j % block_size
            kv_cache[layer, :, :, page, slot] = rng.standard_normal((2, num_kv_heads, head_dim))

    num_tokens = sum(q_lens) + pad_tokens
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    q[sum(q_lens) :] = np.nan
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return Batch(
        q.astype(dtype),
        kv_cache.astype(dtype),
        layer,
        np.asarray(kv_lens, np.int32),
        block_tables,
        query_start_loc,
    )


def naive_attention(
    batch: Batch, sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None
):
    """Per-token float64 oracle: loops over requests, tokens and heads in Python (a window
    of 0 or None: none; `soft_cap`: scores become cap * tanh(score / cap))."""
    q = np.asarray(batch.q, np.float64)
    cache = np.asarray(batch.kv_cache, np.float64)[batch.layer]
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.shape[1], cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = np.zeros_like(q)
    for r, kv_len in enumerate(batch.kv_lens):
        start, end = batch.query_start_loc[r], batch.query_start_loc[r + 1]
        for i, t in enumerate(range(start, end)):
            pos = kv_len - (end - start) + i
            lo = max(0, pos - sliding_window + 1) if sliding_window else 0
            ctx = np.arange(lo, pos + 1)
            pages = batch.block_tables[r, ctx // block_size]
            for n in range(num_q_heads):
                k = cache[0, n // group, pages, ctx % block_size]  # [C, H]
                v = cache[1, n // group, pages, ctx % block_size]
                scores = k @ q[t, n] * sm_scale
                if soft_cap:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                probs = np.exp(scores - scores.max())
                out[t, n] = probs @ v / probs.sum()
    return out


@pytest.fixture
def make_batch():
    return build_batch


@pytest.fixture
def oracle():
    return naive_attention
