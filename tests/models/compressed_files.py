"""Write llm-compressor's compressed-tensors checkpoints from a float HF folder, by the
format's own rules (written here from its specification, not through jengine's reader):

- int schemes: q = clamp(round(w / scale) + zero_point, -2^(b-1), 2^(b-1) - 1), one scale
  per tensor, output row or group of inputs; symmetric scales max|w| / (2^(b-1) - 1) and
  zero point 0, asymmetric (max - min) / (2^b - 1) with the zero point that puts min on
  -2^(b-1); scales stored as bfloat16 (what llm-compressor writes for a bf16 model),
  rounded before q is computed;
- `pack-quantized`: q + 2^(b-1) as unsigned b-bit fields, 32 // b per int32, the first in
  the lowest bits, rows padded to whole words, `weight_shape` beside; asymmetric zero
  points packed the same way along the output axis; `int-quantized`: q as int8;
- `float-quantized` fp8: w / scale rounded to e4m3, scale max|w| / 448 per row or per
  [128, 128] block (`strategy: block`).

`dequantized(...)` is each weight as the format defines it: (q - zero_point) * scale.
"""

import json
import os
import shutil

import ml_dtypes
import numpy as np
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16)


def quantize_int(w: np.ndarray, bits: int, group: int | None, symmetric: bool):
    """(q int8 [F, D], scales bf16 [F, G], zero points int8 [F, G] or None)."""
    rows, dim = w.shape
    grouped = w.reshape(rows, dim // (group or dim), -1).astype(np.float64)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if symmetric:
        scales = np.abs(grouped).max(-1) / high
    else:
        scales = (grouped.max(-1) - grouped.min(-1)) / (high - low)
    scales = _bf16(np.maximum(scales, 1e-6)).astype(np.float64)
    zero_points = None
    if not symmetric:
        zero_points = np.clip(np.rint(low - grouped.min(-1) / scales), low, high)
    shift = 0 if zero_points is None else zero_points[..., None]
    q = np.clip(np.rint(grouped / scales[..., None]) + shift, low, high).reshape(rows, dim)
    zp = None if zero_points is None else zero_points.astype(np.int8)
    return q.astype(np.int8), _bf16(scales), zp


def pack_int32(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Signed b-bit values packed along `axis`: 32 // b fields a word, lowest bits first."""
    fields = np.moveaxis(values.astype(np.int64) + (1 << (bits - 1)), axis, -1)
    per_word = 32 // bits
    pad = -fields.shape[-1] % per_word
    fields = np.pad(fields, [(0, 0)] * (fields.ndim - 1) + [(0, pad)])
    fields = fields.reshape(*fields.shape[:-1], -1, per_word)
    words = (fields << (np.arange(per_word) * bits)).sum(-1).astype(np.uint32).view(np.int32)
    return np.moveaxis(words, -1, axis)


def write_compressed(
    float_folder: str,
    out_folder: str,
    *,
    bits: int = 4,
    kind: str = "int",
    strategy: str = "group",
    group_size: int | None = 32,
    symmetric: bool = True,
    fmt: str = "pack-quantized",
    actorder: bool = False,
    targets: tuple[str, ...] = ("Linear",),
    ignore: tuple[str, ...] = ("lm_head",),
) -> dict[str, np.ndarray]:
    """Write the compressed checkpoint; returns {tensor name: dequantized float32 weight}
    of every quantized weight."""
    os.makedirs(out_folder, exist_ok=True)
    for name in os.listdir(float_folder):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(float_folder, name), out_folder)
    tensors = load_file(os.path.join(float_folder, "model.safetensors"))
    out, dequantized = {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        ignored = any(module == target or module.endswith(f".{target}") for target in ignore)
        if ignored or not (name.endswith(".weight") and module.endswith(PROJECTIONS)):
            out[name] = w
            continue
        w = w.astype(np.float32)
        if kind == "float":
            if strategy == "block":
                f, d = w.shape
                scales = np.abs(w.reshape(f // 128, 128, d // 128, 128)).max(axis=(1, 3))
            else:
                scales = np.abs(w).max(-1, keepdims=True)
            scales = _bf16(scales / 448.0)
            expanded = scales.astype(np.float32)
            if strategy == "block":
                expanded = np.repeat(np.repeat(expanded, 128, 0), 128, 1)
            q = np.clip(w / expanded, -448, 448).astype(ml_dtypes.float8_e4m3fn)
            out[name] = q
            out[f"{module}.weight_scale"] = scales
            dequantized[name] = q.astype(np.float32) * expanded
            continue
        group = group_size if strategy == "group" else None
        q, scales, zero_points = quantize_int(w, bits, group, symmetric)
        columns = np.arange(w.shape[1]) // (group or w.shape[1])
        if actorder:  # GPTQ's activation order: inputs assigned to groups out of order
            columns = np.random.default_rng(0).permutation(columns)
            q, scales, zero_points = _regroup(w, columns, bits, scales.shape[1], symmetric)
            out[f"{module}.weight_g_idx"] = columns.astype(np.int32)
        shift = 0 if zero_points is None else zero_points[:, columns].astype(np.float32)
        dequantized[name] = (q - shift) * scales.astype(np.float32)[:, columns]
        if fmt == "pack-quantized":
            out[f"{module}.weight_packed"] = pack_int32(q, bits, axis=1)
            out[f"{module}.weight_shape"] = np.array(w.shape, np.int64)
            if zero_points is not None:
                out[f"{module}.weight_zero_point"] = pack_int32(zero_points, bits, axis=0)
        else:
            out[name] = q
            if zero_points is not None:
                out[f"{module}.weight_zero_point"] = zero_points
        out[f"{module}.weight_scale"] = scales
    save_file(
        {name: _torch(array) for name, array in out.items()},
        os.path.join(out_folder, "model.safetensors"),
        metadata={"format": "pt"},
    )
    weights = dict(num_bits=bits, type=kind, symmetric=symmetric, strategy=strategy)
    if strategy == "group":
        weights.update(group_size=group_size, actorder="group" if actorder else None)
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    with open(os.path.join(out_folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": list(targets), "weights": weights}},
        "ignore": list(ignore),
    }
    with open(os.path.join(out_folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dequantized


def _torch(array: np.ndarray) -> torch.Tensor:
    """numpy -> torch, bfloat16 and fp8 by their bits (safetensors' numpy writer
    mislays ml_dtypes' types)."""
    for numpy_type, torch_type, bits in (
        (ml_dtypes.bfloat16, torch.bfloat16, np.int16),
        (ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn, np.uint8),
    ):
        if array.dtype == numpy_type:
            return torch.from_numpy(np.ascontiguousarray(array).view(bits)).view(torch_type)
    return torch.from_numpy(np.ascontiguousarray(array))


def _regroup(w, columns, bits, num_groups, symmetric):
    """Quantize with inputs grouped by `columns` (g_idx) instead of input order."""
    order = np.argsort(columns, kind="stable")
    q, scales, zero_points = quantize_int(w[:, order], bits, w.shape[1] // num_groups, symmetric)
    unsorted = np.empty_like(q)
    unsorted[:, order] = q
    return unsorted, scales, zero_points
