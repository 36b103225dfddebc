"""Build a Flax model from a GGUF file (llama.cpp's checkpoint format).

Where it sits: `models/loader.load_model` hands a path here when `checkpoint.gguf_file`
says it is a GGUF. The config comes from the file's metadata (`checkpoint.gguf_hf_config`),
the tensors memory-mapped by `gguf_reader.py`.

Promises:
- llama.cpp's tensor names map onto the model's parameters (llama, qwen2, qwen3, gemma2,
  gemma3); the q/k row permutation that llama.cpp's converter applies to llama's rotary
  embedding is undone, and the one added to Gemma's norm weights subtracted, so the
  weights are exactly the HF checkpoint's (tests: a GGUF written from an HF folder loads
  equal to it);
- weights stay quantized where the quantized matmul reads their types
  (`models/quantize.GGUF_KEPT`), their blocks repacked once, one tensor at a time; a
  weight whose layers mix kept types (Q4_K_M's Q4_K and Q6_K) is repacked into one format
  that holds them all exactly (`common_format`); a weight of another type is dequantized
  (models/gguf_quants.py) into the chosen dtype, as is everything with
  `keep_quantized=False`; each parameter goes to the device as soon as its layers are
  filled: the host never holds a second full copy of the model;
- load time, the tensor types and the process's peak memory are logged;
- a clear ValueError for tensors the model has no place for (or lacks), and for tensor
  types jengine cannot dequantize.
"""

import collections
import dataclasses
import functools
import logging
import resource
import time

import jax
import numpy as np
from flax import nnx

from jengine.models.checkpoint import GGUF_ROPE_FREQS, gguf_hf_config
from jengine.models.gguf_quants import dequantize
from jengine.models.gguf_reader import read_gguf
from jengine.models.quantize import common_format, repack_gguf
from jengine.models.registry import resolve_architecture

logger = logging.getLogger(__name__)

# Our stacked name -> the GGUF per-layer tensor (after "blk.N.") that fills it (linear
# weights are [out, in] in both); a model takes those of its parameters.
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm.weight",
    "post_attention_layernorm": "ffn_norm.weight",  # the norm before the MLP
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
    # Gemma's norms on the attention's and MLP's outputs
    "attn_output_norm": "post_attention_norm.weight",
    "mlp_output_norm": "post_ffw_norm.weight",
}
_TOP_TENSORS = {"token_embd.weight": "embed_tokens", "output_norm.weight": "norm"}
_LM_HEAD = "output.weight"
# llama.cpp's converter stores Gemma's norm weights plus one (its RMSNorm multiplies by
# the stored weight); transformers' GGUF loader subtracts it again, and so does this one.
_NORMS_PLUS_ONE = ("gemma2", "gemma3")


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter on a q or k weight ([heads * head_dim, in]): it
    interleaves each head's two rotary halves, (half, pair) -> (pair, half)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_names(layer_params, num_layers: int, tied: bool) -> dict[str, list[str]]:
    """Our parameter name -> the GGUF tensor(s) that fill it (one per layer if stacked),
    for a model whose layers hold `layer_params`."""
    names = {ours: [gguf] for gguf, ours in _TOP_TENSORS.items()}
    if not tied:
        names["lm_head"] = [_LM_HEAD]
    unknown = sorted(set(layer_params) - set(_LAYER_TENSORS))
    if unknown:
        raise ValueError(f"a GGUF has no tensors for the model's {unknown}")
    for ours, suffix in _LAYER_TENSORS.items():  # in the model's order: q, k, v, o, ...
        if ours in layer_params:
            names[f"layers.{ours}"] = [f"blk.{i}.{suffix}" for i in range(num_layers)]
    return names


@dataclasses.dataclass(frozen=True)
class GGUFLayout:
    """What a GGUF loads as, from its metadata alone: the model class and config (the
    weights kept quantized in `config.quantization`), and which tensors fill what."""

    model_cls: type
    config: object
    gguf: object  # the memory-mapped file (gguf_reader.GGUFFile)
    wanted: dict[str, list[str]]  # our parameter -> the GGUF tensor(s) that fill it
    formats: dict[str, object]  # our parameter -> the format it is kept quantized in


