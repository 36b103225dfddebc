"""Load a Hugging Face checkpoint folder into a Flax model: config.json + *.safetensors
(GGUF files go to `models/gguf_loader.py`).

Where it sits: the first thing the runner does; `load_model(path, dtype)` returns a ready
`nnx.Module` whose weights came from the folder, cast to `dtype`. Also `model_from_params`
for research code that brings its own params pytree.

Promises:
- one `model.safetensors` or many shards listed in `model.safetensors.index.json`;
- bf16 / f16 / f32 weights cast to the chosen dtype;
- per-layer HF tensors stacked on the leading `layers` axis, linear weights as HF stores
  them, [out, in] (the layout the matmul reads fastest: one contiguous row per output);
- a clear ValueError naming what is wrong for a missing folder, a missing or broken
  config.json, an unsupported architecture, missing shards or missing / unexpected /
  mis-shaped tensors.
"""

import dataclasses
import json
import logging
import math
import os
import re
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jengine.config import QUANTIZATION_CHOICES
from jengine.models import compressed_tensors
from jengine.models.calibration import own_input_grams
from jengine.models.checkpoint import gguf_file, holds_base_model, read_hf_config, resolve_model
from jengine.models.gptq import gptq_fp8
from jengine.models.llama import LINEAR_WEIGHTS
from jengine.models.param_tree import fitted_leaves, flatten, unflatten
from jengine.models.quantize import METHODS, method_format, quantize
from jengine.models.registry import resolve_architecture

logger = logging.getLogger(__name__)

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

DTYPES = {
    "float32": jnp.float32,
    "float": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "half": jnp.float16,
}


def resolve_dtype(dtype) -> jnp.dtype:
    """'auto' -> bf16 on accelerators, f32 on CPU; names or jnp dtypes pass through."""
    if dtype is None or dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected auto or one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def safetensors_files(path: str) -> list[str]:
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise ValueError(f"{index_path} names shards that are missing: {missing}")
        return [os.path.join(path, s) for s in shards]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model folder {path!r} has no *.safetensors weights")
    return [os.path.join(path, f) for f in files]


# safetensors dtype -> numpy (bf16 and fp8 through ml_dtypes, which safetensors' own
# numpy and flax readers do not take for fp8).
_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_hf_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of the folder's safetensors files as numpy arrays."""
    tensors = {}
    for file in safetensors_files(path):
        tensors.update(read_safetensors(file))
    return tensors


