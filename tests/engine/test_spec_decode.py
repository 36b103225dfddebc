"""Speculative decoding on the bundled model, with n-gram drafts (it repeats itself, so
drafts are proposed and accepted) and with its bundled draft model: with k = 1, 3, 5 the
greedy tokens equal those without speculation and transformers', logprobs of accepted
tokens within 1e-4, under batching, chunked prefill, prefix hits, preemption, stop strings
and up to max_model_len; seeded sampling at temperature 1 (and with top-k) gives exactly
the tokens it gives without speculation, and 10,000 samples follow the target
distribution; a deliberately wrong acceptance rule fails both; nothing compiles after
warmup, no block leaks and only verified tokens reach the prefix cache."""

import numpy as np
import pytest
import torch
import transformers

from jengine import LLM, SamplingParams
from jengine.core.kv_cache_utils import extend_block_hashes
from jengine.models.default import BUNDLED_MODEL_PATH
from jengine.runner import step_outputs
from tests.engine.engine_helpers import hf_greedy_logprobs
from tests.entrypoints.tiny_model import make_tiny_model

PROMPTS = [
    "ROMEO:\nBut soft, what light",
    "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?",
    "First Citizen:\nBefore we proceed any further, hear me speak. " * 3,  # chunked
    "KING RICHARD III:\nNow is the winter of our discontent",
]
MAX_TOKENS = 48
# 16-token budget: long prompts are chunked; 12 usable blocks of 16 for 4 requests of
# 59-99 tokens: preemption. max_model_len 128 (8 pages) keeps one page bucket, so each
# speculative configuration warms up 5 step shapes.
ENGINE = dict(
    dtype="float32",
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=16,
    block_size=16,
    num_gpu_blocks_override=13,
)


def ngram(k: int) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }


def draft(k: int) -> dict:
    return {"method": "draft_model", "model": "shakespeare-draft", "num_speculative_tokens": k}


SPECULATION = {
    f"{s['method']}-k{s['num_speculative_tokens']}": s
    for k in (1, 3, 5)
    for s in (ngram(k), draft(k))
}


@pytest.fixture(scope="module")
def baseline():
    llm = LLM(BUNDLED_MODEL_PATH, **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    return llm, llm.generate(PROMPTS, greedy, use_tqdm=False)


@pytest.fixture(scope="module", params=sorted(SPECULATION))
def spec_llm(request):
    return LLM(BUNDLED_MODEL_PATH, speculative_config=SPECULATION[request.param], **ENGINE)


def test_greedy_equals_no_speculation_and_transformers(spec_llm, baseline):
    core = spec_llm.engine_core
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    preemptions = core.num_preemptions
    outputs = spec_llm.generate(PROMPTS, greedy, use_tqdm=False)
    for ours, theirs in zip(outputs, baseline[1], strict=True):
        a, b = ours.outputs[0], theirs.outputs[0]
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(
            [row[t].logprob for row, t in zip(a.logprobs, a.token_ids)],
            [row[t].logprob for row, t in zip(b.logprobs, b.token_ids)],
            atol=1e-4,
            rtol=0,
        )
    again = spec_llm.generate(PROMPTS[2], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # a prefix hit, then the same tokens
    assert again.outputs[0].token_ids == baseline[1][2].outputs[0].token_ids
    assert core.num_preemptions > preemptions, "no preemption was forced"
    counts = core.spec_decode_counts
    assert counts["draft_tokens"] > 0 and counts["accepted_tokens"] > 0
    # Every block in the prefix cache holds verified tokens: its hash is one of the hash
    # chains of the requests' final prompt + output (a draft in it would hash otherwise).
    verified = set()
    for output in [*outputs, again]:
        tokens = [*output.prompt_token_ids, *output.outputs[0].token_ids]
        verified.update(extend_block_hashes([], tokens, ENGINE["block_size"]))
    cached = set(core.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)
    assert cached and cached <= verified
    assert core.compiles_after_warmup() == 0
    assert core.num_free_blocks() == core.runner.num_blocks - 1

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        BUNDLED_MODEL_PATH, torch_dtype=torch.float32
    )
    tokenizer = spec_llm.get_tokenizer()
    for prompt, output in zip(PROMPTS[:2], outputs, strict=False):
        tokens, logprobs = hf_greedy_logprobs(hf, tokenizer.encode(prompt), MAX_TOKENS)
        completion = output.outputs[0]
        n = len(tokens)
        assert completion.token_ids[:n] == tokens
        chosen = [row[t].logprob for row, t in zip(completion.logprobs, completion.token_ids)]
        np.testing.assert_allclose(chosen[:n], logprobs, atol=1e-4, rtol=0)


def test_stop_strings_cut_accepted_drafts(spec_llm, baseline):
    text = baseline[1][0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop])
    ours = spec_llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    theirs = baseline[0].generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert ours.text == theirs.text and ours.finish_reason == theirs.finish_reason == "stop"


