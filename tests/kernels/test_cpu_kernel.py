"""The fused CPU kernel (`cpu.cc` through the XLA FFI) against the XLA reference and the
float64 oracle, on batches whose every slot it must not read holds NaN
(`conftest.build_batch`), also over bfloat16 and fp8 caches (every fp8 value widened
exactly); its derivatives; and how the entry point picks it or falls back.

The kernel is the CPU production path wherever a C++ compiler exists (the development and
CI machines have one), so these tests require it to build rather than skip.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.pallas_kernels.ragged_paged_attention import (
    cpu,
    default_impl,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from tests.kernels.conftest import build_batch

reference = jax.jit(
    ragged_paged_attention_reference,
    static_argnames=("sm_scale", "q_block_size", "sliding_window", "soft_cap"),
)
kernel = jax.jit(
    cpu.ragged_paged_attention_cpu, static_argnames=("sm_scale", "q_block_size", "sliding_window")
)

# (q_lens, kv_lens, pad_tokens); trailing (0, 0) requests are padding.
BATCHES = {
    # prefill from scratch, chunked prefill, decodes, a padding request, padding tokens
    "mixed": ([9, 1, 20, 1, 0], [9, 40, 52, 3, 0], 3),
    "decode": ([1, 1, 1, 1, 0, 0], [1, 16, 33, 70, 0, 0], 2),
    # one request whose new tokens straddle pages and the kernel's 16-token work items
    "prefill": ([37], [45], 0),
}

# (batch, num_q_heads, num_kv_heads, head_dim, block_size, sliding_window)
CASES = [
    ("mixed", 2, 2, 64, 16, None),  # GQA 1
    ("mixed", 4, 2, 128, 32, None),  # GQA 2
    ("mixed", 8, 2, 64, 8, None),  # GQA 4, the smallest page
    ("mixed", 8, 1, 32, 16, None),  # GQA 8: 8 tokens per work item
    ("mixed", 6, 2, 64, 16, None),  # GQA 3
    ("mixed", 8, 2, 128, 16, 20),  # sliding window across pages
    ("decode", 8, 1, 64, 16, None),
    ("decode", 4, 4, 128, 32, 17),
    ("prefill", 4, 1, 64, 16, None),
    ("prefill", 2, 1, 128, 32, 11),
    ("prefill", 64, 1, 16, 8, None),  # 64 q heads per kv head: one token per work item
]


def test_kernel_builds_here():
    assert cpu.load() is None
    assert default_impl("cpu") == "cpu"


def case_batch(case):
    """One CASES row: its batch (`conftest.build_batch`) and the kernel's keyword arguments
    (test_avx2_build.py runs the same grid on the AVX2 build)."""
    batch_name, num_q_heads, num_kv_heads, head_dim, block_size, sliding_window = case
    q_lens, kv_lens, pad_tokens = BATCHES[batch_name]
    batch = build_batch(
        sum(q_lens),
        q_lens,
        kv_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        pad_tokens=pad_tokens,
    )
    return batch, dict(sm_scale=head_dim**-0.5, sliding_window=sliding_window)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_reference_and_oracle(oracle, case):
    batch, kwargs = case_batch(case)
    out = np.asarray(kernel(*batch.args, **kwargs))
    assert out.shape == batch.q.shape and out.dtype == np.float32
    assert np.isfinite(out).all(), "the kernel read a NaN slot it should have skipped"
    np.testing.assert_allclose(out, reference(*batch.args, **kwargs), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, oracle(batch, **kwargs), rtol=1e-5, atol=1e-5)
    num_tokens = sum(BATCHES[case[0]][0])
    assert not out[num_tokens:].any(), "padding tokens must come back as zeros"


NARROW_CACHES = [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2]
NARROW_IDS = ["bf16", "e4m3", "e5m2"]


@pytest.mark.parametrize("cache_dtype", NARROW_CACHES, ids=NARROW_IDS)
@pytest.mark.parametrize(
    "case", [CASES[i] for i in (2, 5, 6, 9)], ids=lambda c: "-".join(map(str, c))
)
def test_kernel_reads_a_narrow_cache(case, cache_dtype):
    """--kv-cache-dtype bfloat16 | fp8: the kernel widens each page as its walk reaches it,
    so its output is the reference's over the same cache (to float32 rounding); the NaN
    traps (fp8's NaN patterns, bf16's NaN) stay unread."""
    batch, kwargs = case_batch(case)
    batch = batch._replace(kv_cache=batch.kv_cache.astype(cache_dtype))
    assert cpu.supports(*batch.args[:2])
    out = np.asarray(kernel(*batch.args, **kwargs))
    assert np.isfinite(out).all(), "the kernel read a NaN slot it should have skipped"
    np.testing.assert_allclose(out, reference(*batch.args, **kwargs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", NARROW_CACHES[1:], ids=NARROW_IDS[1:])
def test_every_fp8_value_widens_exactly(cache_dtype):
    assert_every_fp8_value_widens_exactly(cache_dtype)


def assert_every_fp8_value_widens_exactly(cache_dtype, **build):
    """One query seeing one key: the output is that slot's value row, here all 256 byte
    patterns of the format (subnormals, zeros of both signs, the largest normals). Each
    finite one comes out as its exact float32 value. `build`: kernel=<another build>."""
    head_dim = 256
    patterns = np.arange(256, dtype=np.uint8).view(cache_dtype)
    cache = np.zeros((1, 2, 1, 2, 8, head_dim), cache_dtype)
    cache[0, 1, 0, 1, 0] = patterns  # the value of page 1, slot 0
    q = np.ones((1, 1, head_dim), np.float32)
    args = (q, cache, 0, np.int32([1]), np.int32([[1]]), np.int32([0, 1]))
    out = cpu.ragged_paged_attention_cpu(*map(jnp.asarray, args), sm_scale=1.0, **build)
    out = np.asarray(out)[0, 0]
    expected = patterns.astype(np.float32)
    finite = np.isfinite(expected)
    assert finite.sum() >= 248  # e4m3fn: 2 NaN patterns; e5m2: 6 NaN and 2 infinities
    np.testing.assert_array_equal(out[finite], expected[finite])


@pytest.mark.parametrize("impl", ["cpu", "reference"])
@pytest.mark.parametrize("window, soft_cap", [(0, None), (11, None), (20, 3.0), (0, 1.5)])
def test_a_layers_own_window_traced_and_soft_capping(make_batch, oracle, impl, window, soft_cap):
    """Gemma's layers each have their own window, which a layer scan passes traced (0: no
    window for that layer), and Gemma 2 soft-caps the attention logits."""
    batch = make_batch(
        33,
        [9, 1, 20, 1, 0],
        [9, 40, 52, 3, 0],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        pad_tokens=2,
    )
    attention = {
        "cpu": cpu.ragged_paged_attention_cpu,
        "reference": ragged_paged_attention_reference,
    }[impl]

    @jax.jit
    def run(window, *args):
        return attention(*args, sm_scale=0.3, sliding_window=window, soft_cap=soft_cap)

    out = np.asarray(run(jnp.int32(window), *batch.args))
    assert np.isfinite(out).all()
    expected = oracle(batch, 0.3, window, soft_cap)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    if soft_cap:  # the cap changed what attention sees
        assert np.abs(expected - oracle(batch, 0.3, window)).max() > 1e-3


def test_kernel_on_many_requests_of_every_length(make_batch, oracle):
    """A hundred requests, decodes and chunks, contexts from 1 to 300 tokens: the work is
    shared between threads, and no request may see another's pages."""
    rng = np.random.default_rng(5)
    kv_lens = rng.integers(1, 300, size=100)
    q_lens = np.where(rng.random(100) < 0.2, np.minimum(kv_lens, 40), 1)
    batch = make_batch(
        4,
        q_lens.tolist(),
        kv_lens.tolist(),
        num_q_heads=8,
        num_kv_heads=4,
        head_dim=64,
        block_size=16,
        pad_tokens=5,
    )
    out = kernel(*batch.args, sm_scale=0.125)
    np.testing.assert_allclose(out, oracle(batch, 0.125), rtol=1e-5, atol=1e-5)


