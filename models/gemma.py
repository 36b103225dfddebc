"""The Gemma family: Gemma 2 and Gemma 3 (text), on the shared decoder.

Where it sits: `models/registry.py` maps `Gemma2ForCausalLM` and `Gemma3ForCausalLM` here;
`GemmaConfig.from_hf` reads their `config.json` into the decoder's knobs
(`models/decoder.py`) and `hf_layer_names` maps their tensors onto its parameters.

What Gemma sets, as transformers' modeling code does: embeddings scaled by sqrt(D) (in the
model dtype); RMSNorm scaling by (1 + w) in float32; four norms a layer (before and after
attention and the MLP: HF's `post_attention_layernorm` is the norm on the attention's
output, ours on the MLP's input is its `pre_feedforward_layernorm`); a GELU-tanh gated
MLP; sm_scale = query_pre_attn_scalar ** -0.5; local (sliding-window) and global layers
as `layer_types` says (older configs: Gemma 2 alternates starting local, Gemma 3 has
`sliding_window_pattern` - 1 local layers before each global one); Gemma 2's attention and
final logit soft-capping; Gemma 3's q/k norms and its local layers' own rope
(`rope_local_base_freq`, or `rope_parameters["sliding_attention"]`).
"""

from dataclasses import dataclass
from typing import ClassVar

from jengine.models.decoder import (
    HF_LAYER_NAMES,
    DecoderConfig,
    DecoderForCausalLM,
    sizes_from_hf,
    sliding_windows_from_hf,
)
from jengine.models.rope_config import RopeConfig

_MODEL_TYPES = ("gemma2", "gemma3_text")
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def _gemma_layer_names() -> dict[str, str]:
    names = dict(HF_LAYER_NAMES)
    names["post_attention_layernorm.weight"] = "attn_output_norm"
    names["pre_feedforward_layernorm.weight"] = "post_attention_layernorm"
    names["post_feedforward_layernorm.weight"] = "mlp_output_norm"
    return names


def _layer_types(hf: dict) -> list[str]:
    """What each layer is: `layer_types`, or the family's default pattern."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    num_layers = hf["num_hidden_layers"]
    if hf["model_type"] == "gemma2":
        local = [i % 2 == 0 for i in range(num_layers)]
    else:
        pattern = hf.get("sliding_window_pattern", 6)
        local = [(i + 1) % pattern != 0 for i in range(num_layers)]
    return ["sliding_attention" if is_local else "full_attention" for is_local in local]


def _ropes(hf: dict, head_dim: int) -> tuple[RopeConfig, RopeConfig | None]:
    """(global layers' rope, Gemma 3's local layers' rope or None)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # per layer type (transformers 5)
        plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}

        def rope(layer_type: str) -> RopeConfig:
            return RopeConfig.from_hf({**plain, "rope_parameters": params[layer_type]}, head_dim)

        local = rope("sliding_attention") if "sliding_attention" in params else None
        return rope("full_attention"), local
    local = None
    if hf["model_type"] == "gemma3_text":
        local = RopeConfig(head_dim, theta=float(hf.get("rope_local_base_freq", 10000.0)))
    return RopeConfig.from_hf(hf, head_dim), local


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma 2 / 3 on the shared decoder (its own name in logs)."""


@dataclass(frozen=True)
class GemmaConfig(DecoderConfig):
    """A Gemma 2 / Gemma 3 text architecture (see the module docstring)."""

    hf_layer_names: ClassVar[dict[str, str]] = _gemma_layer_names()

    @classmethod
    def from_hf(cls, hf: dict) -> "GemmaConfig":
        model_type = hf.get("model_type")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"Gemma model_type {model_type!r}: expected one of {_MODEL_TYPES}")
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if activation not in _ACTIVATIONS:
            raise ValueError(f"Gemma hidden_activation {activation!r} is not supported")
        head_dim = sizes_from_hf(hf)["head_dim"]
        if hf.get("attention_bias"):
            raise ValueError("Gemma with attention_bias=true is not supported")
        if model_type != "gemma2" and hf.get("use_bidirectional_attention"):
            # EmbeddingGemma's: the prompt attends both ways, which a causal decoder's
            # KV cache cannot give (transformers' Gemma 2 ignores the field, as jengine).
            raise ValueError(
                "Gemma 3 with use_bidirectional_attention=true (EmbeddingGemma's) is not "
                "supported: jengine runs causal attention only"
            )
        rope, local_rope = _ropes(hf, head_dim)
        sliding_window, local_layers = sliding_windows_from_hf(
            {**hf, "layer_types": _layer_types(hf)}
        )
        return cls(
            **sizes_from_hf(hf),
            rope=rope,
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            qk_norm=model_type == "gemma3_text",
            sliding_window=sliding_window,
            local_layers=local_layers,
            local_rope=local_rope,
            hidden_act="gelu_tanh",
            norm_plus_one=True,
            sandwich_norms=True,
            embedding_multiplier=hf["hidden_size"] ** 0.5,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or head_dim),
            # Gemma 3's config may carry one, but its attention never applies it
            # (transformers', the reference, passes none).
            attn_soft_cap=hf.get("attn_logit_softcapping") if model_type == "gemma2" else None,
            final_soft_cap=hf.get("final_logit_softcapping"),
        )