def test_drafts_up_to_max_model_len(spec_llm, baseline):
    """Drafts stop at max_model_len (a draft model's own steps write no slot past it)."""
    core = spec_llm.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    ours = spec_llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    theirs = baseline[0].generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert ours.token_ids == theirs.token_ids and ours.finish_reason == "length"
    assert core.compiles_after_warmup() == 0
    assert core.num_free_blocks() == core.runner.num_blocks - 1


def test_a_draft_model_needs_the_same_vocabulary(tmp_path):
    other = make_tiny_model(str(tmp_path / "other_tokenizer"))
    spec = {"method": "draft_model", "model": other, "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(BUNDLED_MODEL_PATH, speculative_config=spec, **ENGINE)


def sampled(llm, **kwargs) -> list[list[int]]:
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=32, **kwargs) for seed in range(8)
    ]
    prompts = [PROMPTS[i % 2] for i in range(8)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_sampling_is_the_same_with_speculation(spec_llm, baseline):
    """Each verified position is sampled with the key of its output index, exactly as
    without speculation, so the sampled tokens (not just their distribution) agree."""
    assert sampled(spec_llm) == sampled(baseline[0])
    assert sampled(spec_llm, top_k=5) == sampled(baseline[0], top_k=5)
    assert spec_llm.engine_core.spec_decode_counts["accepted_tokens"] > 0


def test_a_wrong_acceptance_rule_is_caught(baseline, monkeypatch):
    """Keeping every draft regardless of the target's token must change the output."""
    monkeypatch.setattr(step_outputs, "accept_drafts", _accepting_everything())
    llm = LLM(BUNDLED_MODEL_PATH, speculative_config=ngram(3), warmup=False, **ENGINE)
    assert sampled(llm) != sampled(baseline[0])


# -- the output distribution -----------------------------------------------------------------

NUM_SAMPLES = 10_000
CHUNK = 64  # requests at a time: spare sampling rows for their drafts (max_num_seqs 128)
# The distribution tests count no compiles: their engines compile the few step shapes
# they use when first used instead of all of them at start-up.
SAMPLING_ENGINE = dict(max_model_len=256, warmup=False)


def next_token_distribution(llm, context: list[int], top_k: int = 0) -> dict[int, float]:
    """The target's sampling distribution after `context` at temperature 1 (its top 20
    tokens; with top_k, renormalized over the k most likely)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    row = llm.generate({"prompt_token_ids": context}, params, use_tqdm=False)[0].outputs[0]
    probs = {token: float(np.exp(lp.logprob)) for token, lp in row.logprobs[0].items()}
    if top_k:
        kept = sorted(probs, key=probs.get, reverse=True)[:top_k]
        total = sum(probs[t] for t in kept)
        probs = {t: probs[t] / total for t in kept}
    return probs


def chi_square_p(observed: list[int], distribution: dict[int, float]) -> float:
    """p-value of `observed` tokens against `distribution` (tokens expected fewer than 5
    times, and all others, pooled into one bin)."""
    from scipy.stats import chisquare

    n = len(observed)
    bins = [t for t, p in distribution.items() if p * n >= 5]
    counts = [observed.count(b) for b in bins]
    expected = [distribution[b] * n for b in bins]
    rest = n - sum(expected)
    if rest > 1e-6 * n:
        counts.append(n - sum(counts))
        expected.append(rest)
    return float(chisquare(counts, expected).pvalue)


def sample_three(llm, prompt_ids, top_k: int, num: int = NUM_SAMPLES) -> list[list[int]]:
    samples = []
    for first in range(0, num, CHUNK):
        params = [
            SamplingParams(temperature=1.0, top_k=top_k, seed=seed, max_tokens=3)
            for seed in range(first, first + CHUNK)
        ]
        outputs = llm.generate([{"prompt_token_ids": prompt_ids}] * CHUNK, params, use_tqdm=False)
        samples += [o.outputs[0].token_ids for o in outputs]
    return samples


@pytest.fixture(scope="module")
def cycle_prompt(baseline) -> list[int]:
    """The bundled model's own greedy text, which falls into a loop: n-gram lookup finds
    drafts after almost any next token, and with top-k they are often right."""
    llm = baseline[0]
    prompt = llm.get_tokenizer().encode("ROMEO:")
    greedy = SamplingParams(temperature=0.0, max_tokens=120)
    continuation = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]
    return prompt + list(continuation.outputs[0].token_ids)


def distribution_p_values(samples, reference, prompt, top_k) -> tuple[float, float]:
    """Chi-square p-values: given the most common first token, of the second (sampled
    where the drafts are verified); given also the most common second, of the third (a
    kept draft's successor or sampled next step)."""
    firsts = [s[0] for s in samples]
    first = max(set(firsts), key=firsts.count)
    given_first = [s for s in samples if s[0] == first]
    seconds = [s[1] for s in given_first]
    second = max(set(seconds), key=seconds.count)
    thirds = [s[2] for s in given_first if s[1] == second]
    assert len(seconds) > 200 and len(thirds) > 50
    p_second = next_token_distribution(reference, [*prompt, first], top_k)
    p_third = next_token_distribution(reference, [*prompt, first, second], top_k)
    return chi_square_p(seconds, p_second), chi_square_p(thirds, p_third)


@pytest.mark.parametrize(
    "speculation, top_k", [(draft(3), 0), (ngram(3), 3)], ids=["draft_model", "ngram-top_k"]
)
def test_sampled_tokens_follow_the_target_distribution(baseline, cycle_prompt, speculation, top_k):
    """10,000 seeded samples of three tokens after a fixed prompt, with speculation on
    (draft model at temperature 1, n-gram with top-k 3), match the target distribution
    (chi-square, p > 0.001)."""
    llm = LLM(BUNDLED_MODEL_PATH, speculative_config=speculation, **SAMPLING_ENGINE)
    samples = sample_three(llm, cycle_prompt, top_k)
    assert llm.engine_core.spec_decode_counts["accepted_tokens"] > 1000
    assert min(distribution_p_values(samples, baseline[0], cycle_prompt, top_k)) > 1e-3


def test_a_wrong_acceptance_rule_fails_the_distribution_test(baseline, cycle_prompt, monkeypatch):
    monkeypatch.setattr(step_outputs, "accept_drafts", _accepting_everything())
    llm = LLM(BUNDLED_MODEL_PATH, speculative_config=ngram(3), **SAMPLING_ENGINE)
    samples = sample_three(llm, cycle_prompt, top_k=3, num=4000)  # far off: fewer will do
    assert min(distribution_p_values(samples, baseline[0], cycle_prompt, top_k=3)) < 1e-3


def _accepting_everything():
    """`accept_drafts` (as the runner's output conversion calls it) with the target's
    tokens replaced by the drafts: a rule that keeps every draft."""
    original = step_outputs.accept_drafts

    def accept_all(sampled, sample_mask, spec_drafts):
        sampled = sampled.copy()
        row = 0
        for drafts in spec_drafts:
            sampled[row : row + len(drafts)] = drafts
            row += len(drafts) + 1
        return original(sampled, sample_mask, spec_drafts)

    return accept_all
