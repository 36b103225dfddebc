"""Checkpoints quantized by llm-compressor: the `compressed-tensors` format vLLM users hold
(W4A16 / W8A16 int weights, FP8 weights), read into the quantized matmul's layout.

Where it sits: `models/loader.load_model` calls `decompress` on the folder's tensors when
config.json's `quantization_config` says `"quant_method": "compressed-tensors"`, before
the tensors are mapped to parameters; each quantized module's `weight_packed` (or int8 /
fp8 `weight`), `weight_scale`, `weight_zero_point` and `weight_shape` become one
`<module>.weight` entry: a dict of arrays in a `QuantFormat`
(`pallas_kernels/quantized_matmul/layout.py`) or, where that layout cannot hold it or the
caller asks, the float32 weight.

The format (compressed-tensors' own rules): a scheme (`config_groups`) says what each
module matching its `targets` holds (`ignore` excepted): `num_bits`, `type` int or float,
`symmetric`, `strategy` tensor / channel / group (`group_size` inputs) / block, and the
dequantization is w = (q - zero_point) * scale, q signed (-2^(b-1) .. 2^(b-1) - 1).
`pack-quantized` stores q + 2^(b-1) as unsigned b-bit fields, 32 // b of them to an
int32, the first in the lowest bits, rows padded to whole int32s; asymmetric zero points
are packed the same way along the output axis. `int-quantized` / `naive-quantized` store
q as int8, `float-quantized` as float8 e4m3.

Promises:
- int weights of 4 bits go in as `uint4` (q + 8, mins = -(8 + zero_point) * scale), other
  widths as `int8` (mins where asymmetric), fp8 as `fp8`; in the checkpoint's own groups
  (tensor and channel scales: one per row, a block's scale repeated over its rows). Scales
  widen to float32 exactly, so with the bfloat16 / float16 scales llm-compressor writes,
  the kept weights dequantize to exactly (q - zero_point) * scale;
- where the layout cannot hold a weight (activation-ordered groups, groups that are not
  multiples of 16 inputs), it is dequantized to float32 and the log says so; so is every
  weight with `keep=False` (`--quantization none`, or int8 / fp8 requested);
- a scheme whose input activations are quantized (W8A8) runs weight-only here: the
  activations stay float, and the log says so; KV-cache scales are not used (the cache
  stays in the model's dtype), also logged;
- a module `ignore` left float in some layers makes that weight float in all (logged);
- a clear ValueError for what it cannot read: other formats (nvfp4, sparse 2:4, Marlin),
  weight types, transforms, a quantized module no scheme targets, and checkpoints of other
  quantization methods (`quant_method` gptq, awq, bitsandbytes, fp8, ...).
"""

import logging
import re

import numpy as np

from jengine.pallas_kernels.quantized_matmul import QuantFormat

logger = logging.getLogger(__name__)

QUANT_METHOD = "compressed-tensors"
INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
# Activation and KV-cache scales: jengine keeps activations and the cache in float.
_UNUSED = ("input_scale", "input_zero_point", "output_scale", "k_scale", "v_scale")
_LAYER = re.compile(r"^model\.layers\.\d+\.")


def quantization_config(hf_config: dict) -> dict | None:
    """config.json's `quantization_config` if it is compressed-tensors; None without one; a
    ValueError naming any other method."""
    config = hf_config.get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method != QUANT_METHOD:  # its tensors are in a layout this loader does not read
        raise ValueError(
            f"quantization_config quant_method {method!r} is not supported: jengine reads "
            f"{QUANT_METHOD} folders (llm-compressor's) and GGUF files, or float weights "
            "(--quantization int8 / fp8 quantizes those at load)"
        )
    for key in ("transform_config",):
        if config.get(key):
            raise ValueError(f"compressed-tensors {key} is not supported")
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(
            f"compressed-tensors sparsity format {sparsity['format']!r} is not supported"
        )
    return config


