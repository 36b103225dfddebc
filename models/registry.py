"""HF `architectures` names -> model classes jengine can run.

Where it sits: `models/loader.py` asks it which class builds a checkpoint. Promises a
clear ValueError naming the architecture and the supported list for anything else.
"""

from jengine.models.llama import LlamaConfig, LlamaForCausalLM

# name -> (model class, config class); one family file serves several architectures.
_ARCHITECTURES = {
    "LlamaForCausalLM": (LlamaForCausalLM, LlamaConfig),
    "MistralForCausalLM": (LlamaForCausalLM, LlamaConfig),
    "Qwen2ForCausalLM": (LlamaForCausalLM, LlamaConfig),
    "Qwen3ForCausalLM": (LlamaForCausalLM, LlamaConfig),
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
