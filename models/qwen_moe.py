"""Qwen2-MoE and Qwen3-MoE: Qwen2's / Qwen3's attention with a mixture-of-experts
feed-forward (`models/moe.py`), Qwen2-MoE's with its shared expert.

Where it sits: `models/registry.py` maps `Qwen2MoeForCausalLM` and `Qwen3MoeForCausalLM`
here. Experts are `mlp.experts.<e>.{gate,up,down}_proj`, the router `mlp.gate`, the
shared expert `mlp.shared_expert.*` and its gate `mlp.shared_expert_gate`; top-k weights
are renormalised where `norm_topk_prob` says. Every layer must be sparse: a config with
`mlp_only_layers` or a `decoder_sparse_step` other than 1 is refused by name.
"""

from dataclasses import dataclass, replace
from typing import ClassVar

from jengine.models.decoder import HF_LAYER_NAMES, DecoderForCausalLM
from jengine.models.llama import LlamaConfig

_BASE_TYPES = {"qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}


def _qwen_moe_layer_names() -> dict[str, str]:
    names = {k: v for k, v in HF_LAYER_NAMES.items() if not k.startswith("mlp.")}
    names["mlp.gate.weight"] = "router"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names[f"mlp.shared_expert.{proj}.weight"] = f"shared_{proj}"
    names["mlp.shared_expert_gate.weight"] = "shared_expert_gate"
    return names


class QwenMoeForCausalLM(DecoderForCausalLM):
    """Qwen2-MoE / Qwen3-MoE on the shared decoder (its own name in logs)."""


@dataclass(frozen=True)
class QwenMoeConfig(LlamaConfig):
    """A Qwen2-MoE / Qwen3-MoE architecture: its base family's reading plus its experts."""

    hf_layer_names: ClassVar[dict[str, str]] = _qwen_moe_layer_names()
    hf_expert_names: ClassVar[dict[str, str]] = {
        "gate_proj": "expert_gate",
        "up_proj": "expert_up",
        "down_proj": "expert_down",
    }

    @classmethod
    def from_hf(cls, hf: dict) -> "QwenMoeConfig":
        model_type = hf.get("model_type")
        if model_type not in _BASE_TYPES:
            raise ValueError(f"Qwen MoE model_type {model_type!r}: expected {list(_BASE_TYPES)}")
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise ValueError(
                f"{model_type} with dense layers (mlp_only_layers, decoder_sparse_step) "
                "is not supported: every layer must be a mixture of experts"
            )
        config = super().from_hf({**hf, "model_type": _BASE_TYPES[model_type]})
        return replace(
            config,
            num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        )
