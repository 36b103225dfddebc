"""Tensor parallelism over 4 forced CPU devices (a subprocess: the device count is fixed
when jax starts): sizes 1, 2 and 4 give the same greedy tokens and logprobs within 1e-4 of
each other and of transformers, for Llama and Qwen3 configurations with 2 KV heads (fewer
than 4 devices: repeated), the Qwen3 one with a 417-token vocabulary (odd, as checkpoints
with added tokens have: padded to 418 and 420, no padded id ever sampled or reported),
with chunked prefill, prefix hits and preemption in the mix; at
TP=4 every split weight and the KV cache are split (no device holds all of one) and the
attention kernel runs inside `shard_map`; `update_weights` takes the checkpoint's layout."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jengine.runner.sharding import TensorParallel
from tests.engine.engine_helpers import hf_greedy_logprobs
from tests.models.checkpoints import make_checkpoint
from tests.models.gguf_files import write_llama_gguf
from tests.models.lora_files import write_base_and_adapters
from tests.runner.tp_check import MAX_TOKENS, PROMPTS

# family -> its vocabulary: 417 divides by neither 2 nor 4.
FAMILIES = {"llama3": 256, "qwen3": 417}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"tp-{request.param}"))
    overrides = dict(num_key_value_heads=2, vocab_size=FAMILIES[request.param])
    hf_model = make_checkpoint(request.param, path, config_overrides=overrides)
    return path, hf_model


def _tp_check(*args: str) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.runner.tp_check", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_runs_agree(results: dict, keys=("2", "4")) -> None:
    """Each run of `keys` gives run "1"'s tokens, logprobs within 1e-4, and compiled
    nothing after warmup."""
    one = results["1"]
    for key in keys:
        run = results[key]
        assert run["tokens"] == one["tokens"], key
        for ours, theirs in zip(run["logprobs"], one["logprobs"], strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
        assert run["compiles_after_warmup"] == 0, key


@pytest.fixture(scope="module")
def results(checkpoint):
    return _tp_check(checkpoint[0])


def test_sizes_agree_with_each_other_and_transformers(checkpoint, results):
    one = results["1"]
    for tp in ("2", "4"):
        assert results[tp]["tokens"] == one["tokens"], tp
        for ours, theirs in zip(results[tp]["logprobs"], one["logprobs"], strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    # Multi-step decoding (4 steps a launch) under TP=2: the same again.
    _assert_runs_agree(results, keys=("2, multi-step",))
    assert results["2, multi-step"]["multi_step_decodes"] > 0
    for tp in ("1", "2", "4"):
        run = results[tp]
        assert run["attention"] == "cpu" and run["compiles_after_warmup"] == 0
        assert run["preemptions"] > 0, f"TP={tp}: no preemption was forced"
        assert run["largest_logprob_id"] < checkpoint[1].config.vocab_size
        assert run["cached_tokens"][3] >= 32, f"TP={tp}: no prefix hit"
    for prompt, tokens, logprobs in zip(PROMPTS, one["tokens"], one["logprobs"], strict=True):
        hf_tokens, hf_logprobs = hf_greedy_logprobs(checkpoint[1], prompt, MAX_TOKENS, MAX_TOKENS)
        assert tokens[: len(hf_tokens)] == hf_tokens
        np.testing.assert_allclose(logprobs, hf_logprobs, atol=1e-4, rtol=0)


def test_update_weights_takes_the_checkpoints_layout(results):
    """The caller's params have 2 KV heads; the TP=4 engine repeats them, compiles nothing.
    A weight of another shape is named with the checkpoint's shape (the engine's repeated
    or padded one was named, which the caller never held)."""
    assert results["updated_tokens"] == results["1"]["tokens"]
    assert results["compiles_after_update"] == 0
    assert set(results["refused"]) == {"layers.k_proj", "embed_tokens"}
    for name, (shape, error) in results["refused"].items():
        assert f"param {name} has shape" in error and f"expected {shape}" in error, error


def test_params_on_a_users_mesh(results):
    """LLM(params=, mesh=) on a 2 x 2 training mesh: TP=4 there, the tokens of TP=1;
    update_weights reshards other weights without a host transfer or a compile, and copies
    weights in the engine's own layout on the devices (no buffer shared with the caller)."""
    mesh = results["mesh"]
    assert mesh["tp"] == 4 and mesh["same_devices"]
    assert mesh["first"] == results["1"]["tokens"]
    assert mesh["second"] == mesh["other_reference"] != mesh["first"]
    assert mesh["shares_no_buffer"]
    assert mesh["compiles_after_warmup"] == 0


