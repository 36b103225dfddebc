"""Embedding engines (`runner="pooling"`) against transformers: the hidden states
transformers returns (`last_hidden_state`, after the final norm), pooled last-token, mean
or first-token and normalised by hand, equal the engine's embeddings within 1e-5 (f32) for
random Llama 3 and Qwen3 checkpoints, batched under chunked prefill (a 16-token budget),
preemption and prefix-cache hits, with async scheduling on and off; no compile after
warmup. Then what a request or a checkpoint may ask for: normalize, dimensions
(matryoshka), sentence-transformers pooling configs, and the clear errors for what is not
served."""

import json

import numpy as np
import pytest
import torch

from jengine import LLM, PoolingParams, SamplingParams
from jengine.engine.arg_utils import EngineArgs
from jengine.pooling import PoolerConfig
from tests.engine.engine_helpers import random_prompts
from tests.models.checkpoints import make_checkpoint

TIGHT = dict(
    dtype="float32",
    max_model_len=96,
    max_num_seqs=6,
    max_num_batched_tokens=16,
    block_size=16,
    num_gpu_blocks_override=7,
    # Several prompts prefill side by side, each holding part-filled blocks: preemption.
    long_prefill_token_threshold=6,
)


def hf_pooled(hf_model, prompt: list[int], pooling_type: str) -> np.ndarray:
    """transformers' final hidden states of `prompt`, pooled (not normalised)."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0].double()
    pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
    return pooled.numpy()


def normalized(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return str(path), make_checkpoint(request.param, str(path))


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embeddings_equal_transformers_pooled(checkpoint, pooling_type):
    path, hf_model = checkpoint
    head = random_prompts(1, seed=3, low=20, high=21)[0]
    prompts = [head + tail for tail in random_prompts(7, seed=4, low=1, high=60)]
    prompts.append(random_prompts(1, seed=5, low=96, high=97)[0])  # max_model_len long
    expected = [hf_pooled(hf_model, p, pooling_type) for p in prompts]
    for async_scheduling in (True, False):
        llm = LLM(
            path,
            runner="pooling",
            pooler_config={"pooling_type": pooling_type},
            async_scheduling=async_scheduling,
            **TIGHT,
        )
        core = llm.engine_core
        outputs = llm.embed(prompts, use_tqdm=False)
        assert core.num_preemptions > 0, "no preemption was forced"
        for prompt, output, want in zip(prompts, outputs, expected, strict=True):
            assert output.prompt_token_ids == prompt
            np.testing.assert_allclose(
                output.outputs.embedding, normalized(want), atol=1e-5, rtol=0
            )
        raw = llm.embed(prompts[:3], PoolingParams(normalize=False), use_tqdm=False)
        for output, want in zip(raw, expected[:3], strict=True):
            np.testing.assert_allclose(output.outputs.embedding, want, atol=1e-5, rtol=1e-5)
        if pooling_type == "LAST":  # prefix caching applies: the same prompts again hit
            again = llm.embed(prompts, use_tqdm=False)
            assert all(o.num_cached_tokens > 0 for o in again[:-1])
            for output, want in zip(again, expected, strict=True):
                np.testing.assert_allclose(
                    output.outputs.embedding, normalized(want), atol=1e-5, rtol=0
                )
        else:  # MEAN and CLS read every prompt token: the engine keeps no prefix cache
            assert not core.scheduler.kv_cache_manager.enable_caching
        assert core.runner.compiles_after_warmup == 0
        assert core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == (
            TIGHT["num_gpu_blocks_override"] - 1
        ), "blocks leaked"
        del llm


def test_an_embedding_engine_generates_nothing_and_a_generating_one_embeds_nothing(
    checkpoint,
):
    path, _ = checkpoint
    embedder = LLM(path, runner="pooling", **TIGHT)
    with pytest.raises(ValueError, match="runner pooling: it embeds"):
        embedder.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="matryoshka"):
        embedder.embed([[1, 2, 3]], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="prompt is empty"):
        embedder.embed([[]])
    assert embedder.embed([[1, 2, 3]], use_tqdm=False)[0].outputs.hidden_size == 64
    # vLLM's truncate_prompt_tokens: the last k tokens are what is embedded.
    long = random_prompts(1, seed=6, low=120, high=121)[0]  # over max_model_len (96)
    tail = embedder.embed([long[-9:]], use_tqdm=False)[0].outputs.embedding
    for cut in (
        embedder.embed([long], truncate_prompt_tokens=9, use_tqdm=False)[0],
        embedder.embed([long], PoolingParams(truncate_prompt_tokens=9), use_tqdm=False)[0],
    ):
        assert cut.prompt_token_ids == long[-9:]
        np.testing.assert_allclose(cut.outputs.embedding, tail, atol=1e-6, rtol=0)
    del embedder
    generator = LLM(path, **TIGHT)
    with pytest.raises(ValueError, match="--runner pooling"):
        generator.embed([[1, 2, 3]])


def test_dimensions_of_a_matryoshka_model_truncate_then_normalise(tmp_path):
    hf_model = make_checkpoint("llama3", str(tmp_path), config_overrides={"is_matryoshka": True})
    prompt = random_prompts(1, seed=9, low=30, high=31)[0]
    llm = LLM(str(tmp_path), runner="pooling", **TIGHT)
    full = hf_pooled(hf_model, prompt, "LAST")
    for dimensions in (1, 16, 64):
        (output,) = llm.embed([prompt], PoolingParams(dimensions=dimensions), use_tqdm=False)
        want = normalized(full[:dimensions])
        np.testing.assert_allclose(output.outputs.embedding, want, atol=1e-5, rtol=0)
    for bad in (0, 65):
        with pytest.raises(ValueError, match=r"dimensions must be in \[1, 64\]"):
            llm.embed([prompt], PoolingParams(dimensions=bad))


def _sentence_transformers_files(path, pooling: dict, normalize: bool, extra=()) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    modules.append(
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    )
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    modules += list(extra)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **pooling})
    )


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_a_base_model_checkpoint_embeds_and_cannot_generate(tmp_path, family):
    """Embedding checkpoints are saved as the family's base model (`LlamaModel`,
    `Qwen3Model`: no "model." prefix, no LM head)."""
    hf_model = make_checkpoint(family, str(tmp_path / "causal"))
    hf_model.model.save_pretrained(str(tmp_path / "base"))
    prompts = random_prompts(3, seed=13, low=5, high=50)
    llm = LLM(str(tmp_path / "base"), runner="pooling", **TIGHT)
    for prompt, output in zip(prompts, llm.embed(prompts, use_tqdm=False), strict=True):
        want = normalized(hf_pooled(hf_model, prompt, "LAST"))
        np.testing.assert_allclose(output.outputs.embedding, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="base model without an LM head"):
        LLM(str(tmp_path / "base"), **TIGHT)


def test_a_sentence_transformers_config_says_how_to_pool(tmp_path):
    hf_config = {"hidden_size": 64}
    assert PoolerConfig.from_checkpoint(str(tmp_path), hf_config) == PoolerConfig(
        "LAST", True, None, 64
    )
    _sentence_transformers_files(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=False)
    assert PoolerConfig.from_checkpoint(str(tmp_path), hf_config) == PoolerConfig(
        "MEAN", False, None, 64
    )
    _sentence_transformers_files(tmp_path, {"pooling_mode_lasttoken": True}, normalize=True)
    config = PoolerConfig.from_checkpoint(
        str(tmp_path), {**hf_config, "matryoshka_dimensions": [32, 16]}, '{"normalize": false}'
    )
    assert config == PoolerConfig("LAST", False, (16, 32), 64)
    with pytest.raises(ValueError, match="must be one of"):
        PoolingParams(dimensions=8).verified(config)
    # sentence-transformers 6 writes the mode as one string.
    _sentence_transformers_files(tmp_path, {"pooling_mode": "cls"}, normalize=False)
    assert PoolerConfig.from_checkpoint(str(tmp_path), hf_config).pooling_type == "CLS"
    for refused in ({"pooling_mode_max_tokens": True}, {"pooling_mode": "weightedmean"}):
        _sentence_transformers_files(tmp_path, refused, normalize=True)
        with pytest.raises(
            ValueError, match=r"this Pooling module asks for \['(max_tokens|weightedmean)'\]"
        ):
            PoolerConfig.from_checkpoint(str(tmp_path), hf_config)
    without_prompt = {"pooling_mode": "mean", "include_prompt": False}
    _sentence_transformers_files(tmp_path, without_prompt, normalize=True)
    with pytest.raises(ValueError, match="include_prompt"):
        PoolerConfig.from_checkpoint(str(tmp_path), hf_config)
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    _sentence_transformers_files(
        tmp_path, {"pooling_mode_cls_token": True}, normalize=True, extra=[dense]
    )
    with pytest.raises(ValueError, match="Dense"):
        PoolerConfig.from_checkpoint(str(tmp_path), hf_config)
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        PoolerConfig.from_checkpoint(None, hf_config, {"pooling_type": "max"})
    # A string is no switch ("false" once normalized: a non-empty string is truthy).
    with pytest.raises(ValueError, match="normalize must be true or false, got 'false'"):
        PoolerConfig.from_checkpoint(None, hf_config, '{"normalize": "false"}')


def test_the_engine_pools_as_the_checkpoint_says(tmp_path):
    hf_model = make_checkpoint("qwen3", str(tmp_path))
    _sentence_transformers_files(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=False)
    prompt = random_prompts(1, seed=11, low=40, high=41)[0]
    llm = LLM(str(tmp_path), runner="pooling", **TIGHT)
    (output,) = llm.embed([prompt], use_tqdm=False)
    want = hf_pooled(hf_model, prompt, "MEAN")
    np.testing.assert_allclose(output.outputs.embedding, want, atol=1e-5, rtol=1e-5)


def test_sentence_bert_config_caps_what_is_embedded(tmp_path):
    """sentence-transformers embeds at most `max_seq_length` tokens: max_model_len is
    capped there, as vLLM's (a longer input was embedded whole, another vector than
    sentence-transformers', with no error); lowercasing inputs is refused by name."""
    make_checkpoint("llama3", str(tmp_path))
    _sentence_transformers_files(tmp_path, {"pooling_mode_lasttoken": True}, normalize=True)
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 16}')
    args = dict(model=str(tmp_path), runner="pooling")
    assert EngineArgs(**args).create_engine_config().model.max_model_len == 16
    with pytest.raises(ValueError, match="longer than the embedding model's max_seq_length"):
        EngineArgs(**args, max_model_len=32).create_engine_config()
    (tmp_path / "sentence_bert_config.json").write_text('{"do_lower_case": true}')
    with pytest.raises(ValueError, match="do_lower_case"):
        EngineArgs(**args).create_engine_config()
