"""compressed-tensors checkpoints (llm-compressor's W4A16 / W8A16 / FP8, what vLLM users
hold), written by the test from a random float checkpoint with the format's own rules
(tests/models/compressed_files.py):

- compressed-tensors' own decompression (the library, through transformers) reads the
  test's files as the test meant them: its (q - zero_point) * scale, rounded to the
  bfloat16 the library computes in;
- jengine dequantizes them to exactly that product, and keeps them quantized (int4 as
  4-bit, int8, fp8; in the checkpoint's own groups) generating what the dequantized
  weights generate: greedy tokens identical, logprobs within 1e-4, under batching,
  chunked prefill, prefix-cache hits and preemption, no compile after warmup;
- what the layout cannot hold (activation-ordered groups) is dequantized and logged;
  what jengine cannot read is a ValueError naming it.
"""

import json
import logging
import os

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jengine import LLM
from jengine.models import load_model
from jengine.models.llama import LINEAR_WEIGHTS
from tests.models.checkpoints import make_checkpoint
from tests.models.compressed_files import write_compressed
from tests.models.gguf_files import write_llama_gguf
from tests.models.test_quantized_models import TIGHT, _prompts, assert_generates_as_dequantized

# (writer's arguments, the format jengine keeps the weights in)
SCHEMES = {
    "W4A16-g128": (dict(bits=4, group_size=128), "int4-g128"),
    "W4A16-asym-g64": (dict(bits=4, group_size=64, symmetric=False), "int4-g64"),
    "W8A16-channel": (dict(bits=8, strategy="channel"), "int8-channel"),
    "W8A16-asym-int-quantized": (
        dict(bits=8, group_size=32, symmetric=False, fmt="int-quantized"),
        "int8-g32",
    ),
    "FP8-channel": (
        dict(kind="float", bits=8, strategy="channel", fmt="float-quantized"),
        "fp8-channel",
    ),
    "FP8-block": (dict(kind="float", bits=8, strategy="block", fmt="float-quantized"), "fp8-g128"),
}


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    """Rows of 256 and 512 inputs: whole groups of 128 and FP8's 128 x 128 blocks."""
    path = str(tmp_path_factory.mktemp("float"))
    overrides = dict(hidden_size=256, intermediate_size=512, num_key_value_heads=2)
    make_checkpoint("llama2", path, config_overrides=overrides)
    return path


def _write(float_folder, tmp_path, scheme: str):
    path = str(tmp_path / scheme)
    return path, write_compressed(float_folder, path, **SCHEMES[scheme][0])


def _layer_weights(model, name: str) -> np.ndarray:
    return np.asarray(nnx.state(model, nnx.Param)["layers"][name].value)


@pytest.mark.parametrize("scheme", ["W4A16-asym-g64", "W8A16-asym-int-quantized", "FP8-block"])
def test_the_library_reads_the_files_as_written(float_folder, tmp_path, scheme):
    import torch
    import transformers

    path, dequantized = _write(float_folder, tmp_path, scheme)
    config = transformers.CompressedTensorsConfig(run_compressed=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, dtype=torch.float32
    )
    state = hf.state_dict()
    for name, weight in dequantized.items():
        # The library multiplies in the scale's bfloat16: one rounding of the product.
        rounded = weight.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(state[name].float().numpy(), rounded, err_msg=name)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_dequantized_exactly_and_kept_in_the_checkpoints_groups(float_folder, tmp_path, scheme):
    path, dequantized = _write(float_folder, tmp_path, scheme)
    plain = load_model(path, "float32", quantization="none")
    for suffix, ours in [("self_attn.q_proj", "q_proj"), ("mlp.down_proj", "down_proj")]:
        expected = np.stack([dequantized[f"model.layers.{i}.{suffix}.weight"] for i in range(3)])
        np.testing.assert_array_equal(_layer_weights(plain, ours), expected)
    kept = load_model(path, "float32")
    formats = dict(kept.config.quantization)
    assert set(formats) == set(LINEAR_WEIGHTS)  # lm_head is in `ignore`: float
    assert {f.name for f in formats.values()} == {SCHEMES[scheme][1]}


