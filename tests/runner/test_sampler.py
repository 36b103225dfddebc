"""The on-device sampler against plain numpy statements of each rule, each test of a
sampling rule run both ways the sampler skips work: with conditionals (CPU, TPU) and with
every branch computed and selected (GPUs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.runner import sampler, truncation
from jengine.runner.prepared_step import neutral_sampling_arrays
from jengine.runner.sampler import SamplingMetadata, SamplingState
from jengine.sampling_params import MAX_SUPPRESSED_IDS

# Jitted as in the runner: op-by-op dispatch would be slow and test a different program.
sample = jax.jit(sampler.sample, static_argnames="select")
_truncate = jax.jit(truncation.truncate, static_argnums=2, static_argnames="select")
_apply_history = jax.jit(sampler._apply_history)
top_logprobs = jax.jit(sampler.top_logprobs, static_argnums=2)
write_slot_history = jax.jit(sampler.write_slot_history)

V = 32


@pytest.fixture(params=["conditionals", "selects"])
def select(request) -> bool:
    """The sampler's branches as this machine's backend takes them, and as a GPU's."""
    return request.param == "selects"


def _meta(R, **overrides):
    # Real requests in slots 0..R-1, each with its own seed, all yielding a token.
    base = neutral_sampling_arrays(R)
    base.update(
        slots=np.arange(R, dtype=np.int32),
        seeds=np.arange(R, dtype=np.uint32),
        sample_mask=np.ones(R, bool),
    )
    base.update({k: np.asarray(v, base[k].dtype) for k, v in overrides.items()})
    return SamplingMetadata(**base)


def _logits(R, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(R, V)).astype(np.float32) * 3)


def test_greedy_is_argmax_and_suppression_applies(select):
    logits = _logits(3)
    ids, _ = sample(logits, _meta(3), SamplingState.zeros(3, V), select=select)
    np.testing.assert_array_equal(ids, np.argmax(logits, -1))
    top = np.argmax(logits, -1)
    suppressed = np.full((3, MAX_SUPPRESSED_IDS), -1, np.int32)
    suppressed[:, 0] = top
    ids, _ = sample(
        logits, _meta(3, suppressed_ids=suppressed), SamplingState.zeros(3, V), select=select
    )
    assert not np.any(np.asarray(ids) == top)


def test_greedy_with_masked_ids_is_argmax_of_the_masked_logits(select):
    """min_tokens' masked ids, whether or not a row's argmax is one of them (the plain
    argmax serves the rows where it is not), with tied maxima: the first unmasked maximum."""
    logits = np.asarray(_logits(4, seed=3)).copy()
    logits[2, [5, 9]] = logits[3, [5, 9]] = 100.0  # tied maxima at 5 and 9
    second = np.argsort(-logits[0])[1]
    cases = {  # row -> masked ids
        "masking the argmax of one row": {0: [int(np.argmax(logits[0]))]},
        "masking other ids only": {0: [int(second)], 1: [0, 1]},
        "masking the first of tied maxima": {2: [5]},
        "masking the second of tied maxima": {3: [9]},
    }
    for name, masked in cases.items():
        suppressed = np.full((4, MAX_SUPPRESSED_IDS), -1, np.int32)
        expected = logits.copy()
        for row, ids in masked.items():
            suppressed[row, : len(ids)] = ids
            expected[row, ids] = -np.inf
        meta = _meta(4, suppressed_ids=suppressed)
        ids, _ = sample(jnp.asarray(logits), meta, SamplingState.zeros(4, V), select=select)
        np.testing.assert_array_equal(ids, np.argmax(expected, -1), err_msg=name)


@pytest.mark.parametrize("num_candidates", [4, V])
def test_truncation_rules(num_candidates, select):
    logits = _logits(4, seed=1)
    meta = _meta(4, top_k=[3, 0, 0, 2], top_p=[1.0, 0.6, 1.0, 0.01], min_p=[0, 0, 0.2, 0])
    kept = np.isfinite(np.asarray(_truncate(logits, meta, num_candidates, select=select)))
    order = np.argsort(-np.asarray(logits), -1)
    probs = np.asarray(jax.nn.softmax(logits, -1))
    assert set(np.nonzero(kept[0])[0]) == set(order[0, :3])  # top-k 3
    sorted_p = np.sort(probs[1])[::-1]
    n_top_p = int(np.searchsorted(np.cumsum(sorted_p) - sorted_p, 0.6, side="left"))
    assert set(np.nonzero(kept[1])[0]) == set(order[1, :n_top_p])  # smallest set reaching 0.6
    assert set(np.nonzero(kept[2])[0]) == set(np.nonzero(probs[2] >= 0.2 * probs[2].max())[0])
    assert set(np.nonzero(kept[3])[0]) == {order[3, 0]}  # top-p tiny keeps the best token