def test_kernel_derivatives_are_the_reference_ones(make_batch):
    q_lens, kv_lens, pad_tokens = BATCHES["mixed"]
    batch = make_batch(2, q_lens, kv_lens, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    # The NaN traps would make every cotangent NaN; the derivative test needs finite slots.
    q, cache = jnp.nan_to_num(batch.args[0]), jnp.nan_to_num(batch.args[1])
    weights = jax.random.normal(jax.random.key(0), q.shape)

    def loss(attention, q, cache):
        out = attention(q, cache, *batch.args[2:], sm_scale=0.25, sliding_window=30)
        return jnp.sum(out * weights)

    grads = jax.jit(jax.grad(lambda *a: loss(cpu.ragged_paged_attention_cpu, *a), (0, 1)))(q, cache)
    expected = jax.jit(jax.grad(lambda *a: loss(ragged_paged_attention_reference, *a), (0, 1)))(
        q, cache
    )
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(grads[1]).sum()) > 0


def test_entry_point_hands_what_the_kernel_does_not_take_to_the_reference(make_batch):
    q_lens, kv_lens, pad_tokens = BATCHES["mixed"]
    for head_dim, dtype in ((64, jnp.bfloat16), (12, np.float32)):
        batch = make_batch(
            6,
            q_lens,
            kv_lens,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=head_dim,
            block_size=16,
            pad_tokens=pad_tokens,
            dtype=dtype,
        )
        out = jax.jit(ragged_paged_attention, static_argnames=("sm_scale", "impl"))(
            *batch.args, sm_scale=0.125, impl="cpu"
        )
        np.testing.assert_array_equal(
            np.asarray(out, np.float32),
            np.asarray(reference(*batch.args, sm_scale=0.125), np.float32),
        )
        with pytest.raises(ValueError, match="multiples of 8"):
            cpu.ragged_paged_attention_cpu(*batch.args, sm_scale=0.125)


def test_without_a_compiler_the_reference_serves(tmp_path):
    """A machine with no C++ compiler (and nothing cached) still runs, on the reference."""
    env = dict(os.environ, CXX="no-such-compiler", JENGINE_KERNEL_CACHE=str(tmp_path))
    env.pop("JENGINE_ATTENTION_IMPL", None)
    code = (
        "from jengine.pallas_kernels.ragged_paged_attention import default_impl; "
        "print(default_impl())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "reference"
    assert "no C++ compiler found" in result.stderr
