"""Phi-3: the Llama family's decoder with q/k/v and gate/up fused in the checkpoint.

Where it sits: `models/registry.py` maps `Phi3ForCausalLM` here. Phi-3 stores each
layer's q, k and v projections as one `qkv_proj` tensor and its gate and up projections as
one `gate_up_proj` (gate first, as transformers' `chunk(2)` reads it); `Phi3Config` names
them as fused weights, which the loader splits into the decoder's own (`fused_weights`), so
sharding, quantization and weight updates see the usual q/k/v/gate/up. Its sliding window
(`sliding_window`, in every layer) and partial rotary factor are the config's; the 128k
variants' "longrope" scaling is served up to its original length (models/rope_config.py).
"""

from dataclasses import dataclass, replace
from typing import ClassVar

from jengine.models.decoder import HF_LAYER_NAMES, DecoderForCausalLM, sliding_windows_from_hf
from jengine.models.llama import LlamaConfig


def _phi3_layer_names() -> dict[str, str]:
    names = {k: v for k, v in HF_LAYER_NAMES.items() if "gate_proj" not in k and "up_proj" not in k}
    names["self_attn.qkv_proj.weight"] = "qkv_proj"
    names["mlp.gate_up_proj.weight"] = "gate_up_proj"
    return names


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 on the shared decoder (its own name in logs)."""


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    """A Phi-3 architecture: Llama's config reading, fused tensors split at load."""

    hf_layer_names: ClassVar[dict[str, str]] = _phi3_layer_names()
    fused_weights: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    @classmethod
    def from_hf(cls, hf: dict) -> "Phi3Config":
        sliding_window, local_layers = sliding_windows_from_hf(hf)
        config = super().from_hf(hf)
        return replace(config, sliding_window=sliding_window, local_layers=local_layers)