def test_truncation_from_the_largest_logits_equals_the_whole_vocabulary(select):
    """Thresholds read off the 4 largest logits, or found by bisection when a row's kept
    set may reach past them (a top_k of 9, a wide nucleus): the same masks as with every
    logit a candidate."""
    logits = _logits(4, seed=2)
    decided = _meta(4, top_k=[3, 0, 4, 2], top_p=[1.0, 0.05, 0.5, 1.0], min_p=[0, 0, 0, 0.3])
    undecided = _meta(4, top_k=[3, 9, 0, 0], top_p=[1.0, 1.0, 0.95, 1.0], min_p=[0, 0, 0, 0.3])
    for meta in (decided, undecided):
        np.testing.assert_array_equal(
            _truncate(logits, meta, 4, select=select), _truncate(logits, meta, V, select=select)
        )
    kept = np.isfinite(np.asarray(_truncate(logits, undecided, 4, select=select)))
    assert kept[1].sum() == 9 and kept[2].sum() > 4


def _kept_by_sorting(logits, top_k, top_p, min_p):
    """One row's kept ids by vLLM's rules, stated over its sorted logits in numpy."""
    probs = np.exp(logits - logits.max())
    logits = np.where(probs < min_p * probs.max(), -np.inf, logits)
    largest = np.sort(logits)[::-1]
    kth = largest[min(top_k, len(largest)) - 1] if top_k > 0 else -np.inf
    kept = np.where(logits >= kth, logits, -np.inf)
    probs = np.exp(kept - kept.max()) / np.exp(kept - kept.max()).sum()
    order = np.argsort(-kept, kind="stable")
    exclusive = np.cumsum(probs[order]) - probs[order]
    nucleus = kept[order][exclusive < top_p].min() if top_p < 1.0 else -np.inf
    return set(np.nonzero(np.isfinite(logits) & (logits >= max(kth, nucleus)))[0])


def test_bisection_keeps_what_sorting_keeps_over_flat_peaked_tied_and_masked_rows(select):
    """2000 ids, 8 candidates, so that most rows are found by bisection: flat rows (a wide
    nucleus), peaked ones, ties at the cut, zeros of both signs and -inf (masked) logits,
    against the rules applied to the sorted row."""
    rng = np.random.default_rng(7)
    R, vocab = 12, 2000
    logits = rng.normal(size=(R, vocab)).astype(np.float32)
    logits[:4] *= 0.01  # flat: top-p keeps most of the vocabulary
    logits[4:8] *= 6.0  # peaked
    logits[8, :1000] = np.round(logits[8, :1000])  # many ties
    logits[9, ::3] = 0.0
    logits[9, 1::3] = -0.0
    logits[10, ::2] = -np.inf
    logits[11, :40] = 5.0  # 40 tied largest
    top_k = rng.choice([0, 0, 5, 40, 300, 1999], size=R)
    top_k[:4] = [0, 0, 300, 1999]
    top_k[11] = 20  # inside the tie
    top_p = rng.choice([1.0, 0.95, 0.5, 0.1], size=R)
    top_p[:4] = 0.9
    min_p = np.where(rng.random(R) < 0.25, 0.5, 0.0)
    meta = _meta(R, top_k=top_k, top_p=top_p, min_p=min_p)
    kept = np.isfinite(np.asarray(_truncate(jnp.asarray(logits), meta, 8, select=select)))
    for row in range(R):
        expected = _kept_by_sorting(logits[row], top_k[row], top_p[row], min_p[row])
        assert set(np.nonzero(kept[row])[0]) == expected, row
    assert kept[:2].sum(-1).min() > 1000 and kept[11].sum() == 40


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's top-k lowering")
def test_sampling_program_never_sorts_a_vocabulary(select):
    """The compiled sampler holds no sort: XLA:CPU's sort of one row of 32000 takes ~12 ms.
    A second slice of the candidates (`lax.top_k`'s output) once made XLA sort the row in
    place of its top-k; this is what catches that."""
    R, vocab = 2, 1000
    logits = jnp.zeros((R, vocab))
    programs = {
        "truncate": _truncate.lower(
            logits, _meta(R), truncation.TRUNCATION_CANDIDATES, select=select
        ),
        "sample": sample.lower(logits, _meta(R), SamplingState.zeros(R, vocab), select=select),
    }
    for name, lowered in programs.items():
        compiled = lowered.compile().as_text()
        assert " sort(" not in compiled, name
        assert "TopK" in compiled, name  # the candidates are there, as XLA's top-k


