"""Quantized weights at load: a float weight quantized (`--quantization int8`), or a GGUF
tensor's blocks repacked into the layout the quantized matmul reads.

Where it sits: `models/loader.py` and `models/gguf_loader.py` call these one tensor (one
layer's weight) at a time, on the host, before the weight goes to the device; the result
is a dict of numpy arrays named as `QuantFormat.shapes` names them, which the model's
`QuantizedLinear` holds as parameters (`pallas_kernels/quantized_matmul/layout.py`
defines what they mean).

Promises:
- `int8`: symmetric, one float32 scale per output row (vLLM's weight-only int8):
  scale = max|w| / 127, q = round(w / scale); an all-zero row gets scale 1;
- GGUF Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K keep their quants (4-bit where
  they fit: the legacy formats' bytes unchanged; int8 otherwise) with float32 scales and
  mins (`gguf_quants.decompose`: the file's float16 scales, and the K-quants' products of
  super-block and sub-block scales, are exact in float32), so dequantizing the result is
  exactly ggml's reference dequantization (tests/models/test_gguf_loader.py);
- other GGUF types are not kept quantized here (`GGUF_KEPT` says which are); the loader
  dequantizes those as before and logs it.
"""

import numpy as np

from jengine.models.gguf_quants import decompose
from jengine.pallas_kernels.quantized_matmul import QuantFormat

INT8 = QuantFormat("int8", "int8", group_size=None)
# GGUF's block types kept quantized: each block's q, scales and mins (gguf_quants.decompose)
# packed as 4-bit values where q fits (0..15), else as int8.
GGUF_KEPT = {
    "Q8_0": QuantFormat("Q8_0", "int8", group_size=32),
    "Q4_0": QuantFormat("Q4_0", "uint4", group_size=32, has_mins=True),
    "Q4_1": QuantFormat("Q4_1", "uint4", group_size=32, has_mins=True),
    "Q5_0": QuantFormat("Q5_0", "int8", group_size=32),
    "Q5_1": QuantFormat("Q5_1", "int8", group_size=32, has_mins=True),
    "Q4_K": QuantFormat("Q4_K", "uint4", group_size=32, has_mins=True),
    "Q5_K": QuantFormat("Q5_K", "int8", group_size=32, has_mins=True),
    "Q6_K": QuantFormat("Q6_K", "int8", group_size=16),
}
# What `--quantization` may name for a float checkpoint.
METHODS = {"int8": INT8}


def quantize(weight: np.ndarray, fmt: QuantFormat) -> dict[str, np.ndarray]:
    """A float weight [..., F, D] -> its arrays in `fmt` (only per-channel int8 here)."""
    if fmt != INT8:
        raise ValueError(f"quantizing float weights to {fmt.name} is not supported")
    w = np.asarray(weight, np.float32)
    scales = np.abs(w).max(axis=-1, keepdims=True) / 127.0
    scales[scales == 0] = 1.0
    values = np.clip(np.rint(w / scales), -127, 127).astype(np.int8)
    return {"values": values, "scales": scales.astype(np.float32)}


def common_format(type_names: set[str]) -> QuantFormat | None:
    """The kept format that holds every one of a weight's GGUF types exactly (its layers
    may mix them: llama.cpp's Q4_K_M stores some layers' v and down weights as Q6_K), or
    None if one of them is not kept. One type: its own format; several: int8 (any q fits),
    in the smallest of their groups, with mins if any has them."""
    if not type_names or not all(name in GGUF_KEPT for name in type_names):
        return None
    if len(type_names) == 1:
        return GGUF_KEPT[next(iter(type_names))]
    formats = [GGUF_KEPT[name] for name in sorted(type_names)]
    return QuantFormat(
        "/".join(f.name for f in formats),
        "int8",
        group_size=min(f.group_size for f in formats),
        has_mins=any(f.has_mins for f in formats),
    )


def repack_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, ...], fmt: QuantFormat):
    """A GGUF tensor's data ([..., F, D] values as blocks) -> its arrays in `fmt` (its own
    format, or a `common_format` with others: scales repeated over smaller groups, zero
    mins where the type has none; exact either way)."""
    q, scales, mins, group = decompose(raw, type_name, shape)
    if group != fmt.group_size:  # e.g. Q4_K's groups of 32 in Q6_K's of 16
        repeat = group // fmt.group_size
        scales = np.repeat(scales, repeat, axis=-1)
        mins = None if mins is None else np.repeat(mins, repeat, axis=-1)
    if fmt.has_mins and mins is None:
        mins = np.zeros_like(scales)
    if fmt.kind == "uint4":
        # Each group of 32 as 16 bytes: input j in the low nibble, input j + 16 in the high.
        pairs = q.astype(np.uint8).reshape(*q.shape[:-1], -1, 2, 16)
        values = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*q.shape[:-1], -1)
    else:
        values = q.astype(np.int8)
    arrays = {"values": values, "scales": scales}
    if fmt.has_mins:
        arrays["mins"] = mins
    return arrays
