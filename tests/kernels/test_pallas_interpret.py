"""Both Pallas kernels, run in the Pallas interpreter on CPU, match the XLA reference.

The parameter grid covers GQA ratios 1/2/4/8 (and a group of 3, which the kernels pad), head
sizes 64 and 128, page sizes 16 and 32, q blocks of 1 to 16 tokens, sliding windows, and
batches mixing prefill chunks, decodes, padding requests and padding tokens. The batches
(`conftest.build_batch`) fill every slot a kernel must not read with NaN. It is a chosen
grid, not the full product: interpret mode is slow, and each case stresses something else.
Out-of-range page ids and layers must give the reference's result (both clamp them); the
GPU kernel also runs in the TPU interpreter, which raises on any read outside an operand.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jengine.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from jengine.pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from jengine.pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu
from tests.kernels.conftest import build_batch

KERNELS = {
    "gpu": functools.partial(ragged_paged_attention_gpu, interpret=True),
    "tpu": functools.partial(ragged_paged_attention_tpu, interpret=True),
}

reference = jax.jit(
    ragged_paged_attention_reference,
    static_argnames=("sm_scale", "q_block_size", "sliding_window", "soft_cap"),
)

# (q_lens, kv_lens, pad_tokens); trailing (0, 0) requests are padding.
BATCHES = {
    # prefill from scratch, chunked prefill, decodes, a padding request, padding tokens
    "mixed": ([9, 1, 20, 1, 0], [9, 40, 52, 3, 0], 3),
    "decode": ([1, 1, 1, 1, 0, 0], [1, 16, 33, 70, 0, 0], 2),
    # one request whose new tokens straddle page and q-block boundaries
    "prefill": ([37], [45], 0),
}

# (batch, num_q_heads, num_kv_heads, head_dim, block_size, q_block_size, sliding_window)
CASES = [
    ("mixed", 2, 2, 64, 16, 16, None),  # GQA 1
    ("mixed", 4, 2, 128, 32, 1, None),  # GQA 2, one token per block
    ("mixed", 8, 2, 64, 32, 4, None),  # GQA 4
    ("mixed", 8, 1, 128, 16, 16, None),  # GQA 8, q block rows = 128
    ("mixed", 6, 2, 64, 16, 8, None),  # GQA 3: group padded to 4
    ("mixed", 8, 2, 128, 16, 16, 20),  # sliding window across pages
    ("decode", 8, 1, 64, 16, 1, None),
    ("decode", 4, 4, 128, 32, 16, 17),
    ("prefill", 4, 1, 64, 16, 16, None),
    ("prefill", 2, 1, 128, 32, 8, 11),
]


def case_batch(
    batch_name,
    num_q_heads,
    num_kv_heads,
    head_dim,
    block_size,
    q_block_size,
    sliding_window,
    dtype=np.float32,
):
    """One case of the grid (a CASES row): its batch and the kernels' keyword arguments.
    (bench/gpu_check.py runs the same grid on a real GPU.)"""
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
        dtype=dtype,
    )
    kwargs = dict(sm_scale=head_dim**-0.5, q_block_size=q_block_size, sliding_window=sliding_window)
    return batch, kwargs


def _run_case(impl, *case, dtype=np.float32):
    batch, kwargs = case_batch(*case, dtype=dtype)
    out = KERNELS[impl](*batch.args, **kwargs)
    expected = reference(*batch.args, **kwargs)
    return batch, out, expected


@pytest.mark.parametrize("impl", sorted(KERNELS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_reference(impl, case):
    batch, out, expected = _run_case(impl, *case)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    out = np.asarray(out)
    assert np.isfinite(out).all(), "a kernel read a NaN slot it should have skipped"
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    num_real = int(batch.query_start_loc[-1])
    assert not out[num_real:].any(), "padding tokens must come back as zeros"


@pytest.mark.parametrize("impl", sorted(KERNELS))
@pytest.mark.parametrize("window, soft_cap", [(11, 1.5)])
def test_a_layers_own_window_traced_and_soft_capping(make_batch, impl, window, soft_cap):
    """A layer scan's per-layer window (traced; 0: none) and Gemma 2's logit soft-capping."""
    q_lens, kv_lens, pad_tokens = BATCHES["mixed"]
    batch = make_batch(
        sum(q_lens),
        q_lens,
        kv_lens,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        pad_tokens=pad_tokens,
    )
    kwargs = dict(sm_scale=0.3, q_block_size=16, soft_cap=soft_cap)
    kernel = KERNELS[impl]
    out = jax.jit(lambda w, *args: kernel(*args, **kwargs, sliding_window=w))(
        jnp.int32(window), *batch.args
    )
    expected = reference(*batch.args, **kwargs, sliding_window=window)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", sorted(KERNELS))
def test_kernel_bf16(impl):
    _, out, expected = _run_case(impl, "mixed", 8, 2, 128, 16, 16, None, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    # The kernels feed bf16 probabilities to the PV dot like flash attention; the reference
    # stays in float32 throughout.
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2
    )


@pytest.mark.parametrize("impl", sorted(KERNELS))
@pytest.mark.parametrize(
    "cache_dtype, q_dtype",
    [(jnp.float8_e4m3fn, jnp.float32), (jnp.float8_e5m2, jnp.bfloat16)],
    ids=["e4m3-f32", "e5m2-bf16"],
)
def test_kernel_reads_an_fp8_cache(impl, cache_dtype, q_dtype):
    """--kv-cache-dtype fp8: the kernels widen each page to the queries' dtype, so their
    output is the reference's over the same fp8 values (f32 queries: to float32 rounding;
    bf16: as `test_kernel_bf16`)."""
    batch, kwargs = case_batch("mixed", 8, 2, 64, 16, 16, None)
    fp8 = batch._replace(q=batch.q.astype(q_dtype), kv_cache=batch.kv_cache.astype(cache_dtype))
    out = KERNELS[impl](*fp8.args, **kwargs)
    assert out.dtype == q_dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "a kernel read a NaN slot it should have skipped"
    expected = np.asarray(reference(*fp8.args, **kwargs), np.float32)
    tolerance = 1e-5 if q_dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out, expected, rtol=tolerance, atol=tolerance)


def test_tpu_kernel_in_tpu_interpreter(make_batch):
    """The TPU interpreter simulates the DMAs the BlockSpecs issue: it raises on a page
    fetched outside the cache and fills uninitialized VMEM (scratch) with NaN."""
    batch = make_batch(
        3,
        [9, 1, 20, 1, 0],
        [9, 40, 52, 3, 0],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        pad_tokens=3,
    )
    kwargs = dict(sm_scale=0.125, q_block_size=16, sliding_window=20)
    params = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
    out = ragged_paged_attention_tpu(*batch.args, **kwargs, interpret=params)
    np.testing.assert_allclose(out, reference(*batch.args, **kwargs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", sorted(KERNELS))
def test_entry_point_dispatches_to_kernel(make_batch, impl):
    batch = make_batch(
        7, [3, 1], [3, 20], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16
    )
    out = ragged_paged_attention(*batch.args, sm_scale=0.125, impl=impl, interpret=True)
    expected = reference(*batch.args, sm_scale=0.125)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


INT32_MAX = np.iinfo(np.int32).max
BAD_IDS = np.int32([-1, -7, 10_000, INT32_MAX, -INT32_MAX - 1])


def _with_bad_ids_in_unused_slots(batch):
    tables = batch.block_tables.copy()
    for r, kv_len in enumerate(batch.kv_lens):
        used = -(-int(kv_len) // batch.kv_cache.shape[4])
        tables[r, used:] = np.resize(BAD_IDS, tables.shape[1] - used)
    return batch._replace(block_tables=tables)


@pytest.mark.parametrize("impl", sorted(KERNELS))
def test_out_of_range_page_ids_in_unused_slots(make_batch, impl):
    batch = make_batch(
        8,
        [9, 1, 20, 1, 0],
        [9, 40, 52, 3, 0],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        pad_tokens=3,
        extra_pages=3,
    )
    batch = _with_bad_ids_in_unused_slots(batch)
    for sliding_window in (None, 20):
        kwargs = dict(sm_scale=0.125, q_block_size=16, sliding_window=sliding_window)
        out = np.asarray(KERNELS[impl](*batch.args, **kwargs))
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, reference(*batch.args, **kwargs), rtol=1e-5, atol=1e-5)


def test_gpu_kernel_reads_nothing_outside_its_operands(make_batch):
    """In the TPU interpreter, which raises on any read outside an operand (on a GPU such a
    read goes unnoticed): page ids out of range in used slots, a layer past the cache (both
    clamped, as the reference clamps them) and a kv_len longer than the table."""
    batch = make_batch(
        9, [9, 1, 1, 0], [9, 40, 33, 0], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16
    )
    kv_cache = np.nan_to_num(batch.kv_cache)  # clamped ids read pages the batch does not own
    tables = batch.block_tables.copy()
    tables[0, 0], tables[1, 1], tables[2, 2] = -5, kv_cache.shape[3] + 9, INT32_MAX
    batch = batch._replace(kv_cache=kv_cache, block_tables=tables, layer=5)
    params = pltpu.InterpretParams(out_of_bounds_reads="raise")
    kernel = functools.partial(ragged_paged_attention_gpu, interpret=params)
    kwargs = dict(sm_scale=0.125, q_block_size=16)
    out = kernel(*batch.args, **kwargs)
    np.testing.assert_allclose(out, reference(*batch.args, **kwargs), rtol=1e-5, atol=1e-5)

    kv_lens = batch.kv_lens.copy()
    kv_lens[1] = tables.shape[1] * 16 + 40  # past the table: no reference result to match
    args = list(batch.args)
    args[3] = jnp.asarray(kv_lens)
    jax.block_until_ready(kernel(*args, **kwargs))
