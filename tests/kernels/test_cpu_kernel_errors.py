"""The fused CPU kernel on operands it must not trust: shapes it cannot index by are refused
with an error naming the operand (a ValueError at trace time from `cpu.check_operands`, and
the same refusal from `cpu.cc` itself when the target is called directly), metadata that
is only known at run time is refused by `cpu.cc` (an XLA error carrying its message:
`JaxRuntimeError` when it surfaces as the result is read, `ValueError` when XLA ran the
program inline in the dispatching call and reported its INVALID_ARGUMENT there; which one
depends on XLA's scheduling, so both are accepted), and out-of-range page ids, short
contexts and huge windows give the reference's result. None of it may read outside a
buffer or come back as garbage.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.pallas_kernels.ragged_paged_attention import cpu, ragged_paged_attention_reference

reference = jax.jit(
    ragged_paged_attention_reference, static_argnames=("sm_scale", "sliding_window")
)
kernel = jax.jit(cpu.ragged_paged_attention_cpu, static_argnames=("sm_scale", "sliding_window"))
INT32_MAX = np.iinfo(np.int32).max
RUN_TIME_REFUSAL = (jax.errors.JaxRuntimeError, ValueError)  # see the module docstring


@pytest.fixture
def batch(make_batch):
    """Three requests (a prefill, a decode, a padding request) and two padding tokens,
    2 layers, 4 q heads over 2 kv heads of 32, pages of 16, one spare table column."""
    return make_batch(
        0,
        [5, 1, 0],
        [5, 30, 0],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        pad_tokens=2,
    )


def _args(batch, **replace):
    names = ("q", "kv_cache", "layer", "kv_lens", "block_tables", "query_start_loc")
    args = dict(zip(names, batch.args, strict=True))
    args.update({name: jnp.asarray(value) for name, value in replace.items()})
    return [args[name] for name in names]


# (what is wrong, operand replacements as functions of the batch, message)
BAD_SHAPES = [
    ("q rank 2", lambda b: dict(q=b.q[:, 0]), "q .*must be \\[tokens, q heads, head dim\\]"),
    ("kv_cache rank 5", lambda b: dict(kv_cache=b.kv_cache[0]), "kv_cache must be"),
    ("k/v axis of 1", lambda b: dict(kv_cache=b.kv_cache[:, :1]), "kv_cache must be"),
    ("head dims differ", lambda b: dict(q=b.q[..., :16]), "head dim must equal"),
    ("3 q heads over 2", lambda b: dict(q=b.q[:, :3]), "multiple of kv_cache's kv heads"),
    ("table rows short", lambda b: dict(block_tables=b.block_tables[:2]), "block_tables needs"),
    ("starts short", lambda b: dict(query_start_loc=b.query_start_loc[:3]), "one entry more"),
    ("starts long", lambda b: dict(query_start_loc=[0, 5, 6, 6, 6]), "one entry more"),
    ("kv_lens 2-D", lambda b: dict(kv_lens=b.kv_lens[:, None]), "kv_lens must be \\[R\\]"),
]


@pytest.mark.parametrize("case", BAD_SHAPES, ids=lambda c: c[0])
def test_bad_shapes_are_refused_at_trace_time(batch, case):
    _, replace, message = case
    with pytest.raises(ValueError, match=message) as error:
        kernel(*_args(batch, **replace(batch)), sm_scale=0.125)
    assert "got q (" in str(error.value), "the message must show the shapes it got"


@pytest.mark.parametrize(
    "case",
    [*BAD_SHAPES, ("group of 128", lambda b: dict(q=np.repeat(b.q, 64, 1)), "at most 64 q")],
    ids=lambda c: c[0],
)
def test_the_kernel_itself_refuses_bad_shapes(batch, case):
    """Called straight through the FFI (no trace-time check), cpu.cc says the same."""
    assert cpu.load() is None  # registers the target
    _, replace, message = case
    q, kv_cache, layer, *metadata = _args(batch, **replace(batch))
    call = jax.jit(cpu._attention, static_argnums=(0, 1, 2, 3))
    with pytest.raises(RUN_TIME_REFUSAL, match=message) as error:
        np.asarray(
            call(0.125, None, 16, cpu.TARGET_NAME, q, kv_cache, jnp.int32([layer, 0]), *metadata)
        )
    assert "ragged paged attention" in str(error.value) and "got q [" in str(error.value)


@pytest.mark.parametrize("layer", [-1, 2, 7])
def test_layer_outside_the_cache(batch, layer):
    args = _args(batch, layer=layer)
    with pytest.raises(ValueError, match=f"layer {layer} is outside the cache's 2 layers"):
        cpu.ragged_paged_attention_cpu(*args, sm_scale=0.125)
    # Traced (as in a scan over layers), the kernel refuses it at run time.
    with pytest.raises(RUN_TIME_REFUSAL, match=f"layer {layer} is outside"):
        np.asarray(kernel(*args, sm_scale=0.125))
    with pytest.raises(ValueError, match="layer must be one index"):
        kernel(*_args(batch, layer=[0, 1]), sm_scale=0.125)


@pytest.mark.parametrize(
    "query_start_loc, message",
    [
        ([0, 5, 4, 6], "entry 2 is 4 after 5"),  # decreasing
        ([-1, 5, 6, 6], "entry 0 is -1 after 0"),  # negative
        ([0, 5, 6, 9], "<= 8 \\(q's tokens\\); entry 3 is 9"),  # past q's 8 tokens
    ],
)
def test_bad_query_start_loc_is_refused_at_run_time(batch, query_start_loc, message):
    args = _args(batch, query_start_loc=np.int32(query_start_loc))
    with pytest.raises(RUN_TIME_REFUSAL, match=f"query_start_loc must rise.*{message}"):
        np.asarray(kernel(*args, sm_scale=0.125))


@pytest.mark.parametrize("kv_len, what", [(-3, "-3"), (3 * 16 + 1, "49"), (INT32_MAX, "2147")])
def test_kv_lens_outside_the_table_are_refused_at_run_time(batch, kv_len, what):
    """Three table columns of 16-token pages hold 48 positions at most."""
    kv_lens = batch.kv_lens.copy()
    kv_lens[1] = kv_len
    with pytest.raises(RUN_TIME_REFUSAL, match=f"kv_lens\\[1\\] = {what}.*\\[0, 48\\]"):
        np.asarray(kernel(*_args(batch, kv_lens=kv_lens), sm_scale=0.125))


def test_a_full_table_is_fine(make_batch, oracle):
    """kv_len == pages per request x page size, the edge of what the table holds."""
    batch = make_batch(
        1,
        [3, 1],
        [32, 48],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        extra_pages=0,
    )
    assert batch.block_tables.shape[1] * 16 == 48
    out = kernel(*batch.args, sm_scale=0.125)
    np.testing.assert_allclose(out, oracle(batch, 0.125), rtol=1e-5, atol=1e-5)


BAD_IDS = np.int32([-1, -7, 10_000, INT32_MAX, -INT32_MAX - 1])


def test_out_of_range_page_ids_in_unused_slots_are_never_read(make_batch, oracle):
    batch = make_batch(
        2,
        [9, 1, 20, 1, 0],
        [9, 40, 52, 3, 0],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        pad_tokens=3,
        extra_pages=3,
    )
    tables = batch.block_tables.copy()
    for r, kv_len in enumerate(batch.kv_lens):
        used = -(-int(kv_len) // 16)
        tables[r, used:] = np.resize(BAD_IDS, tables.shape[1] - used)
    args = _args(batch, block_tables=tables)
    for window in (None, 20):
        out = np.asarray(kernel(*args, sm_scale=0.125, sliding_window=window))
        assert np.isfinite(out).all()
        np.testing.assert_allclose(
            out, reference(*args, sm_scale=0.125, sliding_window=window), rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(out, oracle(batch, 0.125, window), rtol=1e-5, atol=1e-5)


def test_out_of_range_page_ids_in_used_slots_are_clamped_like_the_reference(make_batch):
    batch = make_batch(
        3, [9, 1, 1], [9, 40, 33], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16
    )
    # Finite everywhere: the clamped pages (0 and the last) are read, and must be the same.
    kv_cache = np.nan_to_num(batch.kv_cache)
    kv_cache[:, :, :, 0] = 0.5
    kv_cache[:, :, :, -1] = -0.25
    tables = batch.block_tables.copy()
    tables[0, 0], tables[1, 1], tables[2, 2] = -5, kv_cache.shape[3] + 9, INT32_MAX
    args = _args(batch, kv_cache=kv_cache, block_tables=tables)
    out = np.asarray(kernel(*args, sm_scale=0.125))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, reference(*args, sm_scale=0.125), rtol=1e-5, atol=1e-5)


def test_tokens_before_position_zero_and_huge_windows(batch):
    """A request with more new tokens than context (its first tokens sit before position 0
    and see nothing) and a window as wide as int32 allows give the reference's result."""
    kv_lens = batch.kv_lens.copy()
    kv_lens[0] = 3  # 5 new tokens: positions -2 .. 2
    args = _args(batch, kv_lens=kv_lens)
    for window in (None, INT32_MAX):
        out = np.asarray(kernel(*args, sm_scale=0.125, sliding_window=window))
        expected = reference(*args, sm_scale=0.125, sliding_window=window)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
        assert not out[:2].any(), "tokens before position 0 see nothing"
