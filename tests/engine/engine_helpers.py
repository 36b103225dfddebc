"""Shared by the offline engine tests: their engine shapes, the attention setups the
equality suite runs under, prompts (the every-feature batch the async-scheduling and
multi-step suites compare modes on), output comparisons and the HF oracle."""

import os

import jax
import numpy as np
import torch

from jengine import SamplingParams
from tests.models.checkpoints import VOCAB

# Small enough that warmup compiles few shapes (and the persistent XLA cache makes every
# engine after the first start quickly); chunked prefill is forced by the 32-token budget.
# The block size comes from the attention setup.
ENGINE_KWARGS = dict(max_model_len=96, max_num_seqs=8, max_num_batched_tokens=32, dtype="float32")

# For the tiny real-tokenizer model: a 24-token budget chunks the long prompts, 24 blocks of
# 16 tokens force preemption among 8 running requests.
TIGHT_ENGINE_ARGS = dict(
    dtype="float32",
    max_model_len=384,
    max_num_seqs=8,
    max_num_batched_tokens=24,
    block_size=16,
    num_gpu_blocks_override=25,
)


def _default_attention() -> str:
    """What serves by default here: the backend's kernel (the fused C++ kernel on CPU)."""
    forced = os.environ.get("JENGINE_ATTENTION_IMPL")
    return forced or {"cpu": "cpu", "gpu": "gpu", "tpu": "tpu"}[jax.default_backend()]


# The equality suite runs under both: the engine's default attention at the default block
# size 16 (the production path: the CPU kernel on this machine), and block size 4, which the
# CPU kernel refuses, so the XLA reference serves. Each names the attention it must get.
ATTENTION_SETUPS = {
    "default-bs16": dict(block_size=16, expected_attention=_default_attention()),
    "reference-bs4": dict(block_size=4, expected_attention="reference"),
}


def make_llm(path: str, setup: str, **kwargs):
    """An LLM over `path` in one of ATTENTION_SETUPS; fails if another attention resolved
    (e.g. the CPU kernel did not build and the reference silently took over)."""
    from jengine import LLM

    block_size = ATTENTION_SETUPS[setup]["block_size"]
    expected = ATTENTION_SETUPS[setup]["expected_attention"]
    llm = LLM(path, **{**ENGINE_KWARGS, "block_size": block_size, **kwargs})
    resolved = llm.engine_core.runner.attention_impl
    if resolved != expected:
        raise AssertionError(f"attention fell back: {setup} expects {expected}, got {resolved}")
    return llm


def random_prompts(n: int, seed: int = 0, low: int = 3, high: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(k)).tolist() for k in rng.integers(low, high, size=n)]


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    return hf_greedy_logprobs(hf_model, prompt, max_new_tokens)[0]


def hf_greedy_logprobs(
    hf_model, prompt: list[int], max_new_tokens: int, min_new_tokens: int = 0
) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and the logprob of each chosen token."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(logits[0].float(), -1)[token].item()
        for logits, token in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def hf_teacher_forced(
    hf_model, prompt: list[int], tokens: list[int]
) -> tuple[list[int], list[float]]:
    """transformers' argmax after each prefix of `tokens` and the logprob of each token, in
    one forward pass over prompt + tokens. Where the argmaxes are `tokens`, they are what
    transformers' greedy decoding gives (each step's input is the one before's argmax),
    at the cost of one pass instead of one per token."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    logprobs = torch.log_softmax(logits.float(), -1)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    return logprobs.argmax(-1).tolist(), chosen.tolist()


def completions(output) -> tuple[list, list]:
    """What a request sees of its completions: (tokens, text, finish and stop reasons of
    each), and its logprob rows (each completion's, then the prompt's) as {token: value}."""
    seen = [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in output.outputs]
    rows = [row for c in output.outputs for row in c.logprobs or []]
    rows += [row for row in output.prompt_logprobs or [] if row is not None]
    return seen, [{t: lp.logprob for t, lp in row.items()} for row in rows]


# Async scheduling and multi-step decoding admit and retire requests at other steps, so a
# token may be computed in a step of another shape (row or page bucket, kernel or GEMM): a
# few float32 ulps apart.
LOGPROB_TOLERANCE = 1e-5


def assert_same_outputs(got: list, expected: list, how: str) -> None:
    """The RequestOutputs `got` are what a user sees in `expected`: the same completions,
    and logprobs within LOGPROB_TOLERANCE. `how`: what differs, for the message."""
    for i, (output, reference) in enumerate(zip(got, expected, strict=True)):
        (seen, rows), (seen_expected, rows_expected) = completions(output), completions(reference)
        assert seen == seen_expected, f"request {i} differs {how}"
        if output.prompt_logprobs is not None:  # one row per prompt token, the first None
            assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
        assert len(rows) == len(rows_expected)
        for row, row_expected in zip(rows, rows_expected):
            assert row.keys() == row_expected.keys(), f"request {i}: other top logprobs {how}"
            for token, value in row.items():
                assert abs(value - row_expected[token]) <= LOGPROB_TOLERANCE, (i, token, how)


def every_feature_batch(seed: int) -> tuple[list[str], list]:
    """16 text prompts (chunked when long; every other one behind a shared 40-word prefix:
    prefix-cache hits) with every sampling feature among their params: greedy with logprobs
    and prompt logprobs, top-p/k, min-p, seeds, penalties, logit bias, min_tokens, n = 2 and
    a request that ends with its first token. On a tight engine (TIGHT_ENGINE_ARGS) they
    also preempt. max_tokens are mostly no multiple of 4 (multi-step decoding's K)."""
    rng = np.random.default_rng(seed)
    words = ["the", "of", "and", "a", "to", "in", "is", "was", "for", "on", "that", "with",
             "as", "by", "at"]  # fmt: skip
    prefix = " ".join(rng.choice(words, 40))
    prompts = [
        (prefix if i % 2 else "") + " ".join(rng.choice(words, int(rng.integers(3, 70))))
        for i in range(16)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=41, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=11, max_tokens=48),
        SamplingParams(temperature=0.8, min_p=0.05, seed=12, max_tokens=33, logprobs=1),
        SamplingParams(
            temperature=0.7,
            seed=13,
            presence_penalty=0.6,
            frequency_penalty=0.4,
            repetition_penalty=1.2,
            max_tokens=45,
        ),
        SamplingParams(temperature=0, logit_bias={40: 4.0, 41: -100.0}, max_tokens=30),
        SamplingParams(temperature=1.0, seed=14, min_tokens=21, max_tokens=30),
        SamplingParams(temperature=1.0, seed=15, n=2, max_tokens=38),
        SamplingParams(temperature=0, max_tokens=1),  # ends with its first token
    ]
    return prompts, (params * 2)[: len(prompts)]


def assert_engines_clean(engines: dict) -> None:
    """Every engine of `engines` ({name: LLM}) is idle, leaked no block and compiled
    nothing after warmup."""
    for llm in engines.values():
        core = llm.engine_core
        assert not core.has_unfinished_requests()
        assert core.num_free_blocks() == core.runner.num_blocks - 1  # nothing leaked
        assert core.compiles_after_warmup() == 0
