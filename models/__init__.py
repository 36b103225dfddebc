"""jengine.models: Flax model definitions (one decoder, the Llama and Gemma families on it)
and Hugging Face checkpoint loading.

Installed as `jengine.models` (the folder is `models/` at the top of the repository), so a
user's own `models` package never shadows it. Importing the package does not import jax:
`jengine.models.default` (where the bundled model lives) is read by the API process,
which must stay jax-free; the names below load their modules on first use.
"""

import importlib

_EXPORTS = {
    "AttentionMetadata": "jengine.models.attention_metadata",
    "DecoderConfig": "jengine.models.decoder",
    "DecoderForCausalLM": "jengine.models.decoder",
    "GemmaConfig": "jengine.models.gemma",
    "LlamaConfig": "jengine.models.llama",
    "LlamaForCausalLM": "jengine.models.llama",
    "load_model": "jengine.models.loader",
    "model_from_params": "jengine.models.loader",
    "quantized_params": "jengine.models.loader",
    "read_hf_config": "jengine.models.checkpoint",
    "resolve_model": "jengine.models.checkpoint",
    "resolve_dtype": "jengine.models.loader",
    "resolve_architecture": "jengine.models.registry",
    "supported_architectures": "jengine.models.registry",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jengine.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_EXPORTS)
