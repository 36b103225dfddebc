"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Where it sits: `models/registry.py` maps their HF `architectures` here; `LlamaConfig.from_hf`
reads a `config.json` into the shared decoder's config (`models/decoder.py`), whose model
runs them. Their tensors carry the decoder's default names (`HF_LAYER_NAMES`).

Promises: a clear ValueError for an activation other than SiLU; sliding windows as the
config gives them (Mistral's in every layer; Qwen2/3's with `use_sliding_window` in the
layers `layer_types` or `max_window_layers` name).
"""

from dataclasses import dataclass

from jengine.models.decoder import (
    LINEAR_WEIGHTS,
    DecoderConfig,
    DecoderForCausalLM,
    sizes_from_hf,
    sliding_windows_from_hf,
)
from jengine.models.rope_config import RopeConfig


class LlamaForCausalLM(DecoderForCausalLM):
    """The Llama family's model: the shared decoder as it is (its own name in logs)."""


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """A Llama-family architecture (see `from_hf`)."""

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        model_type = hf.get("model_type", "llama")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        attention_bias = bool(hf.get("attention_bias", False))
        sliding_window, local_layers = None, None
        if model_type == "mistral" or hf.get("use_sliding_window"):
            sliding_window, local_layers = sliding_windows_from_hf(hf)
        sizes = sizes_from_hf(hf)
        return cls(
            **sizes,
            rope=RopeConfig.from_hf(hf, sizes["head_dim"]),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has them; Qwen2-MoE says so in `qkv_bias` (True by default).
            qkv_bias=(model_type == "qwen2" and bool(hf.get("qkv_bias", True)))
            or (model_type != "mistral" and attention_bias),
            o_bias=model_type in ("llama", "qwen3") and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            local_layers=local_layers,
        )


__all__ = ["LINEAR_WEIGHTS", "LlamaConfig", "LlamaForCausalLM"]
