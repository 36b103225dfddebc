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
- GGUF Q8_0, Q4_0 and Q4_1 keep the file's quants as they are (nibbles in GGUF's order);
  their float16 scales and mins widen to float32 (Q4_0's min is -8 d), so dequantizing
  the result is exactly ggml's reference dequantization (tests/models/test_gguf_loader.py);
- other GGUF types are not kept quantized here (`GGUF_KEPT` says which are); the loader
  dequantizes those as before and logs it.
"""

import numpy as np

from jengine.pallas_kernels.quantized_matmul import QuantFormat

INT8 = QuantFormat("int8", "int8", group_size=None)
Q8_0 = QuantFormat("Q8_0", "int8", group_size=32)
Q4_0 = QuantFormat("Q4_0", "uint4", group_size=32, has_mins=True)
Q4_1 = QuantFormat("Q4_1", "uint4", group_size=32, has_mins=True)
# GGUF type -> (format, bytes per block of 32, byte offsets of the scale d, the min m and
# the quants; the min of Q4_0 is -8 d: its quants are q - 8)
GGUF_KEPT = {
    "Q8_0": (Q8_0, 34, 0, None, 2),
    "Q4_0": (Q4_0, 18, 0, "-8d", 2),
    "Q4_1": (Q4_1, 20, 0, 2, 4),
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


def repack_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, ...]):
    """A GGUF tensor's data ([..., F, D] values as blocks) -> (format, arrays)."""
    fmt, block_bytes, scale_at, min_at, quants_at = GGUF_KEPT[type_name]
    *rows, dim = shape
    if dim % 32:
        raise ValueError(f"{type_name} rows of {dim} values are not whole blocks")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(*rows, dim // 32, block_bytes)

    def half(offset: int) -> np.ndarray:
        """The float16 at `offset` of each block, widened to float32 (exactly)."""
        return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    values = np.ascontiguousarray(blocks[..., quants_at:]).reshape(*rows, -1)
    arrays = {
        "values": values.view(np.int8) if fmt.kind == "int8" else values,
        "scales": half(scale_at),
    }
    if min_at == "-8d":
        arrays["mins"] = -8.0 * arrays["scales"]  # exact: a power of two
    elif min_at is not None:
        arrays["mins"] = half(min_at)
    return fmt, arrays
