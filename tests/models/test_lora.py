"""LoRA adapters in the decoder (`models/lora.py`) against transformers + PEFT on
random-weight adapters the test builds (ranks 4, 8 and 16, different target modules,
lora_alpha other than the rank, one with rsLoRA): three adapters and the base model mixed
in one ragged paged batch of chunks and decodes, each sequence's logits within 1e-4 of
PEFT's for its own adapter; what jengine cannot apply is a ValueError naming it.
(The engine's side: tests/engine/test_lora_engine.py.)"""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from flax import nnx

from jengine.models import load_model
from jengine.models.loader import model_from_params
from jengine.models.lora import param_names, read_peft_adapter, with_lora_slots
from tests.models.checkpoints import VOCAB, hf_logits, make_checkpoint
from tests.models.lora_files import ADAPTERS, peft_model, write_adapter, write_base_and_adapters
from tests.models.paged_batch import PagedSequences

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    return write_base_and_adapters(tmp_path_factory.mktemp("lora"))


def _model_with_slots(base, adapters):
    model = with_lora_slots(load_model(base, "float32"), len(adapters), rank=16)
    assert model.config.lora_targets == TARGETS
    layers = nnx.to_pure_dict(nnx.state(model, nnx.Param))["layers"]
    for slot, adapter in enumerate(adapters, start=1):
        for target, arrays in adapter.slot_arrays(16).items():
            for name, array in zip(param_names(target), arrays, strict=True):
                layers[name] = np.asarray(layers[name]).copy()
                layers[name][:, slot - 1] = array
    params = {**nnx.to_pure_dict(nnx.state(model, nnx.Param)), "layers": layers}
    assert layers[param_names("q_proj")[0]].shape[:2] == (3, len(adapters))
    return model_from_params(type(model), model.config, params, model.dtype)


def _assert_alone_in_a_slot_equals_peft(base, path, adapter, seed, length):
    """`adapter` (read from `path`) alone in a slot of rank 16, one sequence prefilled then
    decoded: logits within 1e-4 of PEFT's, which differ from the base model's."""
    model = _model_with_slots(base, [adapter])
    seq = np.random.default_rng(seed).integers(0, VOCAB, size=length).tolist()
    paged = PagedSequences(model, [seq], block_size=4)
    got = [paged.step({0: length - 1}, lora={0: 1})[0]]
    paged.sequences = [seq]
    got.append(paged.step({0: 1}, lora={0: 1})[0])
    hf = peft_model(base, {"adapter": path})
    expected = hf_logits(hf, seq).numpy()
    with hf.disable_adapter():
        assert np.abs(expected - hf_logits(hf, seq).numpy()).max() > 1e-2
    np.testing.assert_allclose(np.concatenate(got), expected, atol=1e-4, rtol=0)


def test_adapters_mixed_in_one_batch_equal_peft(base_and_adapters):
    base, paths = base_and_adapters
    config = load_model(base, "float32").config
    adapters = [read_peft_adapter(paths[name], config, name) for name in ADAPTERS]
    model = _model_with_slots(base, adapters)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, VOCAB, size=n).tolist() for n in (13, 9, 17, 6)]
    slot_of = {0: 1, 1: 2, 2: 3, 3: 0}  # the fourth sequence runs on the base model
    paged = PagedSequences(model, seqs, block_size=4)
    got = {i: [] for i in range(len(seqs))}
    for chunks in ({0: 5, 1: 9, 2: 7, 3: 6}, {0: 8, 2: 10}):
        for i, logits in paged.step(chunks, lora=slot_of).items():
            got[i].append(logits)
    longer = [s + [7] for s in seqs]
    paged.sequences = longer
    for i, logits in paged.step({i: 1 for i in range(4)}, lora=slot_of).items():
        got[i].append(logits)  # a decode step, every sequence on its own adapter
    names = list(ADAPTERS)
    hf = peft_model(base, paths)
    for i, seq in enumerate(longer):
        with hf.disable_adapter():
            base_logits = hf_logits(hf, seq).numpy()
        if slot_of[i]:
            hf.set_adapter(names[slot_of[i] - 1])
            expected = hf_logits(hf, seq).numpy()
            assert np.abs(expected - base_logits).max() > 1e-2  # the adapter mattered
        else:
            expected = base_logits
        np.testing.assert_allclose(np.concatenate(got[i]), expected, atol=1e-4, rtol=0)


