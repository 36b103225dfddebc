"""The XLA reference attention against a naive per-token oracle, and `update_kv_cache`
(also into fp8 caches, which saturate).

The reference is the oracle of every kernel (and the CPU fallback), so it is checked here
against the simplest possible implementation (`conftest.naive_attention`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
    update_kv_cache,
)
from jengine.pallas_kernels.ragged_paged_attention.reference import GROUP_BLOCKS

# Jitted: op-by-op dispatch of the reference costs seconds per call on CPU.
reference = jax.jit(
    ragged_paged_attention_reference,
    static_argnames=("sm_scale", "q_block_size", "sliding_window"),
)

# (q_lens, kv_lens, pad_tokens): the last requests of a batch are padding (0, 0).
BATCHES = {
    "mixed": ([7, 1, 20, 1, 0], [7, 33, 45, 2, 0], 3),
    "decode": ([1, 1, 1, 1], [1, 17, 64, 31], 0),
    "chunked_prefill": ([19, 5, 0, 0], [50, 5, 0, 0], 2),
}


@pytest.mark.parametrize("batch_name", sorted(BATCHES))
@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, q_block_size, sliding_window",
    [(4, 4, 16, None), (8, 2, 1, None), (6, 2, 4, None), (8, 1, 16, 9)],
)
def test_reference_matches_oracle(
    make_batch, oracle, batch_name, num_q_heads, num_kv_heads, q_block_size, sliding_window
):
    q_lens, kv_lens, pad_tokens = BATCHES[batch_name]
    batch = make_batch(
        0,
        q_lens,
        kv_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=8,
        pad_tokens=pad_tokens,
    )
    sm_scale = 32**-0.5
    out = reference(
        *batch.args, sm_scale=sm_scale, q_block_size=q_block_size, sliding_window=sliding_window
    )
    expected = oracle(batch, sm_scale, sliding_window)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    # Padding tokens come back as zeros.
    assert not np.asarray(out)[sum(q_lens) :].any()


@pytest.mark.parametrize("q_block_size", [1, 4])
def test_reference_groups_blocks_of_different_lengths(make_batch, oracle, q_block_size):
    """More query blocks than one group holds, in shuffled length order: the blocks are
    sorted and each group walks only as far as its longest block, which must change no
    output (a block must never lose pages it sees, nor gain another request's)."""
    rng = np.random.default_rng(3)
    num_requests = 3 * GROUP_BLOCKS + 5
    kv_lens = rng.integers(1, 90, size=num_requests)
    q_lens = np.where(rng.random(num_requests) < 0.25, np.minimum(kv_lens, 9), 1)
    batch = make_batch(
        2,
        q_lens.tolist(),
        kv_lens.tolist(),
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=8,
        pad_tokens=3,
    )
    out = reference(*batch.args, sm_scale=0.25, q_block_size=q_block_size)
    np.testing.assert_allclose(out, oracle(batch, 0.25), rtol=1e-5, atol=1e-5)


def test_reference_is_jittable_and_bf16(make_batch, oracle):
    q_lens, kv_lens, pad_tokens = BATCHES["mixed"]
    batch = make_batch(
        1,
        q_lens,
        kv_lens,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        pad_tokens=pad_tokens,
        dtype=jnp.bfloat16,
    )
    f = jax.jit(ragged_paged_attention, static_argnames=("sm_scale", "impl"))
    out = f(*batch.args, sm_scale=0.125, impl="reference")
    assert out.dtype == jnp.bfloat16
    expected = oracle(batch, 0.125)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=2e-2, atol=2e-2)


def test_update_kv_cache_writes_only_its_slots():
    rng = np.random.default_rng(0)
    num_layers, num_kv_heads, num_pages, block_size, head_dim = 3, 2, 6, 4, 8
    shape = (num_layers, 2, num_kv_heads, num_pages, block_size, head_dim)
    cache = rng.standard_normal(shape).astype(np.float32)
    # Three real tokens (two in page 3, one at the end of page 5) and one padding token that
    # goes to the null page 0.
    slot_mapping = np.array([3 * block_size + 1, 3 * block_size + 2, 5 * block_size + 3, 0])
    k = rng.standard_normal((4, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((4, num_kv_heads, head_dim)).astype(np.float32)
    layer = 1

    out = np.asarray(
        jax.jit(update_kv_cache)(cache, jnp.int32(layer), k, v, jnp.asarray(slot_mapping))
    )
    expected = cache.copy()
    for t, slot in enumerate(slot_mapping):
        page, offset = divmod(int(slot), block_size)
        expected[layer, 0, :, page, offset] = k[t]
        expected[layer, 1, :, page, offset] = v[t]
    np.testing.assert_array_equal(out, expected)
    # Nothing outside the written slots moved (the other layers in particular).
    changed = np.argwhere((out != cache).any(axis=(1, 2, 5)))
    assert {tuple(x) for x in changed} <= {(1, 3, 1), (1, 3, 2), (1, 5, 3), (1, 0, 0)}


def test_update_kv_cache_casts_to_cache_dtype():
    cache = jnp.zeros((1, 2, 1, 2, 2, 4), jnp.bfloat16)
    k = jnp.ones((1, 1, 4), jnp.float32)
    out = jax.jit(update_kv_cache)(cache, 0, k, 2 * k, jnp.array([3]))
    assert out.dtype == jnp.bfloat16
    assert (out[0, 0, 0, 1, 1] == 1).all() and (out[0, 1, 0, 1, 1] == 2).all()
    assert float(jnp.abs(out).sum()) == 12.0


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
def test_update_kv_cache_saturates_into_fp8(dtype):
    """--kv-cache-dtype fp8: values past the format's range are stored as its largest
    finite value (vLLM's saturating cast), never as NaN or infinity; the rest round to
    nearest."""
    limit = float(jnp.finfo(dtype).max)
    cache = jnp.zeros((1, 2, 1, 2, 2, 4), dtype)
    k = jnp.array([[[1e6, -1e6, 3.3, -0.1]]], jnp.float32)
    v = jnp.array([[[limit * 2, 0.0, -limit * 1.01, 1.0]]], jnp.float32)
    out = jax.jit(update_kv_cache)(cache, 0, k, v, jnp.array([1]))
    assert out.dtype == dtype
    written = np.asarray(out[0, :, 0, 0, 1], np.float32)  # [2 (k, v), 4]
    assert np.isfinite(written).all()
    expected_k = [
        limit,
        -limit,
        float(jnp.float32(3.3).astype(dtype)),
        float(jnp.float32(-0.1).astype(dtype)),
    ]
    np.testing.assert_array_equal(written[0], expected_k)
    np.testing.assert_array_equal(written[1], [limit, 0.0, -limit, 1.0])


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
def test_reference_reads_an_fp8_cache_as_its_values(make_batch, dtype):
    """Attention over an fp8 cache is attention over the same (rounded) values held in
    float32: the reference widens each page as it reads it, and the NaN traps stay unread."""
    q_lens, kv_lens, pad_tokens = BATCHES["mixed"]
    batch = make_batch(
        4, q_lens, kv_lens, num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=8,
        pad_tokens=pad_tokens,
    )  # fmt: skip
    fp8 = batch._replace(kv_cache=batch.kv_cache.astype(dtype))
    widened = fp8._replace(kv_cache=fp8.kv_cache.astype(np.float32))
    out = np.asarray(reference(*fp8.args, sm_scale=0.25))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, reference(*widened.args, sm_scale=0.25), rtol=1e-6, atol=1e-6)
