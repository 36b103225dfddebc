"""HF `architectures` names -> model classes jengine can run.

Where it sits: `models/loader.py` asks it which class builds a checkpoint. Promises a
clear ValueError naming the architecture and the supported list for anything else.
"""

from jengine.models.checkpoint import causal_lm_of_base_model
from jengine.models.gemma import GemmaConfig, GemmaForCausalLM
from jengine.models.llama import LlamaConfig, LlamaForCausalLM
from jengine.models.mixtral import MixtralConfig, MixtralForCausalLM
from jengine.models.phi3 import Phi3Config, Phi3ForCausalLM
from jengine.models.qwen_moe import QwenMoeConfig, QwenMoeForCausalLM

# name -> (model class, config class); each family file's config class reads its
# architectures' config.json into the shared decoder's knobs and names their tensors.
_ARCHITECTURES = {
    "LlamaForCausalLM": (LlamaForCausalLM, LlamaConfig),
    "MistralForCausalLM": (LlamaForCausalLM, LlamaConfig),
    "Qwen2ForCausalLM": (LlamaForCausalLM, LlamaConfig),
    "Qwen3ForCausalLM": (LlamaForCausalLM, LlamaConfig),
    "Phi3ForCausalLM": (Phi3ForCausalLM, Phi3Config),
    "MixtralForCausalLM": (MixtralForCausalLM, MixtralConfig),
    "Qwen2MoeForCausalLM": (QwenMoeForCausalLM, QwenMoeConfig),
    "Qwen3MoeForCausalLM": (QwenMoeForCausalLM, QwenMoeConfig),
    "Gemma2ForCausalLM": (GemmaForCausalLM, GemmaConfig),
    "Gemma3ForCausalLM": (GemmaForCausalLM, GemmaConfig),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_architecture(hf_config: dict):
    """Return (model class, config class) for an HF config dict. A family's base model
    without its LM head (`LlamaModel`, `Qwen3Model`: what embedding checkpoints hold) is
    its causal LM's class; the loader ties the head it lacks to the embedding."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
        causal_lm = causal_lm_of_base_model(name)
        if causal_lm is not None:
            return _ARCHITECTURES[causal_lm]
    raise ValueError(
        f"unsupported model architecture {names or '(none given in config.json)'}; "
        f"jengine supports {', '.join(supported_architectures())}"
    )