def test_per_module_ranks_and_alphas_and_some_layers_equal_peft(base_and_adapters, tmp_path):
    """PEFT's rank_pattern and alpha_pattern (a module's own rank and alpha: its own scale)
    and layers_to_transform (the other layers untouched), alone in a slot of rank 16 and
    prefilled then decoded: within 1e-4 of PEFT. (alpha_pattern was once read as the
    global alpha: wrong logits, no error.)"""
    base, _ = base_and_adapters
    path = str(tmp_path / "patterns")
    write_adapter(
        base, path, 8, 8, ["q_proj", "v_proj", "down_proj"], False, seed=5,
        rank_pattern={"down_proj": 2, "layers.0.self_attn.q_proj": 4},
        alpha_pattern={"v_proj": 64}, layers_to_transform=[0, 2],
    )  # fmt: skip
    config = load_model(base, "float32").config
    adapter = read_peft_adapter(path, config)
    assert adapter.rank == 8 and not adapter.weights["v_proj"][1][1].any()  # layer 1: none
    _assert_alone_in_a_slot_equals_peft(base, path, adapter, seed=4, length=11)


def test_an_adapter_on_phi3s_fused_modules_equals_peft(tmp_path):
    """PEFT on Phi-3's fused qkv_proj and gate_up_proj (as its fine-tunes target them):
    each projection the loader splits them into gets the module's A and its own rows of B,
    within 1e-4 of PEFT prefilled then decoded; a B of the wrong size is named."""
    base, path = str(tmp_path / "phi3"), str(tmp_path / "fused")
    make_checkpoint("phi3", base)
    write_adapter(
        base, path, 4, 8, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], False, seed=6,
        alpha_pattern={"qkv_proj": 16},
    )  # fmt: skip
    config = load_model(base, "float32").config
    adapter = read_peft_adapter(path, config)
    assert sorted(adapter.weights) == sorted(TARGETS)
    _assert_alone_in_a_slot_equals_peft(base, path, adapter, seed=5, length=12)
    with pytest.raises(ValueError, match=r"qkv_proj.lora_B.weight is \[\d+, 4\]; this model's "
                       r"qkv_proj wants \[\d+, r\]"):  # fmt: skip
        read_peft_adapter(path, dataclasses.replace(config, num_key_value_heads=1))


def test_what_it_cannot_apply_is_named(base_and_adapters, tmp_path):
    base, paths = base_and_adapters
    config = load_model(base, "float32").config
    folder = tmp_path / "saved"
    shutil.copytree(paths["attn-r4"], folder)
    with open(folder / "adapter_config.json") as f:
        peft_config = json.load(f)
    peft_config["modules_to_save"] = ["lm_head"]
    with open(folder / "adapter_config.json", "w") as f:
        json.dump(peft_config, f)
    with pytest.raises(ValueError, match="modules_to_save is not supported"):
        read_peft_adapter(str(folder), config)
    adapter = read_peft_adapter(paths["all-r16"], config)
    with pytest.raises(ValueError, match="rank 16 > 8"):
        adapter.slot_arrays(8)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_peft_adapter(str(tmp_path), config)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json is not valid JSON"):
        read_peft_adapter(str(folder), config)
    shutil.copy(f"{paths['attn-r4']}/adapter_config.json", folder)
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:300])
    with pytest.raises(ValueError, match="adapter_model.safetensors is truncated"):
        read_peft_adapter(str(folder), config)
