"""Mixtral: Mistral's attention with a mixture-of-experts feed-forward (`models/moe.py`).

Where it sits: `models/registry.py` maps `MixtralForCausalLM` here. Its experts are
`block_sparse_moe.experts.<e>.w1` (gate), `w3` (up) and `w2` (down), its router
`block_sparse_moe.gate`; the top-k routing weights are always renormalised
(`num_experts_per_tok` of `num_local_experts`).
"""

from dataclasses import dataclass, replace
from typing import ClassVar

from jengine.models.decoder import HF_LAYER_NAMES, DecoderForCausalLM
from jengine.models.llama import LlamaConfig


def _mixtral_layer_names() -> dict[str, str]:
    names = {k: v for k, v in HF_LAYER_NAMES.items() if not k.startswith("mlp.")}
    names["block_sparse_moe.gate.weight"] = "router"
    return names


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral on the shared decoder (its own name in logs)."""


@dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """A Mixtral architecture: Mistral's reading plus its experts."""

    hf_layer_names: ClassVar[dict[str, str]] = _mixtral_layer_names()
    hf_expert_prefix: ClassVar[str] = "block_sparse_moe.experts"
    hf_expert_names: ClassVar[dict[str, str]] = {
        "w1": "expert_gate",
        "w3": "expert_up",
        "w2": "expert_down",
    }

    @classmethod
    def from_hf(cls, hf: dict) -> "MixtralConfig":
        config = super().from_hf({**hf, "model_type": "mistral"})
        return replace(
            config,
            num_experts=int(hf["num_local_experts"]),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
        )
