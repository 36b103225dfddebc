"""Checkpoint folders in every form the loader promises, and clear errors for broken ones."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jengine.models import load_model
from tests.models.checkpoints import hf_logits, make_checkpoint
from tests.models.paged_batch import PagedSequences

SEQ = [5, 17, 200, 3, 99, 41, 8, 250, 1]


def _engine_logits(model):
    return PagedSequences(model, [SEQ]).step({0: len(SEQ)})[0]


def test_sharded_checkpoint_with_index(tmp_path):
    hf_model = make_checkpoint("qwen3", str(tmp_path), max_shard_size="100KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    logits = _engine_logits(load_model(str(tmp_path), dtype="float32"))
    np.testing.assert_allclose(logits, hf_logits(hf_model, SEQ).numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("saved_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_cast_to_f32(tmp_path, saved_dtype):
    make_checkpoint("llama3", str(tmp_path), torch_dtype=saved_dtype)
    # The oracle: transformers loading the same half-precision file, upcast to f32.
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32
    ).eval()
    model = load_model(str(tmp_path), dtype="float32")
    assert model.embed_tokens.value.dtype == jnp.float32
    np.testing.assert_allclose(
        _engine_logits(model), hf_logits(hf_model, SEQ).numpy(), atol=1e-4, rtol=0
    )


def test_bf16_compute_close_to_f32(tmp_path):
    make_checkpoint("llama2", str(tmp_path))
    f32 = _engine_logits(load_model(str(tmp_path), dtype="float32"))
    bf16_model = load_model(str(tmp_path), dtype="bfloat16")
    assert bf16_model.layers.q_proj.value.dtype == jnp.bfloat16
    bf16 = _engine_logits(bf16_model)
    assert np.abs(bf16 - f32).max() < 0.1 * np.abs(f32).max()


def test_mistral_sliding_window(tmp_path):
    hf_model = make_checkpoint("mistral", str(tmp_path), config_overrides=dict(sliding_window=4))
    model = load_model(str(tmp_path), dtype="float32")
    assert model.config.sliding_window == 4
    np.testing.assert_allclose(
        _engine_logits(model), hf_logits(hf_model, SEQ).numpy(), atol=1e-4, rtol=0
    )


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))


def test_the_models_llm_names_load_by_name():
    """`load_model` takes the names `LLM` takes (it called `shakespeare` no directory)."""
    from jengine.models.default import BUNDLED_MODEL_PATH

    by_name = load_model("shakespeare", "float32")
    assert by_name.config == load_model(BUNDLED_MODEL_PATH, "float32").config


def test_unsupported_architecture(tmp_path):
    make_checkpoint("llama2", str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture.*GPT2LMHeadModel"):
        load_model(str(tmp_path))
    # Nor is it taken for a base model ("GPT2LMHeadModel" ends in "Model"), which would send
    # its user to --runner pooling.
    from jengine.engine.arg_utils import EngineArgs

    EngineArgs(model=str(tmp_path)).create_engine_config()


def test_the_architectures_named_without_jax_are_the_registrys():
    from jengine.models.checkpoint import CAUSAL_LM_ARCHITECTURES
    from jengine.models.registry import supported_architectures

    assert sorted(CAUSAL_LM_ARCHITECTURES) == supported_architectures()


def test_malformed_folders(tmp_path):
    make_checkpoint("llama2", str(tmp_path / "ok"))
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "ok", broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(str(broken))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tmp_path / "ok" / "config.json", no_weights)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(str(no_weights))
    shallow = tmp_path / "shallow"
    shutil.copytree(tmp_path / "ok", shallow)
    config = json.loads((shallow / "config.json").read_text())
    config["num_hidden_layers"] = 5  # the weights hold 3 layers
    (shallow / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lacks .* for layers \\[3, 4\\]"):
        load_model(str(shallow))
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(str(tmp_path / "ok"), dtype="float8")


@pytest.mark.parametrize("kept", [0.6, 0.001, 0.0])
def test_a_truncated_weights_file_is_named(tmp_path, kept):
    """Cut in its data, in its header or to nothing: a ValueError naming the file (once a
    numpy reshape error, a bare JSONDecodeError, or an mmap error)."""
    make_checkpoint("llama2", str(tmp_path))
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * kept)])
    with pytest.raises(ValueError, match=f"{weights} is truncated"):
        load_model(str(tmp_path))