def decompress(
    tensors: dict[str, np.ndarray], config: dict, keep: bool = True
) -> tuple[dict, dict[str, QuantFormat]]:
    """The folder's tensors with each quantized module's parts replaced by `<module>.weight`
    (see the module promises), and the format of each kept weight, keyed by its name with
    the layer prefix removed ("self_attn.q_proj.weight", "lm_head.weight")."""
    tensors = dict(tensors)
    modules = sorted({name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight_scale")})
    unused = sorted({n.rsplit(".", 1)[1] for n in tensors if n.rsplit(".", 1)[-1] in _UNUSED})
    for name in [n for n in tensors if n.rsplit(".", 1)[-1] in _UNUSED]:
        del tensors[name]
    if unused:
        logger.info("compressed-tensors: %s not used (activations and KV cache stay float)", unused)
    schemes = {module: _scheme(config, module) for module in modules}
    for group in sorted({name for name, _, activations in schemes.values() if activations}):
        logger.info(
            "compressed-tensors group %r quantizes activations; jengine runs its weights "
            "with float activations",
            group,
        )
    decoded = {module: _decode(tensors, module, schemes[module][1]) for module in modules}
    formats_by_weight: dict[str, set] = {}
    for module, parts in decoded.items():
        formats_by_weight.setdefault(_LAYER.sub("", module), set()).add(_format(parts))
    for name in tensors:  # a layer whose module was left float (`ignore`) beside quantized
        module = name.removesuffix(".weight")
        if module != name and module not in decoded and _LAYER.match(module):
            formats_by_weight.get(_LAYER.sub("", module), set()).add(_FLOAT)
    formats = {}
    for weight, found in formats_by_weight.items():
        fmt = next(iter(found)) if keep and len(found) == 1 else None
        if fmt is not None:
            formats[f"{weight}.weight"] = fmt
        elif keep:
            logger.info("compressed-tensors: %s dequantized to float32 (%s)", weight, _why(found))
    for module, parts in decoded.items():
        fmt = formats.get(f"{_LAYER.sub('', module)}.weight")
        tensors[f"{module}.weight"] = _pack(parts, fmt) if fmt else _dequantize(parts)
    return tensors, formats


def _why(found: set) -> str:
    if None in found:
        return "its groups do not fit the quantized layout"
    if _FLOAT in found:
        return "some of its layers are not quantized"
    return "its layers are quantized differently"


_FLOAT = "float"  # a weight's format in a layer that holds it unquantized


def _scheme(config: dict, module: str) -> tuple[str, dict, bool]:
    """The config group that targets `module`: its name, its weights' quantization args,
    and whether it quantizes the input activations too."""
    if any(_targets(module, target) for target in config.get("ignore") or ()):
        raise ValueError(f"compressed-tensors: {module} is quantized but listed in `ignore`")
    for name, group in (config.get("config_groups") or {}).items():
        if any(_targets(module, target) for target in group.get("targets", ())):
            weights = dict(group.get("weights") or {})
            if not weights:
                raise ValueError(f"compressed-tensors group {name!r} quantizes no weights")
            weights["format"] = group.get("format") or config.get("format")
            return name, weights, bool(group.get("input_activations"))
    raise ValueError(f"compressed-tensors: no config group targets the quantized module {module}")


def _targets(module: str, target: str) -> bool:
    """vLLM's rule: `re:`-prefixed regexes, module names, or the class name `Linear`
    (every projection and the LM head; the embedding is an `Embedding`)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    if target == "Linear":
        return not module.endswith("embed_tokens")
    if target == "Embedding":
        return module.endswith("embed_tokens")
    return module == target or module.endswith(f".{target}")


def _decode(tensors: dict, module: str, args: dict) -> dict:
    """One module's parts as q [F, D] (signed ints, or fp8), float32 scales [F, G], integer
    zero points [F, G] or None, the group size (None: a row) and g_idx or None."""
    kind, bits, fmt = args.get("type", "int"), int(args.get("num_bits", 8)), args["format"]
    parts = {p: tensors.pop(f"{module}.{p}") for p in _PARTS if f"{module}.{p}" in tensors}
    where = f"compressed-tensors {module} ({fmt}, {kind}{bits})"
    if kind == "int" and fmt == "pack-quantized" and 1 <= bits <= 8:
        rows, dim = (int(n) for n in np.asarray(parts.pop("weight_shape")).reshape(-1))
        q = unpack_int32(parts.pop("weight_packed"), bits, dim, axis=1)[:rows]
    elif (kind == "int" and fmt in INT_FORMATS) or (
        kind == "float" and bits == 8 and fmt in FLOAT_FORMATS
    ):
        q = tensors.pop(f"{module}.weight")
        if q.dtype.itemsize != 1:
            raise ValueError(f"{where}: weight is {q.dtype}, expected 8-bit values")
    else:
        raise ValueError(
            f"{where} is not supported; jengine reads int weights "
            f"({', '.join(INT_FORMATS)}) and fp8 weights (float-quantized)"
        )
    rows, dim = q.shape
    strategy = args.get("strategy") or (
        "group"
        if (args.get("group_size") or -1) > 0
        else "channel"
        if args.get("group_size") == -1
        else "tensor"
    )
    scales = np.asarray(parts.pop("weight_scale"), np.float32)
    group = None
    if strategy == "group":
        group = int(args["group_size"])
        scales = scales.reshape(rows, -1)
    elif strategy == "block":
        block_rows, block_cols = args["block_structure"]
        scales = np.repeat(scales.reshape(-1, scales.shape[-1]), block_rows, axis=0)[:rows]
        group = int(block_cols)
    elif strategy in ("channel", "tensor"):
        scales = np.broadcast_to(scales.reshape(-1, 1), (rows, 1)).copy()
    else:
        raise ValueError(f"{where}: strategy {strategy!r} is not supported")
    if group is not None and (dim % group or scales.shape[1] != dim // group):
        raise ValueError(
            f"{where}: {scales.shape[1]} scales per row of {dim} inputs in groups of {group}"
        )
    zero_points = parts.pop("weight_zero_point", None)
    if zero_points is not None and not args.get("symmetric", True):
        if fmt == "pack-quantized" and zero_points.dtype == np.int32 and strategy != "tensor":
            zero_points = unpack_int32(zero_points, bits, rows, axis=0)
        zero_points = np.broadcast_to(
            np.asarray(zero_points, np.int32).reshape(
                -1, 1 if strategy == "tensor" else scales.shape[1]
            ),
            scales.shape,
        )
    else:
        zero_points = None
    g_idx = parts.pop("weight_g_idx", None)
    if g_idx is not None and group is not None and np.array_equal(g_idx, np.arange(dim) // group):
        g_idx = None  # groups in input order: nothing to remap
    return dict(q=q, scales=scales, zero_points=zero_points, group=group, bits=bits, g_idx=g_idx)


def unpack_int32(packed: np.ndarray, bits: int, length: int, axis: int) -> np.ndarray:
    """pack-quantized int32 words -> the signed values along `axis` (`length` of them)."""
    words = np.moveaxis(np.asarray(packed).view(np.uint32), axis, -1)
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    fields = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    fields = fields.reshape(*words.shape[:-1], -1)[..., :length]
    values = fields.astype(np.int16) - (1 << (bits - 1))
    return np.moveaxis(values.astype(np.int8), -1, axis)


def _format(parts: dict) -> QuantFormat | None:
    """The layout that holds a decoded weight exactly, or None."""
    if parts["g_idx"] is not None:
        return None
    group, bits, dim = parts["group"], parts["bits"], parts["q"].shape[1]
    is_float = parts["q"].dtype != np.int8
    if is_float:
        kind, name = "fp8", "fp8"
    elif bits == 4 and dim % 32 == 0 and (group or 32) % 32 == 0:
        kind, name = "uint4", "int4"
    else:
        kind, name = "int8", f"int{bits}"
    has_mins = kind == "uint4" or parts["zero_points"] is not None
    try:
        fmt = QuantFormat(f"{name}-{f'g{group}' if group else 'channel'}", kind, group, has_mins)
        fmt.groups(dim)
    except ValueError:
        return None
    return fmt


def _pack(parts: dict, fmt: QuantFormat) -> dict[str, np.ndarray]:
    """A decoded weight in `fmt`'s arrays: w = scales * values + mins."""
    q, scales, zero_points = parts["q"], parts["scales"], parts["zero_points"]
    offset = 8 if fmt.kind == "uint4" else 0  # uint4 holds q + 8 (0..15)
    arrays = {"scales": scales}
    if fmt.has_mins:
        shift = offset + (0 if zero_points is None else zero_points)
        arrays["mins"] = (-shift * scales).astype(np.float32)  # exact for short scales
    if fmt.kind == "uint4":
        # Each run of 32 inputs as 16 bytes: input j in the low nibble, j + 16 in the high.
        runs = (q.astype(np.int16) + offset).astype(np.uint8).reshape(q.shape[0], -1, 2, 16)
        arrays["values"] = (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(q.shape[0], -1)
    else:
        arrays["values"] = q
    return arrays


def _dequantize(parts: dict) -> np.ndarray:
    """The float32 weight: (q - zero_point) * scale, each input in its group (g_idx)."""
    q, scales, zero_points = parts["q"], parts["scales"], parts["zero_points"]
    dim = q.shape[1]
    if parts["g_idx"] is not None:
        columns = np.asarray(parts["g_idx"], np.int64)
    else:
        columns = np.arange(dim) // (parts["group"] or dim)
    shifted = q.astype(np.float32)
    if zero_points is not None:
        shifted = shifted - zero_points[:, columns]
    return shifted * scales[:, columns]