def gguf_layout(path: str, keep_quantized: bool = True) -> GGUFLayout:
    hf_config = gguf_hf_config(path)
    model_cls, config_cls = resolve_architecture(hf_config)
    config = config_cls.from_hf(hf_config)
    gguf = read_gguf(path)
    tensors = gguf.tensors
    abstract = nnx.eval_shape(lambda: model_cls(config, dtype=np.float32, rngs=nnx.Rngs(0)))
    layer_params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))["layers"]
    wanted = _gguf_names(layer_params, config.num_hidden_layers, config.tie_word_embeddings)
    used = {name for names in wanted.values() for name in names}
    # Some tied checkpoints still carry an output.weight; nothing else may be left over.
    unexpected = sorted(set(tensors) - used - {_LM_HEAD, GGUF_ROPE_FREQS})
    missing = sorted(used - set(tensors))
    if unexpected or missing:
        raise ValueError(
            f"{path}: tensors the {hf_config['architectures'][0]} model has no place for "
            f"{unexpected[:5]}, tensors it lacks {missing[:5]}"
        )
    formats = {}
    if keep_quantized:
        for ours, names in wanted.items():
            fmt = common_format({tensors[n].type_name for n in names})
            if fmt is not None:
                formats[ours] = fmt
    kept = tuple((ours.removeprefix("layers."), fmt) for ours, fmt in formats.items())
    config = dataclasses.replace(config, quantization=kept)
    return GGUFLayout(model_cls, config, gguf, wanted, formats)


def load_gguf_model(path: str, dtype, keep_quantized: bool = True) -> nnx.Module:
    """The model of the GGUF at `path`: weights of the kept types quantized as the file
    has them (`keep_quantized`), the rest dequantized to `dtype`."""
    from jengine.models.loader import model_from_params  # loader dispatches here

    started = time.perf_counter()
    layout = gguf_layout(path, keep_quantized)
    config, gguf, wanted = layout.config, layout.gguf, layout.wanted
    tensors = gguf.tensors
    used = {name for names in wanted.values() for name in names}
    arch = gguf.metadata.get("general.architecture")
    # Only for llama does llama.cpp's converter permute q/k rows (its rotary layout).
    heads = {}
    if arch == "llama":
        heads = {
            "attn_q.weight": config.num_attention_heads,
            "attn_k.weight": config.num_key_value_heads,
        }

    def unpermuted(name: str, weight: np.ndarray) -> np.ndarray:
        num_heads = heads.get(name.split(".", 2)[-1]) if name.startswith("blk.") else None
        return unpermute_rotary(weight, num_heads) if num_heads else weight

    def read(name: str) -> np.ndarray:
        info = tensors[name]
        weight = dequantize(gguf.tensor_data(name), info.type_name, info.shape)
        if arch in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
            weight = weight - 1  # exact: the stored values lie in [0.5, 2] or so
        return unpermuted(name, weight)

    def read_packed(name: str, fmt) -> dict[str, np.ndarray]:
        info = tensors[name]
        arrays = repack_gguf(gguf.tensor_data(name), info.type_name, info.shape, fmt)
        return {key: unpermuted(name, array) for key, array in arrays.items()}

    def stack(names: list[str], read_one, np_dtype=None):
        """One weight per layer, read one at a time into [L, ...] array(s)."""
        stacked = None
        for i, name in enumerate(names):
            weight = read_one(name)
            if stacked is None:
                stacked = jax.tree.map(
                    lambda a: np.empty((len(names), *a.shape), np_dtype or a.dtype), weight
                )
            for target, value in zip(jax.tree.leaves(stacked), jax.tree.leaves(weight)):
                target[i] = value
        return stacked

    np_dtype = np.dtype(dtype)
    device = jax.devices()[0]
    params: dict = {"layers": {}}
    # Each parameter goes to the device before the next is read: the host holds one at a time.
    for ours, names in wanted.items():
        types = {tensors[n].type_name for n in names}
        fmt = layout.formats.get(ours)
        kept = fmt is not None
        read_one = functools.partial(read_packed, fmt=fmt) if kept else read
        if not kept and keep_quantized and types - {"F32", "F16", "BF16"}:
            logger.info("%s: %s dequantized to %s", ours, "/".join(sorted(types)), np_dtype.name)
        if ours.startswith("layers."):
            value = stack(names, read_one, None if kept else np_dtype)
            params["layers"][ours.removeprefix("layers.")] = jax.device_put(value, device)
        else:
            value = read_one(names[0])
            value = value if kept else value.astype(np_dtype)
            params[ours] = jax.device_put(value, device)
    model = model_from_params(layout.model_cls, config, params, dtype)
    types = collections.Counter(tensors[n].type_name for n in used)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    logger.info(
        "loaded %s: %d tensors (%s), %s, the rest %s, in %.1fs; peak memory %.2f GiB",
        path,
        len(used),
        ", ".join(f"{count} {name}" for name, count in types.most_common()),
        f"{len(layout.formats) or 'none'} kept quantized",
        np_dtype.name,
        time.perf_counter() - started,
        peak_gib,
    )
    return model