def test_weights_and_cache_are_split_and_attention_runs_per_shard(checkpoint, results):
    layout = results["layout"]
    assert layout["num_devices"] == 4
    assert "iB on each of 4 devices" in layout["capacity_report"]  # capacity is per device
    vocab = checkpoint[1].config.vocab_size
    assert layout["embedding_rows"] == -(-vocab // 4) * 4  # padded to a multiple of 4
    # The cache holds one of the 4 (repeated) KV heads per device.
    assert layout["cache_shape"][2] == 4 and layout["cache_shard"][2] == 1
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert any(name in split for split in layout["split"]), name
    assert any("embed_tokens" in split for split in layout["split"])
    # Only norms (and Qwen3's q/k norms) are whole on every device.
    assert all("norm" in name for name in layout["whole"]), layout["whole"]
    assert 0 <= layout["manual_computation_at"] < layout["custom_call_at"]


def test_the_step_sends_activations_and_logits_only(checkpoint, results):
    """What crosses devices in the TP=4 step: per layer two all-reduces of the [T, D]
    activations (after o_proj and down_proj), one for the embedding, and the [S, V]
    logits gathered once (by the head) (a padded vocabulary's, then cut); never a weight."""
    config = checkpoint[1].config
    tokens, reqs = results["layout"]["step_shape"]
    hidden, vocab = config.hidden_size, results["layout"]["embedding_rows"]
    per_step = {}
    for collective in results["layout"]["collectives"]:
        key = (collective["kind"], tuple(collective["shape"]))
        per_step[key] = per_step.get(key, 0) + collective["times_per_step"]
    assert per_step == {
        ("all-reduce", (tokens, hidden)): 2 * config.num_hidden_layers + 1,
        ("all-gather", (reqs, vocab)): 1,
    }


def test_sizes_that_cannot_work_are_refused(checkpoint):
    from jengine.models import load_model

    config = load_model(checkpoint[0], "float32").config
    with pytest.raises(ValueError, match=r"needs 4 devices; 1 cpu device\(s\) are present"):
        TensorParallel.create(4, config)  # this process has one CPU device
    with pytest.raises(ValueError, match="does not divide"):
        TensorParallel.create(3, config)


def test_experts_split_or_spread_give_the_same_outputs(tmp_path):
    """Mixture of experts (Qwen2-MoE: routed experts and a shared one) on 4 forced CPU
    devices, whole experts spread (expert parallel: one of the 4 a device) and each
    expert's features split (tensor parallel; the shared expert split either way): the
    tokens of one device, logprobs within 1e-4, preemption, nothing compiled after warmup."""
    path = str(tmp_path / "qwen2-moe")
    make_checkpoint("qwen2-moe", path, config_overrides=dict(num_key_value_heads=2))
    results = _tp_check(path, "experts")
    _assert_runs_agree(results, ("tp4", "ep4"))
    assert all(results[key]["preemptions"] > 0 for key in ("tp4", "ep4"))
    # [L, E, F, D] per device: experts whole (E / n) or each expert's features split (F / n).
    layers, num_experts, width = 3, 4, 48
    assert results["ep4"]["expert_gate_shard"][:3] == [layers, num_experts // 4, width]
    assert results["tp4"]["expert_gate_shard"][:3] == [layers, num_experts, width // 4]


@pytest.mark.parametrize("quantization", ["Q4_1", "fp8"])
def test_quantized_weights_give_the_same_outputs_at_every_size(tmp_path, quantization):
    """GGUF Q4_1 kept quantized (row-parallel weights of 2 groups: split at TP=2, where
    groups stay whole, and at TP=4 through XLA's resharding), fp8 per channel (its
    scales of row-parallel weights whole on every device; int8's layout is the same)."""
    path = str(tmp_path / "hf")
    make_checkpoint("llama3", path, config_overrides=dict(num_key_value_heads=2))
    if quantization == "fp8":
        results = _tp_check(path, "fp8")
    else:
        gguf = write_llama_gguf(path, str(tmp_path / "model.gguf"), quantization)
        results = _tp_check(gguf, "gguf")
    _assert_runs_agree(results)
    # The KV-cache tokens the weights' saving holds: each device saves its share and holds
    # its share of each token (it was the figure times the devices).
    assert results["2"]["saving_holds"] == results["1"]["saving_holds"] > 0
    split = results["split"]
    for name in ("q_proj", "gate_proj", "o_proj", "down_proj"):
        assert any(f"'{name}']['values']" in leaf for leaf in split), (name, split)
    assert any("'q_proj']['scales']" in leaf for leaf in split)


def test_lora_adapters_give_the_same_outputs_at_every_size(tmp_path):
    """Two PEFT adapters (ranks 4 and 16, attention and MLP targets) and the base model in
    one batch at sizes 1, 2 and 4: each adapter split as its base weights are (B's
    outputs of a column-parallel projection, A's inputs of a row-parallel one), at 4 its
    k/v B repeated with the KV heads."""
    base, paths = write_base_and_adapters(tmp_path)
    results = _tp_check(base, "lora", paths["attn-r4"], paths["all-r16"])
    _assert_runs_agree(results)
    assert all(results[tp]["cached_tokens"][3] > 0 for tp in ("2", "4"))  # the adapter's hit
