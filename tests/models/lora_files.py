"""PEFT LoRA adapters with random weights, written by PEFT itself as a user's fine-tune
would be, over a random-weight base checkpoint: the oracle's files for the LoRA tests
(tests/models/test_lora.py, tests/engine/test_lora_engine.py, tests/runner/tp_check.py).

`ADAPTERS` differ in rank (4, 8, 16), targets (attention, MLP, most of both) and scaling
(lora_alpha other than the rank; one with rsLoRA)."""

import torch

from tests.models.checkpoints import make_checkpoint

ADAPTERS = {  # name: (rank, alpha, targets, rsLoRA)
    "attn-r4": (4, 8, ["q_proj", "v_proj"], False),
    "mlp-r8": (8, 4, ["gate_proj", "up_proj", "down_proj"], False),
    "all-r16": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], True),
}


def write_adapter(
    base_path: str, path: str, rank, alpha, targets, rslora, seed, **lora_config
) -> None:
    """`lora_config`: more of PEFT's LoraConfig (rank_pattern, alpha_pattern, ...)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        init_lora_weights=False,  # random A and B: the adapter changes the outputs
        **lora_config,
    )
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # weights large enough to move the logits
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(path)


def write_base_and_adapters(root) -> tuple[str, dict[str, str]]:
    """A Llama-3 base (2 KV heads) under `root`/base and every adapter of ADAPTERS beside
    it; returns (base path, name -> adapter path)."""
    base = str(root / "base")
    make_checkpoint("llama3", base, config_overrides=dict(num_key_value_heads=2))
    paths = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        write_adapter(base, paths[name], *spec, seed=seed)
    return base, paths


def peft_model(base: str, paths: dict[str, str]):
    """transformers + PEFT with every adapter of `paths` loaded (select one with
    `set_adapter(name)`, none with `disable_adapter()`)."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    names = list(paths)
    hf = peft.PeftModel.from_pretrained(hf, paths[names[0]], adapter_name=names[0])
    for name in names[1:]:
        hf.load_adapter(paths[name], adapter_name=name)
    return hf.eval()
