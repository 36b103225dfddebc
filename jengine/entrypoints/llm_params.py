"""The engine's own model from what JAX research code hands `LLM`: a params pytree
(`LLM(path, params=...)`) or a Flax module (`LLM(model=module)`).

Where it sits: `LLM.__init__` calls `own_module_from_params` / `own_module_copy` before it builds
the engine. Promise: the engine never shares a buffer with the caller (a train step that
donates or edits its arrays next cannot reach the engine's weights), and a GGUF's packed
weights or a quantization asked for come out as `load_model` would give them.
"""

import jax
import numpy as np
from flax import nnx

from jengine.models import (
    model_from_params,
    quantized_params,
    read_hf_config,
    resolve_architecture,
    resolve_dtype,
    resolve_model,
)
from jengine.models.checkpoint import gguf_file
from jengine.models.gguf_loader import gguf_layout
from jengine.models.param_tree import flatten, unflatten


def own_module_from_params(path: str, params, dtype, quantization: str | None) -> nnx.Module:
    path = resolve_model(path)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    params = _own_copies(params)
    gguf_path = gguf_file(path)
    if gguf_path is not None and quantization in (None, "gguf") and _holds_packed(params):
        # What load_model gives for a GGUF: the weights of the kept types still packed.
        layout = gguf_layout(gguf_path)
        return model_from_params(layout.model_cls, layout.config, params, resolve_dtype(dtype))
    hf_config = read_hf_config(path)
    model_cls, config_cls = resolve_architecture(hf_config)
    config = config_cls.from_hf(hf_config)
    params, config = quantized_params(params, config, quantization, hf_config)
    return model_from_params(model_cls, config, params, resolve_dtype(dtype))


def _holds_packed(params: dict) -> bool:
    """Whether a params tree holds quantized weights (each a dict of packed arrays)."""
    layers = params.get("layers") if isinstance(params, dict) else None
    weights = [*params.values(), *(layers.values() if isinstance(layers, dict) else ())]
    return any(isinstance(w, dict) for w in weights if w is not layers)


def own_module_copy(module: nnx.Module, params, dtype) -> nnx.Module:
    """The engine's own copy of a caller's module, with `params` (a State or nested dict,
    whole or in part) over its weights, in `dtype` ("auto": the module's own)."""
    weights = dict(flatten(nnx.to_pure_dict(nnx.state(module, nnx.Param))))
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    if params is not None:
        weights.update(flatten(params))
    dtype = module.dtype if dtype in (None, "auto") else resolve_dtype(dtype)
    return model_from_params(type(module), module.config, _own_copies(unflatten(weights)), dtype)


def _own_copies(params):
    """The engine's own copy of every array, on the caller's devices: a train step that
    donates (or edits) the caller's arrays next must not reach the engine's weights."""

    def copy(x):
        if isinstance(x, jax.Array):
            return jax.device_put(x, x.sharding, may_alias=False)
        return np.array(x) if isinstance(x, np.ndarray) else x

    return jax.tree.map(copy, params)