def test_random_sampling_follows_seed_and_distribution(select):
    logits = jnp.tile(jnp.log(jnp.asarray([0.7, 0.2, 0.1] + [1e-9] * (V - 3))), (2, 1))
    counts = np.zeros(V)
    state = SamplingState.zeros(2, V)
    for index in range(200):
        meta = _meta(2, temperature=[1.0, 1.0], seeds=[5, 5], output_index=[index, index])
        ids, state = sample(logits, meta, state, select=select)
        assert ids[0] == ids[1]  # same seed and position -> same token
        counts[int(ids[0])] += 1
    assert abs(counts[0] / 200 - 0.7) < 0.1 and counts[3:].sum() == 0


def test_draws_over_an_odd_vocabulary_follow_the_probabilities_and_skip_masked_ids(select):
    """The draw's two levels (blocks of 128 ids, then inside one) over 300 ids: tokens at
    block edges come as often as their probability, masked ids (top-k here) never."""
    V_odd, R = 300, 512
    probs = np.full(V_odd, 1e-3)
    probs[[0, 127, 128, 255, 256, 299]] = [0.3, 0.25, 0.2, 0.1, 0.05, 0.02]
    logits = jnp.tile(jnp.log(jnp.asarray(probs / probs.sum(), jnp.float32)), (R, 1))
    counts = np.zeros(V_odd)
    state = SamplingState.zeros(R, V_odd)
    for index in range(8):
        meta = _meta(R, temperature=[1.0] * R, top_k=[6] * R, output_index=[index] * R)
        ids, _ = sample(logits, meta, state, select=select)
        counts += np.bincount(np.asarray(ids), minlength=V_odd)
    kept = [0, 127, 128, 255, 256, 299]
    assert counts.sum() == counts[kept].sum()  # top-k's masked ids never drawn
    expected = probs[kept] / probs[kept].sum()
    np.testing.assert_allclose(counts[kept] / counts.sum(), expected, atol=0.03)


def test_penalties_and_bias_follow_vllm_formulas(select):
    logits = _logits(1, seed=2)
    state = SamplingState.zeros(2, V)
    prompt = np.full(8, -1, np.int32)
    prompt[:2] = [1, 2]
    output = np.full(8, -1, np.int32)
    output[:3] = [2, 3, 3]
    bias_ids = np.full(8, -1, np.int32)
    bias_ids[0] = 9
    bias_values = np.zeros(8, np.float32)
    bias_values[0] = -50.0
    state = write_slot_history(state, np.int32(1), prompt, output, bias_ids, bias_values)
    meta = _meta(
        1,
        slots=[1],
        presence_penalty=[0.5],
        frequency_penalty=[0.25],
        repetition_penalty=[2.0],
        use_history=[True],
    )
    got = np.asarray(_apply_history(logits, meta, state))[0]
    expected = np.asarray(logits)[0].copy()
    expected[9] -= 50.0
    for token in (1, 2, 3):  # seen in prompt or output: repetition penalty
        expected[token] = expected[token] / 2 if expected[token] > 0 else expected[token] * 2
    expected[2] -= 0.25 * 1 + 0.5
    expected[3] -= 0.25 * 2 + 0.5
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    # Counting: sampling bumps the slot's output counts for rows that yield a token.
    ids, new_state = sample(logits, meta, state, select=select)
    assert (
        int(new_state.output_counts[1, int(ids[0])]) == int(state.output_counts[1, int(ids[0])]) + 1
    )


def test_top_logprobs_ranks():
    logits = _logits(2, seed=3)
    chosen = jnp.asarray([int(np.argsort(-np.asarray(logits[0]))[4]), int(np.argmax(logits[1]))])
    ids, values, ranks = top_logprobs(logits, chosen, 3)
    ref = np.asarray(jax.nn.log_softmax(logits, -1))
    assert list(np.asarray(ranks)) == [5, 1]
    np.testing.assert_allclose(values[:, 0], ref[[0, 1], np.asarray(chosen)], rtol=1e-6)
    np.testing.assert_array_equal(ids[:, 1:], np.argsort(-ref, -1)[:, :3])


def test_argmax_matches_numpy_first_occurrence():
    rng = np.random.default_rng(1)
    # A vocabulary that is not a multiple of the block, ties (small integers), -inf rows.
    x = rng.integers(-3, 4, size=(37, 1000)).astype(np.float32)
    x[5] = -np.inf
    x[6, 999] = 10.0  # the maximum in the padded last block
    x[7, :] = 1.0  # every entry ties
    got = jax.jit(sampler.argmax)(jnp.asarray(x))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert got.dtype == jnp.int32
