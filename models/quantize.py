"""Quantized weights at load: a float weight quantized (`--quantization int8 | fp8`), or a GGUF
tensor's blocks repacked into the layout the quantized matmul reads.

Where it sits: `models/loader.py` and `models/gguf_loader.py` call these one parameter (a
GGUF: one layer's tensor) at a time, on the host, before it goes to the device; the result
is a dict of numpy arrays named as `QuantFormat.shapes` names them, which the model's
`QuantizedLinear` holds as parameters (`pallas_kernels/quantized_matmul/layout.py`
defines what they mean).

Promises:
- `int8` and `fp8` (e4m3), weight-only (`method_format`): symmetric, a float32 scale per
  group of 32 inputs (int8) or per output row (fp8): scale = max|w| / 127 (448 for fp8),
  q = w / scale rounded to nearest; an all-zero group gets scale 1;
- GGUF Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K keep their quants (4-bit where
  they fit: the legacy formats' bytes unchanged; int8 otherwise) with their scales and
  mins (`gguf_quants.decompose`) in float16 for the legacy formats (the file's own
  float16s, and Q4_0's -8 * d, as they are) and float32 for the K-quants (products of
  super-block and sub-block scales, exact in float32), so dequantizing the result is
  exactly ggml's reference dequantization (tests/models/test_gguf_loader.py);
- other GGUF types are not kept quantized here (`GGUF_KEPT` says which are); the loader
  dequantizes those as before and logs it.
"""

import jax.numpy as jnp
import numpy as np

from jengine.models.gguf_quants import decompose
from jengine.pallas_kernels.quantized_matmul import QuantFormat

# `--quantization int8`: groups of 32 inputs (per output channel only where a row is not
# whole groups): per channel moved SmolLM2's perplexity +1.4%, groups of 32 -0.8%
# (bench/README.md). `fp8`: per output channel (e4m3's error is relative: groups would
# not lower it).
INT8 = QuantFormat("int8", "int8", group_size=32)
INT8_PER_CHANNEL = QuantFormat("int8", "int8", group_size=None)
FP8 = QuantFormat("fp8", "fp8", group_size=None)
# GGUF's block types kept quantized: each block's q, scales and mins (gguf_quants.decompose)
# packed as 4-bit values where q fits (0..15), else as int8.
# The legacy blocks' scales and mins stay float16, as in the file (exact, and 2 bytes a group
# less for every decode step to read: SmolLM2's Q4_1 layers 80 -> 66 MB).
GGUF_KEPT = {
    "Q8_0": QuantFormat("Q8_0", "int8", group_size=32, scale_dtype="float16"),
    "Q4_0": QuantFormat("Q4_0", "uint4", group_size=32, has_mins=True, scale_dtype="float16"),
    "Q4_1": QuantFormat("Q4_1", "uint4", group_size=32, has_mins=True, scale_dtype="float16"),
    "Q5_0": QuantFormat("Q5_0", "int8", group_size=32, scale_dtype="float16"),
    "Q5_1": QuantFormat("Q5_1", "int8", group_size=32, has_mins=True, scale_dtype="float16"),
    "Q4_K": QuantFormat("Q4_K", "uint4", group_size=32, has_mins=True),
    "Q5_K": QuantFormat("Q5_K", "int8", group_size=32, has_mins=True),
    "Q6_K": QuantFormat("Q6_K", "int8", group_size=16),
}
# What `--quantization` may name for a float checkpoint.
METHODS = ("int8", "fp8", "fp8-rtn")  # fp8-rtn: fp8 rounded to nearest (no calibration)
_LARGEST = {"int8": 127.0, "fp8": 448.0}  # the largest value of each kind


def method_format(method: str, dim: int) -> QuantFormat:
    """The format `--quantization method` gives a weight of rows of `dim` inputs."""
    if method == "int8":
        return INT8 if dim % INT8.group_size == 0 else INT8_PER_CHANNEL
    if method in ("fp8", "fp8-rtn"):
        return FP8
    raise ValueError(f"unknown quantization method {method!r}; expected one of {METHODS}")


def quantize(weight: np.ndarray, fmt: QuantFormat) -> dict[str, np.ndarray]:
    """A float weight [..., F, D] -> its arrays in `fmt` (int8 or fp8 e4m3): symmetric, one
    scale per group of inputs (max|w| over the largest value), rounded to nearest."""
    if fmt.kind not in _LARGEST or fmt.has_mins:
        raise ValueError(f"quantizing float weights to {fmt.name} is not supported")
    w = np.asarray(weight, np.float32)
    groups = w.reshape(*w.shape[:-1], fmt.groups(w.shape[-1]), -1)
    largest = _LARGEST[fmt.kind]
    scales = np.abs(groups).max(axis=-1, keepdims=True) / largest
    scales[scales == 0] = 1.0
    scaled = np.clip(groups / scales, -largest, largest).reshape(w.shape)
    if fmt.kind == "int8":
        values = np.rint(scaled).astype(np.int8)
    else:
        values = scaled.astype(jnp.float8_e4m3fn)  # ml_dtypes: round to nearest even
    return {"values": values, "scales": scales[..., 0].astype(np.float32)}


def common_format(type_names: set[str]) -> QuantFormat | None:
    """The kept format that holds every one of a weight's GGUF types exactly (its layers
    may mix them: llama.cpp's Q4_K_M stores some layers' v and down weights as Q6_K), or
    None if one of them is not kept. One type: its own format; several: int8 (any q fits),
    in the smallest of their groups, with mins if any has them, float16 scales if all have
    them."""
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
        scale_dtype="float16" if all(f.scale_dtype == "float16" for f in formats) else "float32",
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
    arrays = {"values": values, "scales": _exactly(scales, fmt)}
    if fmt.has_mins:
        arrays["mins"] = _exactly(mins, fmt)
    return arrays


def _exactly(a: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """float32 `a` in `fmt.scale_dtype`, refused if that would change a value."""
    stored = a.astype(fmt.scale_dtype)
    if not np.array_equal(stored.astype(np.float32), a, equal_nan=True):
        raise ValueError(
            f"{fmt.name}: a block's scale or min does not fit {fmt.scale_dtype} (Q4_0 keeps "
            "-8 * d: d of 8192 or more overflows); load it with --quantization none"
        )
    return stored