def read_safetensors(file: str) -> dict[str, np.ndarray]:
    """One file's tensors, read by the safetensors layout: an 8-byte header length, a JSON
    header of dtype, shape and byte offsets, the data."""
    tensors = {}
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        header_bytes = int.from_bytes(f.read(8), "little")
        if size < 8 or 8 + header_bytes > size:
            raise ValueError(f"{file} is truncated or not a safetensors file")
        try:
            header = json.loads(f.read(header_bytes))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{file} has a corrupt safetensors header ({e})") from None
    if not header or set(header) == {"__metadata__"}:
        return tensors
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_bytes)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}, not supported")
        start, end = info["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        if end > len(data) or end - start != dtype.itemsize * math.prod(info["shape"]):
            raise ValueError(f"{file} is truncated or corrupt (tensor {name}'s data)")
        array = data[start:end].view(dtype)
        tensors[name] = np.array(array.reshape(info["shape"]))  # a copy: the file closes
    del data
    return tensors


def hf_to_params(tensors: dict[str, np.ndarray], config) -> dict:
    """HF tensor names -> our nested params dict (layers stacked, linear weights [out, in]),
    by the names the config's family gives them (`hf_layer_names`, `hf_top_names`)."""
    num_layers = config.num_hidden_layers
    params: dict = {"layers": {}}
    per_layer: dict[str, list] = {}
    unexpected = []
    experts = _ExpertTensors(config)
    for name, array in tensors.items():
        if name in config.hf_top_names:
            params[config.hf_top_names[name]] = array
            continue
        match = _LAYER_KEY.match(name)
        if match and match.group(2) in config.hf_layer_names:
            ours = config.hf_layer_names[match.group(2)]
            per_layer.setdefault(ours, [None] * num_layers)[int(match.group(1))] = array
        elif match and experts.take(int(match.group(1)), match.group(2), array):
            continue
        elif not name.endswith("rotary_emb.inv_freq"):
            unexpected.append(name)
    if unexpected:
        raise ValueError(f"checkpoint has tensors this architecture does not use: {unexpected[:5]}")
    params["layers"].update(experts.stacked())
    for ours, arrays in per_layer.items():
        missing = [i for i, a in enumerate(arrays) if a is None]
        if missing:
            raise ValueError(f"checkpoint lacks {ours} for layers {missing}")
        # A quantized weight's layers are dicts of arrays: each array stacked.
        stacked = jax.tree.map(lambda *layers: np.stack(layers), *arrays)
        if ours in config.fused_weights:  # [L, rows, ...] split along the rows
            cuts = np.cumsum(config.split_sizes(ours))[:-1]
            pieces = jax.tree.map(lambda a, cuts=cuts: np.split(a, cuts, axis=1), stacked)
            for i, name in enumerate(config.fused_weights[ours]):
                params["layers"][name] = jax.tree.map(
                    lambda p, i=i: p[i], pieces, is_leaf=lambda x: isinstance(x, list)
                )
        else:
            params["layers"][ours] = stacked
    return params


class _ExpertTensors:
    """An MoE checkpoint's per-expert tensors ("<prefix>.<e>.<name>.weight" in each layer),
    collected and stacked to [L, E, ...] per weight (`hf_expert_names`)."""

    def __init__(self, config):
        self.config = config
        self.found: dict[str, dict[tuple[int, int], np.ndarray]] = {}

    def take(self, layer: int, suffix: str, array) -> bool:
        prefix = self.config.hf_expert_prefix + "."
        parts = suffix.removeprefix(prefix).split(".")
        if not suffix.startswith(prefix) or len(parts) != 3 or not parts[0].isdigit():
            return False
        ours = self.config.hf_expert_names.get(parts[1])
        if ours is None or parts[2] != "weight":
            return False
        self.found.setdefault(ours, {})[(layer, int(parts[0]))] = array
        return True

    def stacked(self) -> dict[str, np.ndarray]:
        num_layers, num_experts = self.config.num_hidden_layers, self.config.num_experts
        out = {}
        for ours, arrays in self.found.items():
            missing = [
                (layer, e)
                for layer in range(num_layers)
                for e in range(num_experts)
                if (layer, e) not in arrays
            ]
            if missing:
                raise ValueError(f"checkpoint lacks {ours} for (layer, expert) {missing[:5]}")
            out[ours] = np.stack(
                [np.stack([arrays[(i, e)] for e in range(num_experts)]) for i in range(num_layers)]
            )
        return out


def model_from_params(model_cls, config, params: dict, dtype) -> nnx.Module:
    """Build the model abstractly (no random init) and fill it from a nested params dict.

    `params` has the structure of `nnx.state(model, nnx.Param)` as plain arrays, e.g.
    {"embed_tokens": ..., "layers": {"q_proj": [L, N*H, D], ...}, "norm": ..., "lm_head": ...}.
    """
    model = nnx.eval_shape(lambda: model_cls(config, dtype=dtype, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    flat_expected = dict(flatten(nnx.to_pure_dict(state)))
    flat_given = fitted_leaves(flat_expected, params, "params")
    # Each array in the dtype the model holds it in: `dtype` for float weights, the
    # quantized formats' own for packed values and scales.
    filled = unflatten(
        {k: jnp.asarray(v, dtype=flat_expected[k].dtype) for k, v in flat_given.items()}
    )
    nnx.replace_by_pure_dict(state, filled)
    nnx.update(model, state)
    return model


def load_model(path: str, dtype="auto", quantization: str | None = None) -> nnx.Module:
    """Load an HF checkpoint folder or a GGUF file (or a folder holding one); returns the
    Flax model with weights in `dtype`.

    `quantization` (vLLM's `--quantization`): None (or "gguf") keeps what the checkpoint
    holds (a GGUF's quantized blocks, a compressed-tensors checkpoint's packed weights
    stay quantized where the matmul reads them: models/quantize.py,
    models/compressed_tensors.py); "gguf" and "compressed-tensors" say so and insist the
    checkpoint is one; "none" dequantizes either to `dtype`; "int8" / "fp8" / "fp8-rtn"
    quantize the linear weights (weight-only; `quantized_params`), a quantized
    checkpoint's after dequantizing them."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"unknown quantization {quantization!r}; expected one of "
            f"{[q for q in QUANTIZATION_CHOICES if q]}"
        )
    path = resolve_model(path)  # `smollm2`, `shakespeare`: as LLM reads them
    gguf_path = gguf_file(path)
    if quantization == "gguf" and gguf_path is None:
        raise ValueError(f"--quantization gguf: {path} is not a GGUF file")
    if gguf_path is not None:
        from jengine.models.gguf_loader import load_gguf_model

        if quantization == compressed_tensors.QUANT_METHOD:
            raise ValueError(f"--quantization {quantization}: {path} is a GGUF file")
        keep = quantization in (None, "gguf")
        model = load_gguf_model(gguf_path, resolve_dtype(dtype), keep_quantized=keep)
        if quantization not in METHODS:
            return model
        # int8 from a GGUF: its weights dequantized, then quantized the requested way.
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        hf_config = read_hf_config(gguf_path)
        params, config = quantized_params(params, model.config, quantization, hf_config)
        return model_from_params(type(model), config, params, model.dtype)
    hf_config = read_hf_config(path)
    model_cls, config_cls = resolve_architecture(hf_config)
    base_model = holds_base_model(hf_config)
    if base_model:  # no LM head: tie one to the embedding (an embedding engine's)
        hf_config = {**hf_config, "tie_word_embeddings": True}
    try:
        config = config_cls.from_hf(hf_config)
    except KeyError as e:
        raise ValueError(f"{path}/config.json lacks the field {e.args[0]!r}") from e
    tensors = read_hf_tensors(path)
    if base_model:  # `LlamaModel`'s tensors: "layers.0...", not "model.layers.0..."
        tensors = {f"model.{name}": array for name, array in tensors.items()}
    packed = compressed_tensors.quantization_config(hf_config)
    formats = {}
    if packed is not None:
        keep = quantization in (None, compressed_tensors.QUANT_METHOD)
        tensors, formats = compressed_tensors.decompress(tensors, packed, keep=keep)
    elif quantization == compressed_tensors.QUANT_METHOD:
        raise ValueError(f"--quantization {quantization}: {path}/config.json has no such config")
    params = hf_to_params(tensors, config)
    names = {**config.hf_layer_names, **config.hf_top_names}
    kept = [
        (part, formats[hf])
        for hf, ours in names.items()
        if hf in formats
        for part in config.fused_weights.get(ours, (ours,))
    ]
    config = dataclasses.replace(config, quantization=tuple(kept))
    if config.tie_word_embeddings:
        params.pop("lm_head", None)  # some tied checkpoints still store a copy
    params, config = quantized_params(params, config, quantization, hf_config)
    return model_from_params(model_cls, config, params, resolve_dtype(dtype))


def _calibration_start(hf_config: dict) -> int:
    """The token `fp8`'s calibration samples start from: BOS, else EOS, else 0."""
    for key in ("bos_token_id", "eos_token_id"):
        token = hf_config.get(key)
        token = token[0] if isinstance(token, list) and token else token
        if isinstance(token, int):
            return token
    return 0


def quantized_params(params: dict, config, quantization: str | None, hf_config=None):
    """(params, config) with the linear weights quantized by `quantization` ("int8", "fp8",
    "fp8-rtn"; other values change nothing), and with int8 the embedding and LM head too
    (SmolLM2's tied head in int8 keeps perplexity within 1%; in e4m3 it costs 3% more).
    Weights already quantized (dicts of packed arrays in `method_format`'s layout, a
    training loop's own) are kept as they are; float ones are quantized one parameter at a
    time, on the host: rounded to nearest, or with "fp8" and the checkpoint's `hf_config`
    (which model to run, its BOS) rounded by GPTQ (`models/gptq.py`) with the Gram
    matrices of each weight's inputs over the float model's own samples from BOS
    (`models/calibration.py`)."""
    if quantization not in METHODS:
        return params, config
    started, grams = time.perf_counter(), {}
    calibrated = quantization == "fp8" and hf_config is not None
    if calibrated:
        model_cls, _ = resolve_architecture(hf_config)
        float_model = model_from_params(model_cls, config, params, resolve_dtype("auto"))
        grams = own_input_grams(float_model, _calibration_start(hf_config))
    params = {**params, "layers": dict(params["layers"])}
    formats = []
    tables = ("embed_tokens", "lm_head") if quantization == "int8" else ()
    linear = [n for n in LINEAR_WEIGHTS if n in params["layers"]]  # an MoE's experts: float
    for tree, name in [(params["layers"], n) for n in linear] + [
        (params, n)
        for n in tables
        if n in params  # a tied head is the embedding
    ]:
        weight = tree[name]
        dim = (weight["values"] if isinstance(weight, dict) else weight).shape[-1]
        fmt = method_format(quantization, dim)
        if not isinstance(weight, dict):
            if name in grams:  # only layers' weights have them
                tree[name] = gptq_fp8(np.asarray(weight), grams.pop(name))
            else:
                tree[name] = quantize(np.asarray(weight), fmt)
        formats.append((name, fmt))
    if calibrated:
        elapsed = time.perf_counter() - started
        logger.info("fp8: GPTQ rounding, calibrated on the model's own samples, %.1f s", elapsed)
    return params, dataclasses.replace(config, quantization=tuple(formats))
