"""LoRA adapters in the decoder (`models/lora.py`) against transformers + PEFT on
random-weight adapters the test builds (ranks 4, 8 and 16, different target modules,
lora_alpha other than the rank, one with rsLoRA): three adapters and the base model mixed
in one ragged paged batch of chunks and decodes, each sequence's logits within 1e-4 of
PEFT's for its own adapter; what jengine cannot apply is a ValueError naming it.
(The engine's `lora_request`, slots and server endpoints are issue 29's next steps.)"""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from flax import nnx

from jengine.models import load_model
from jengine.models.loader import model_from_params
from jengine.models.lora import param_names, read_peft_adapter
from tests.models.checkpoints import VOCAB, hf_logits, make_checkpoint
from tests.models.paged_batch import PagedSequences

ADAPTERS = {  # name: (rank, alpha, targets, rsLoRA)
    "attn-r4": (4, 8, ["q_proj", "v_proj"], False),
    "mlp-r8": (8, 4, ["gate_proj", "up_proj", "down_proj"], False),
    "all-r16": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], True),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_adapter(base_path: str, path: str, rank, alpha, targets, rslora, seed):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        init_lora_weights=False,  # random A and B: the adapter changes the outputs
    )
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # weights large enough to move the logits
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn_like(param))
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = str(root / "base")
    make_checkpoint("llama3", base, config_overrides=dict(num_key_value_heads=2))
    paths = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        _write_adapter(base, paths[name], *spec, seed=seed)
    return base, paths


def _model_with_slots(base, adapters):
    model = load_model(base, "float32")
    config = dataclasses.replace(
        model.config, lora_slots=len(adapters), lora_rank=16, lora_targets=TARGETS
    )
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    layers, rank = config.num_hidden_layers, config.lora_rank
    shapes = nnx.to_pure_dict(
        nnx.state(
            nnx.eval_shape(lambda: type(model)(config, dtype=model.dtype, rngs=nnx.Rngs(0))),
            nnx.Param,
        )
    )["layers"]
    for target in TARGETS:
        for name in param_names(target):
            params["layers"][name] = np.zeros(shapes[name].shape, np.float32)
    for slot, adapter in enumerate(adapters, start=1):
        for target, (a, b) in adapter.slot_arrays(rank).items():
            a_name, b_name = param_names(target)
            params["layers"][a_name][:, slot] = a
            params["layers"][b_name][:, slot] = b
    assert params["layers"][param_names("q_proj")[0]].shape[:2] == (layers, len(adapters) + 1)
    return model_from_params(type(model), config, params, model.dtype)


def test_adapters_mixed_in_one_batch_equal_peft(base_and_adapters):
    import peft
    import transformers

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
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    names = list(ADAPTERS)
    hf = peft.PeftModel.from_pretrained(hf, paths[names[0]], adapter_name=names[0])
    for name in names[1:]:
        hf.load_adapter(paths[name], adapter_name=name)
    hf.eval()
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