# Through the engine: 4-bit with zero points in groups of 64 (two 32-input runs a group),
# and fp8 in blocks; every scheme's layout is checked at load above and by the kernel tests.
@pytest.mark.parametrize("scheme", ["W4A16-asym-g64", "FP8-block"])
def test_kept_quantized_generates_as_dequantized(float_folder, tmp_path, scheme):
    path, _ = _write(float_folder, tmp_path, scheme)
    prompts = _prompts()
    kept = LLM(path, **TIGHT)
    report = kept.engine_core.runner.weights_report()
    assert f"{SCHEMES[scheme][1]}: q_proj, k_proj" in report, report
    assert_generates_as_dequantized(kept, path, prompts)


def test_activation_ordered_groups_are_dequantized_and_logged(float_folder, tmp_path, caplog):
    path = str(tmp_path / "actorder")
    dequantized = write_compressed(float_folder, path, bits=4, group_size=32, actorder=True)
    with caplog.at_level(logging.INFO, logger="jengine.models.compressed_tensors"):
        model = load_model(path, "float32")
    assert model.config.quantization == ()
    assert "self_attn.q_proj dequantized to float32" in caplog.text
    expected = np.stack([dequantized[f"model.layers.{i}.mlp.up_proj.weight"] for i in range(3)])
    np.testing.assert_array_equal(_layer_weights(model, "up_proj"), expected)


def test_a_module_left_float_in_one_layer(float_folder, tmp_path, caplog):
    """llm-compressor's per-layer `ignore`: layer 0's q_proj float beside quantized ones
    (it failed to stack): that weight is float in every layer, the others stay kept."""
    path = str(tmp_path / "ignored")
    ignore = ("lm_head", "model.layers.0.self_attn.q_proj")
    dequantized = write_compressed(float_folder, path, bits=4, group_size=32, ignore=ignore)
    with caplog.at_level(logging.INFO, logger="jengine.models.compressed_tensors"):
        model = load_model(path, "float32")
    kept = dict(model.config.quantization)
    assert "q_proj" not in kept and "k_proj" in kept
    assert "self_attn.q_proj dequantized to float32 (some of its layers are not" in caplog.text
    float_q = load_model(float_folder, "float32")
    expected = [
        dequantized.get(
            f"model.layers.{i}.self_attn.q_proj.weight", _layer_weights(float_q, "q_proj")[i]
        )
        for i in range(3)
    ]
    np.testing.assert_array_equal(_layer_weights(model, "q_proj"), np.stack(expected))


def test_int8_requested_requantizes_and_the_flag_insists(float_folder, tmp_path):
    path, _ = _write(float_folder, tmp_path, "W4A16-g128")
    requantized = load_model(path, "float32", quantization="int8")
    assert {f.name for _, f in requantized.config.quantization} == {"int8"}
    assert dict(load_model(path, quantization="compressed-tensors").config.quantization)
    with pytest.raises(ValueError, match="has no such config"):
        load_model(float_folder, quantization="compressed-tensors")
    # ... and on a GGUF (it was dequantized in silence: 6x the weights' bytes).
    gguf = write_llama_gguf(float_folder, str(tmp_path / "model.gguf"), "Q8_0")
    with pytest.raises(ValueError, match="compressed-tensors: .* is a GGUF file"):
        load_model(gguf, quantization="compressed-tensors")


def test_quantized_activations_run_weight_only_and_say_so_once(float_folder, tmp_path, caplog):
    path, _ = _write(float_folder, tmp_path, "W4A16-g128")
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    activations = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = activations
    with open(config_path, "w") as f:
        json.dump(config, f)
    with caplog.at_level(logging.INFO, logger="jengine.models.compressed_tensors"):
        model = load_model(path, "float32")
    assert dict(model.config.quantization)  # the weights kept as written
    assert caplog.text.count("quantizes activations; jengine runs its weights") == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(format="nvfp4-pack-quantized"), "nvfp4-pack-quantized, int4. is not supported"),
        (dict(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity format"),
        (dict(config_groups={}), "no config group targets"),
        # Other methods' folders: their tensors named "not used" by the architecture.
        (dict(quant_method="gptq"), "quant_method 'gptq' is not supported: jengine reads"),
    ],
    ids=["nvfp4", "sparse", "untargeted", "gptq"],
)
def test_what_it_cannot_read_is_named(float_folder, tmp_path, change, message):
    path, _ = _write(float_folder, tmp_path, "W4A16-g128")
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"].update(change)
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=message):
        load_model(path)
