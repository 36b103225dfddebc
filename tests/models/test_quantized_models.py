"""Models with quantized weights, end to end through the engine on the CPU production path
(the quantized-matmul kernel in decode steps, its XLA reference in prefills):

- a GGUF kept quantized (Q8_0, Q4_0, Q4_1) generates what the same file dequantized to
  float32 generates, greedy tokens identical and logprobs within 1e-4, under batching,
  chunked prefill, prefix-cache hits and preemption;
- `--quantization int8` and `fp8` of random-weight checkpoints: perplexity within 1% of
  float32 (fp8-rtn: 2%), greedy agreement reported (and bounded below);
- `LLM(params=..., quantization="int8")` and `update_weights` with quantized params (no
  recompile after warmup)."""

import numpy as np
import pytest
from flax import nnx

from jengine import LLM, SamplingParams
from jengine.models import load_model
from jengine.models.llama import LINEAR_WEIGHTS
from jengine.models.quantized_linear import QuantizedLinear
from tests.engine.engine_helpers import random_prompts
from tests.models.checkpoints import make_checkpoint
from tests.models.gguf_files import write_llama_gguf

# Chunked prefill (16-token budget), prefix hits (a shared 20-token head), preemption
# (24 blocks of 4 tokens for 6 requests of up to ~70 tokens).
TIGHT = dict(
    dtype="float32",
    max_model_len=96,
    max_num_seqs=6,
    max_num_batched_tokens=16,
    block_size=16,
    num_gpu_blocks_override=14,
)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf"))
    make_checkpoint("llama2", path, config_overrides=dict(num_key_value_heads=2))
    return path


def _prompts() -> list[list[int]]:
    head = random_prompts(1, seed=7, low=20, high=21)[0]
    return [head + tail for tail in random_prompts(6, seed=8, low=3, high=40)]


def _generate(llm, prompts, max_tokens=16):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, ids)]
        for o, ids in zip(outputs, tokens)
    ]
    return tokens, logprobs, outputs


