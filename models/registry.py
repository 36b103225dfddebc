"""HF `architectures` names -> model classes jengine can run.

Where it sits: `models/loader.py` asks it which class builds a checkpoint. Promises a
clear ValueError naming the architecture and the supported list for anything else.
"""

from jengine.models.decoder import DecoderForCausalLM
from jengine.models.gemma import GemmaConfig
from jengine.models.llama import LlamaConfig
from jengine.models.mixtral import MixtralConfig
from jengine.models.phi3 import Phi3Config
from jengine.models.qwen_moe import QwenMoeConfig

# name -> (model class, config class); each family file's config class reads its
# architectures' config.json into the shared decoder's knobs and names their tensors.
_ARCHITECTURES = {
    "LlamaForCausalLM": (DecoderForCausalLM, LlamaConfig),
    "MistralForCausalLM": (DecoderForCausalLM, LlamaConfig),
    "Qwen2ForCausalLM": (DecoderForCausalLM, LlamaConfig),
    "Qwen3ForCausalLM": (DecoderForCausalLM, LlamaConfig),
    "Phi3ForCausalLM": (DecoderForCausalLM, Phi3Config),
    "MixtralForCausalLM": (DecoderForCausalLM, MixtralConfig),
    "Qwen2MoeForCausalLM": (DecoderForCausalLM, QwenMoeConfig),
    "Qwen3MoeForCausalLM": (DecoderForCausalLM, QwenMoeConfig),
    "Gemma2ForCausalLM": (DecoderForCausalLM, GemmaConfig),
    "Gemma3ForCausalLM": (DecoderForCausalLM, GemmaConfig),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_architecture(hf_config: dict):
    """Return (model class, config class) for an HF config dict."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    raise ValueError(
        f"unsupported model architecture {names or '(none given in config.json)'}; "
        f"jengine supports {', '.join(supported_architectures())}"
    )
