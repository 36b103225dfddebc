"""LLM.generate against transformers: greedy tokens identical, logprobs within 1e-4, under
batching, chunked prefill, prefix caching (on and off) and preemption; and no compile
after warmup."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from jengine import SamplingParams
from jengine.sampling_params import RequestOutputKind
from tests.engine.engine_helpers import (
    ATTENTION_SETUPS,
    ENGINE_KWARGS,
    hf_greedy,
    make_llm,
    random_prompts,
)

MAX_TOKENS = 10
REPO = Path(__file__).resolve().parents[2]


def _assert_matches_hf(llm, hf_model, prompts):
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
    )
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        expected = hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert completion.token_ids == expected
        assert completion.finish_reason == ("length" if len(expected) == MAX_TOKENS else "stop")
    return outputs


def test_greedy_batch_with_chunked_prefill_matches_transformers(llm, checkpoint):
    prompts = random_prompts(20, seed=1)
    assert max(map(len, prompts)) > ENGINE_KWARGS["max_num_batched_tokens"]  # chunked
    _assert_matches_hf(llm, checkpoint[1], prompts)
    assert llm.engine_core.compiles_after_warmup() == 0


def test_prefix_caching_hits_and_matches(llm, checkpoint):
    shared = random_prompts(1, seed=2, low=30, high=31)[0]
    prompts = [shared + p for p in random_prompts(16, seed=3, low=1, high=20)]
    outputs = _assert_matches_hf(llm, checkpoint[1], prompts)
    # Requests after the first wave find the shared prefix's full blocks in the cache.
    block_size = llm.engine_core.config.cache.block_size
    assert max(o.num_cached_tokens for o in outputs) == len(shared) // block_size * block_size


def test_reset_prefix_cache_forgets_cached_prompts(llm):
    prompt = [{"prompt_token_ids": random_prompts(1, seed=5, low=24, high=25)[0]}]
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    # The prompt's full blocks, short of its last token (whose logits sampling needs).
    block_size = llm.engine_core.config.cache.block_size
    assert again.num_cached_tokens == (24 - 1) // block_size * block_size
    assert llm.reset_prefix_cache()
    after_reset = llm.generate(prompt, params, use_tqdm=False)[0]
    assert after_reset.num_cached_tokens == 0
    assert after_reset.outputs[0].token_ids == first.outputs[0].token_ids
    # While a request holds blocks nothing is forgotten; once it ends, it can be.
    engine = llm.llm_engine
    engine.add_request("holder", prompt[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert not llm.reset_prefix_cache()
    engine.abort_request("holder")
    assert llm.reset_prefix_cache()


def test_cache_salt_shares_blocks_only_within_a_salt(llm):
    """vLLM's `cache_salt` in a prompt dict: the same prompt hits the cache under the salt
    it ran with, and not under another salt or none (nor unsalted runs under a salt);
    the outputs are the same in every case. A bad salt is a ValueError."""
    ids = random_prompts(1, seed=6, low=40, high=41)[0]
    params = SamplingParams(temperature=0, max_tokens=4)
    block_size = llm.engine_core.config.cache.block_size
    full_blocks = (40 - 1) // block_size * block_size

    def run(**salt):
        [out] = llm.generate([{"prompt_token_ids": ids, **salt}], params, use_tqdm=False)
        return out.num_cached_tokens, out.outputs[0].token_ids

    runs = [run(cache_salt="tenant-a"), run(cache_salt="tenant-a"), run(cache_salt="tenant-b"),
            run(), run(), run(cache_salt="tenant-b")]  # fmt: skip
    assert [cached for cached, _ in runs] == [0, full_blocks, 0, 0, full_blocks, full_blocks]
    assert len({tuple(tokens) for _, tokens in runs}) == 1
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate([{"prompt_token_ids": ids, "cache_salt": bad}], params, use_tqdm=False)


def test_prefix_caching_off_matches(checkpoint, attention_setup):
    llm = make_llm(checkpoint[0], attention_setup, enable_prefix_caching=False)
    shared = random_prompts(1, seed=2, low=30, high=31)[0]
    prompts = [shared + p for p in random_prompts(16, seed=3, low=1, high=20)]
    outputs = _assert_matches_hf(llm, checkpoint[1], prompts)
    assert all(o.num_cached_tokens == 0 for o in outputs)


def test_preemption_keeps_outputs_identical(checkpoint, attention_setup):
    # About 104 tokens of KV blocks (26 of 4, or 6 of 16, the least max_model_len allows):
    # 8 running requests of up to ~70 tokens cannot all fit.
    num_blocks = 1 + 104 // ATTENTION_SETUPS[attention_setup]["block_size"]
    llm = make_llm(checkpoint[0], attention_setup, num_gpu_blocks_override=num_blocks)
    prompts = random_prompts(16, seed=4, low=20, high=60)
    _assert_matches_hf(llm, checkpoint[1], prompts)
    assert llm.engine_core.num_preemptions > 0
    assert llm.engine_core.num_free_blocks() == num_blocks - 1  # nothing leaked
    assert llm.engine_core.compiles_after_warmup() == 0


def test_logprobs_match_transformers_log_softmax(llm, checkpoint):
    hf_model = checkpoint[1]
    prompts = random_prompts(4, seed=5, low=5, high=50)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        full = prompt + completion.token_ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([full])).logits[0]
        expected = torch.log_softmax(logits.double(), -1).numpy()
        # Sampled-token logprobs: position len(prompt) - 1 + i predicts output token i.
        assert len(completion.logprobs) == len(completion.token_ids)
        for i, (token, row) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            ref = expected[len(prompt) - 1 + i]
            assert row[token].rank == 1  # greedy picks the top token
            assert abs(row[token].logprob - ref[token]) < 1e-4
            top5 = np.argsort(-ref)[:5]
            assert set(row) == set(top5.tolist())
            for tid, lp in row.items():
                assert abs(lp.logprob - ref[tid]) < 1e-4
        # Prompt logprobs: None for the first token, then the logprob of each next token.
        assert output.prompt_logprobs[0] is None
        assert len(output.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            row = output.prompt_logprobs[p]
            assert abs(row[prompt[p]].logprob - expected[p - 1][prompt[p]]) < 1e-4
            assert len(row) <= 4
        cumulative = sum(
            row[t].logprob for t, row in zip(completion.token_ids, completion.logprobs)
        )
        assert abs(completion.cumulative_logprob - cumulative) < 1e-3


def test_max_logprobs_sets_how_many_a_request_may_ask_for(checkpoint):
    """vLLM's max_logprobs: -1 lets a request see the whole vocabulary's logprobs (against
    transformers; asked as -1 or as its size), a number caps what a request may ask for;
    warmup compiles the width."""
    from jengine import LLM
    from tests.models.checkpoints import VOCAB

    path, hf_model = checkpoint
    prompt = random_prompts(1, seed=9, low=6, high=7)[0]
    request = [{"prompt_token_ids": prompt}]
    every = LLM(path, dtype="float32", max_model_len=32, max_num_seqs=2, max_logprobs=-1)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=VOCAB)
    output = every.generate(request, params)[0]
    completion = output.outputs[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + completion.token_ids])).logits[0]
    expected = torch.log_softmax(logits.double(), -1).numpy()
    rows = [(output.prompt_logprobs[p], p - 1) for p in range(1, len(prompt))]
    rows += [(row, len(prompt) - 1 + i) for i, row in enumerate(completion.logprobs)]
    for row, position in rows:
        assert sorted(row) == list(range(VOCAB))
        got = np.array([row[token].logprob for token in range(VOCAB)])
        np.testing.assert_allclose(got, expected[position], atol=1e-4, rtol=0)
    assert every.engine_core.compiles_after_warmup() == 0
    with pytest.raises(ValueError, match=f"logprobs={VOCAB + 1} exceeds the maximum of {VOCAB}"):
        every.generate(request, SamplingParams(max_tokens=1, logprobs=VOCAB + 1))
    capped = LLM(path, dtype="float32", max_model_len=32, max_num_seqs=2, max_logprobs=3,
                 warmup=False)  # fmt: skip
    with pytest.raises(ValueError, match="prompt_logprobs=4 exceeds the maximum of 3"):
        capped.generate(request, SamplingParams(max_tokens=1, prompt_logprobs=4))
    with pytest.raises(ValueError, match=rf"logprobs=-1 \(the whole vocabulary, {VOCAB}\) exc"):
        capped.generate(request, SamplingParams(max_tokens=1, logprobs=-1))
    row = capped.generate(request, SamplingParams(max_tokens=1, logprobs=3))[0].outputs[0]
    assert set(np.argsort(-expected[len(prompt) - 1])[:3].tolist()) <= set(row.logprobs[0])


def test_numpy_token_ids_are_prompts(llm):
    """Token ids as research code holds them: an array, a 2-D array, numpy integers."""
    prompts = random_prompts(2, seed=10, low=7, high=8)
    greedy = SamplingParams(temperature=0, max_tokens=3)

    def tokens(prompts_in):
        return [o.outputs[0].token_ids for o in llm.generate(prompts_in, greedy)]

    expected = tokens([{"prompt_token_ids": p} for p in prompts])
    assert tokens(np.array(prompts)) == expected
    assert tokens(np.array(prompts[0])) == expected[:1]
    assert tokens([np.int64(t) for t in prompts[0]]) == expected[:1]


def test_vllm_style_engine_calls_and_prompt_keys(llm):
    """vLLM's LLMEngine.add_request arguments (arrival time, adapter, priority, in its
    order) and SamplingParams.output_kind, and prompt-dict keys this engine cannot honour
    refused by name (they were dropped: the prompt ran without its image or embeddings)."""
    prompt = random_prompts(1, seed=40, low=8, high=9)[0]
    greedy = SamplingParams(temperature=0, max_tokens=3)
    [expected] = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)
    engine = llm.llm_engine
    engine.add_request("vllm-style", {"prompt_token_ids": prompt}, greedy, time.time(), None, 0)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    # vLLM's SamplingParams.output_kind: each output holds only its new token; LLM.generate
    # returns the final outputs whatever it says.
    delta = SamplingParams(temperature=0, max_tokens=3, output_kind=RequestOutputKind.DELTA)
    engine.add_request("deltas", {"prompt_token_ids": prompt}, delta)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    pieces = [list(o.outputs[0].token_ids) for o in outputs]
    assert len(pieces) > 1 and sum(pieces, []) == expected.outputs[0].token_ids
    [final] = llm.generate({"prompt_token_ids": prompt}, delta, use_tqdm=False)
    assert final.outputs[0].token_ids == expected.outputs[0].token_ids
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")
    for key in ("multi_modal_data", "prompt_embeds", "mm_processor_kwargs"):
        with pytest.raises(ValueError, match=f"not \\['{key}'\\]"):
            llm.generate({"prompt_token_ids": prompt, key: {}}, greedy, use_tqdm=False)


def test_vllm_keywords_whose_purpose_is_met_are_taken_and_said(checkpoint, caplog):
    from jengine import LLM, AsyncLLM, EngineArgs, LLMEngine  # vLLM's top-level names

    assert {AsyncLLM.__name__, EngineArgs.__name__, LLMEngine.__name__}
    met = dict(trust_remote_code=True, enforce_eager=True, disable_log_stats=True, swap_space=4)
    with caplog.at_level("INFO", logger="jengine.entrypoints.llm"):
        LLM(checkpoint[0], **ENGINE_KWARGS, warmup=False, **met)
    for name in met:
        assert f"{name}=" in caplog.text and "changes nothing" in caplog.text, name
    with pytest.raises(ValueError, match=r"unknown LLM arguments: \['revision'\]"):
        LLM(checkpoint[0], revision="main")


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """vLLM's `SamplingParams.truncate_prompt_tokens`: the last k tokens are the prompt
    (what runs, what is reported), a prompt longer than max_model_len included; -1 keeps
    the last max_model_len; a k above max_model_len is refused."""
    max_model_len = llm.llm_engine.input_processor.max_model_len
    prompt = random_prompts(1, seed=11, low=max_model_len + 20, high=max_model_len + 21)[0]
    greedy = dict(temperature=0, max_tokens=4)
    alone = llm.generate([prompt[-12:]], SamplingParams(**greedy))[0]
    cut = llm.generate(prompt, SamplingParams(truncate_prompt_tokens=12, **greedy))[0]
    assert cut.prompt_token_ids == prompt[-12:]
    assert cut.prompt is None  # the prompt's text, had it one, no longer spells it
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = llm.generate(prompt[-40:], SamplingParams(truncate_prompt_tokens=-1, **greedy))[0]
    assert whole.prompt_token_ids == prompt[-40:]  # shorter than max_model_len: kept whole
    with pytest.raises(ValueError, match=r"from 1 to max_model_len \(96\), got 97"):
        llm.generate(prompt, SamplingParams(truncate_prompt_tokens=max_model_len + 1))
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.generate(prompt, SamplingParams(**greedy))  # no truncation asked: refused


def test_seeded_sampling_is_batch_independent(llm):
    prompt = {"prompt_token_ids": random_prompts(1, seed=6)[0]}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in random_prompts(7, seed=7)]
    batch = llm.generate(
        others[:3] + [prompt] + others[3:],
        [SamplingParams(temperature=0.7, max_tokens=12)] * 3
        + [seeded]
        + [SamplingParams(temperature=1.0, seed=9, max_tokens=12)] * 4,
    )
    assert batch[3].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=4321, max_tokens=12)
    assert llm.generate([prompt], other_seed)[0].outputs[0].token_ids != alone
    # n > 1 with a seed: distinct, reproducible samples.
    n3 = SamplingParams(temperature=1.0, seed=77, n=3, max_tokens=12)
    first = [c.token_ids for c in llm.generate([prompt], n3)[0].outputs]
    again = [c.token_ids for c in llm.generate([prompt], n3)[0].outputs]
    assert first == again and len({tuple(t) for t in first}) == 3


def test_64_bit_seeds_and_an_unseeded_request_sent_again(llm):
    """Seeds are 64-bit, as vLLM's: seeds equal in their low 32 bits sample differently.
    An unseeded request sent again, under the same request id too, samples afresh (its
    stream once came from the id alone)."""
    prompt = {"prompt_token_ids": random_prompts(1, seed=6)[0]}

    def seeded(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=12)
        return llm.generate([prompt], params)[0].outputs[0].token_ids

    assert seeded(1234 + 2**32) == seeded(1234 + 2**32) != seeded(1234)
    assert seeded(-1) != seeded(2**63 - 1)
    engine = llm.llm_engine

    def unseeded(req_id: str) -> tuple[int, ...]:
        engine.add_request(req_id, prompt, SamplingParams(temperature=1.0, max_tokens=12))
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        return tuple(finished[0].outputs[0].token_ids)

    assert len({unseeded("same-id") for _ in range(3)}) == 3


def test_varied_workload_compiles_nothing_after_warmup(llm):
    prompts = random_prompts(12, seed=8, low=1, high=90)
    params = [
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0.8, top_k=20, max_tokens=7, logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.5, min_p=0.05, max_tokens=3),
        SamplingParams(temperature=0.5, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=6),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=4, prompt_logprobs=1),
        SamplingParams(temperature=0, logit_bias={5: 100.0}, max_tokens=3),
        SamplingParams(temperature=0, min_tokens=4, max_tokens=6, stop_token_ids=[7]),
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=5),
    ]
    params = (params * 2)[: len(prompts)]
    outputs = llm.generate([{"prompt_token_ids": p[:90]} for p in prompts], params)
    assert len(outputs) == len(prompts)
    assert outputs[5].outputs[0].token_ids == [5, 5, 5]  # a +100 logit bias wins
    assert llm.engine_core.compiles_after_warmup() == 0
    assert llm.engine_core.num_free_blocks() == llm.engine_core.runner.num_blocks - 1


def test_compilation_cache_setting_is_left_to_research_code(checkpoint, tmp_path):
    """compilation_cache_dir=None leaves jax's process-wide persistent cache setting as the
    caller set it; a directory turns jengine's cache on there (in a fresh process, since
    jax keeps one setting per process; each case sets it as its caller would)."""
    code = """
