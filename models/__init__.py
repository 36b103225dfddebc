"""Flax model definitions (the Llama family) and Hugging Face checkpoint loading."""

from models.attention_metadata import AttentionMetadata
from models.llama import LlamaConfig, LlamaForCausalLM
from models.loader import load_model, model_from_params, read_hf_config, resolve_dtype
from models.registry import resolve_architecture, supported_architectures

__all__ = [
    "AttentionMetadata",
    "LlamaConfig",
    "LlamaForCausalLM",
    "load_model",
    "model_from_params",
    "read_hf_config",
    "resolve_architecture",
    "resolve_dtype",
    "supported_architectures",
]