def assert_generates_as_dequantized(kept, path: str, prompts) -> None:
    """`kept` (a quantized engine under TIGHT) generates what the same checkpoint
    dequantized generates, with preemption, a prefix hit and no compile after warmup."""
    ours, our_logprobs, outputs = _generate(kept, prompts)
    assert kept.engine_core.num_preemptions > 0, "no preemption was forced"
    assert any(o.num_cached_tokens > 0 for o in outputs), "no prefix-cache hit"
    assert kept.engine_core.runner.compiles_after_warmup == 0
    theirs, their_logprobs, _ = _generate(LLM(path, quantization="none", **TIGHT), prompts)
    assert ours == theirs
    for a, b in zip(our_logprobs, their_logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def wide_hf_folder(tmp_path_factory):
    """Rows of 256 and 512 inputs: whole K-quant super-blocks."""
    path = str(tmp_path_factory.mktemp("hf-wide"))
    overrides = dict(hidden_size=256, intermediate_size=512, num_key_value_heads=2)
    make_checkpoint("llama2", path, config_overrides=overrides)
    return path


# llama.cpp's Q4_K_M: Q4_K, with some layers' v and down weights in Q6_K.
Q4_K_M = {"blk.0.attn_v.weight": "Q6_K", "blk.2.ffn_down.weight": "Q6_K"}


@pytest.mark.parametrize(
    "tensor_type", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"]
)
def test_gguf_kept_quantized_generates_as_dequantized(
    hf_folder, wide_hf_folder, tmp_path, tensor_type
):
    folder = wide_hf_folder if "_K" in tensor_type else hf_folder
    mixed = Q4_K_M if tensor_type == "Q4_K_M" else None
    path = write_llama_gguf(
        folder, str(tmp_path / "model.gguf"), tensor_type[:4], tensor_types=mixed
    )
    prompts = _prompts()
    kept = LLM(path, **TIGHT)
    assert set(LINEAR_WEIGHTS) <= set(dict(kept.engine_core.runner.config.quantization))
    report = kept.engine_core.runner.weights_report()
    assert f"{tensor_type[:4]}: " in report and "q_proj, k_proj" in report, report
    if mixed:  # one format holds both types of the mixed weights
        assert "Q4_K/Q6_K: v_proj, down_proj" in report, report
    assert "MiB saved hold" in report and "KV-cache tokens" in report, report
    assert_generates_as_dequantized(kept, path, prompts)


def _perplexity(llm, texts: list[list[int]]) -> float:
    """Over all tokens of `texts` but each one's first (prompt logprobs)."""
    outputs = llm.generate(
        [{"prompt_token_ids": tokens} for tokens in texts],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    logprobs = [
        entry[t].logprob
        for output, tokens in zip(outputs, texts, strict=True)
        for entry, t in zip(output.prompt_logprobs[1:], tokens[1:])
    ]
    return float(np.exp(-np.mean(logprobs)))


# Within 1% of float32: int8 (groups of 32); fp8 (e4m3 per row) by GPTQ's rounding, calibrated
# on the model's own samples. fp8 rounded to nearest (fp8-rtn) errs by ~2.6% (RMS, relative)
# on any weights and moved these small models by 1.2-1.6% (bench/README.md): bounded at 2%.
PERPLEXITY_BOUND = {"int8": 0.01, "fp8": 0.01, "fp8-rtn": 0.02}


@pytest.mark.parametrize("quantization", ["int8", "fp8", "fp8-rtn"])
@pytest.mark.parametrize("family", ["llama3", "qwen2"])  # tied head; q/k/v biases
def test_perplexity_near_float32(tmp_path, family, quantization):
    path = str(tmp_path / family)
    hf = make_checkpoint(family, path)
    # Text the model itself finds likely (its own greedy continuations), so perplexity is
    # far from the uniform one and a quantization error would show; 6 x 88 tokens (one
    # text of 68 moved by up to 1.9% either way: its own noise).
    prompts = random_prompts(6, seed=3, low=8, high=9)
    float_llm = LLM(path, **TIGHT)
    continuations = _generate(float_llm, prompts, max_tokens=80)[0]
    text = [prompt + tokens for prompt, tokens in zip(prompts, continuations, strict=True)]
    quantized_llm = LLM(path, quantization=quantization, **TIGHT)
    formats = dict(quantized_llm.engine_core.runner.config.quantization)
    assert {f.name for f in formats.values()} == {quantization.removesuffix("-rtn")}, formats
    ppl_float, ppl_quantized = _perplexity(float_llm, text), _perplexity(quantized_llm, text)
    assert abs(ppl_quantized / ppl_float - 1) < PERPLEXITY_BOUND[quantization], (
        ppl_quantized,
        ppl_float,
    )
    assert ppl_float < hf.config.vocab_size / 4  # not the uniform distribution
    prompts = _prompts()
    ours, _, _ = _generate(quantized_llm, prompts)
    theirs, _, _ = _generate(float_llm, prompts)
    agreement = np.mean([a == b for x, y in zip(ours, theirs) for a, b in zip(x, y)])
    print(
        f"{family}: {quantization} perplexity {ppl_quantized:.3f} vs float32 "
        f"{ppl_float:.3f}; greedy agreement {agreement:.1%}"
    )
    assert agreement > 0.5


def test_params_quantized_at_hand_over_and_swapped_without_recompiling(hf_folder):
    """Research code's float params quantized by `LLM(params=..., quantization="int8")`;
    `update_weights` takes quantized params of the same layout (a training loop's own)."""
    float_params = nnx.to_pure_dict(nnx.state(load_model(hf_folder, "float32"), nnx.Param))
    llm = LLM(hf_folder, params=float_params, quantization="int8", **TIGHT)
    assert isinstance(llm.engine_core.runner.graphdef, nnx.GraphDef)
    model = load_model(hf_folder, "float32", "int8")
    assert isinstance(model.layers.q_proj, QuantizedLinear)
    prompts = _prompts()
    before, _, _ = _generate(llm, prompts)
    assert before == _generate(LLM(hf_folder, quantization="int8", **TIGHT), prompts)[0]
    quantized = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    # Other weights of the same layout: the engine's outputs change, nothing compiles.
    doubled = dict(
        quantized["layers"]["down_proj"], scales=quantized["layers"]["down_proj"]["scales"] * 2
    )
    llm.update_weights({**quantized, "layers": {**quantized["layers"], "down_proj": doubled}})
    after, _, _ = _generate(llm, prompts)
    assert after != before
    assert llm.engine_core.runner.compiles_after_warmup == 0


def test_a_gguf_models_own_params_hand_over_as_they_are(hf_folder, tmp_path):
    """The README's research recipe on a GGUF: `load_model`'s tree (its weights still
    packed as the file has them) goes to `LLM(path, params=...)` (it was refused: the
    engine expected the float tree of the folder's config)."""
    path = write_llama_gguf(hf_folder, str(tmp_path / "model.gguf"), "Q4_1")
    params = nnx.state(load_model(path), nnx.Param)
    prompts = _prompts()
    given = _generate(LLM(path, params=params, **TIGHT), prompts)[0]
    assert given == _generate(LLM(path, **TIGHT), prompts)[0]