import sys, jax
from jengine import LLM, SamplingParams
path, theirs, ours = sys.argv[1:]
for their_setting, our_setting in [(None, None), (theirs, None), (None, ours)]:
    jax.config.update("jax_compilation_cache_dir", their_setting)
    llm = LLM(path, compilation_cache_dir=our_setting, max_model_len=32, max_num_seqs=2,
              max_num_batched_tokens=16, block_size=16, dtype="float32", warmup=False)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    print("cache_dir:", jax.config.jax_compilation_cache_dir)
"""
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    result = subprocess.run(
        [sys.executable, "-c", code, checkpoint[0], theirs, ours],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reported = [line for line in result.stdout.splitlines() if line.startswith("cache_dir:")]
    assert reported == [
        "cache_dir: None",  # nobody asked for a cache: none
        f"cache_dir: {theirs}",  # the caller's own cache stays theirs
        f"cache_dir: {ours}",
    ]


def test_a_kernel_fallback_fails_the_equality_suite(checkpoint, tmp_path):
    """Without a C++ compiler (and nothing cached) the CPU kernel cannot build and the
    reference takes over with a warning; the suite's default setup must then refuse to run,
    not pass on the wrong attention."""
    env = dict(os.environ, CXX="no-such-compiler", JENGINE_KERNEL_CACHE=str(tmp_path))
    env.pop("JENGINE_ATTENTION_IMPL", None)
    code = (
        "import sys; from tests.engine.engine_helpers import make_llm; "
        "make_llm(sys.argv[1], 'default-bs16', warmup=False)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, checkpoint[0]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "attention fell back: default-bs16 expects cpu, got reference" in result.stderr
