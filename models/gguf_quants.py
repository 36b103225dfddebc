"""Dequantization of GGUF tensors: the GGML block formats as vectorized numpy.

Where it sits: `models/gguf_loader.py` hands each tensor's raw bytes here, one tensor at
a time, and writes the float32 result into the model's stacked weights. The `gguf`
package (llama.cpp's reader) parses the file; its own numpy dequantizer is the oracle the
tests compare these with (tests/models/test_gguf_quants.py).

Promises:
- `dequantize(raw, type_name, shape)` returns float32 of `shape` (numpy order, rows last
  axis) for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, with
  the arithmetic of ggml's reference (`dequantize_row_*`): scales in float32, `d * q - m`;
- any other type is a ValueError naming it and the supported ones.

Each format is a sequence of fixed-size blocks of 32 (or 256, the K-quants) values per
row; a block starts or ends with its float16 scale(s).
"""

import numpy as np

QK = 32  # values per block of the legacy formats
QK_K = 256  # values per super-block of the K-quants


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """[B, 1] float32 of the float16 at byte `offset` of each block."""
    return blocks[:, offset : offset + 2].copy().view(np.float16).astype(np.float32)


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    """[B, 16] bytes -> [B, 32]: the low nibbles are values 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[B, 4] bytes (a little-endian uint32) -> [B, 32] of 0 or 16: bit j of value j."""
    bits = qh.copy().view("<u4")  # [B, 1]
    return (((bits >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _q4_0(b):  # d, qs[16]
    return _f16(b, 0) * (_low_high_nibbles(b[:, 2:18]).astype(np.int8) - 8).astype(np.float32)


def _q4_1(b):  # d, m, qs[16]
    return _f16(b, 0) * _low_high_nibbles(b[:, 4:20]).astype(np.float32) + _f16(b, 2)


def _q5_0(b):  # d, qh[4], qs[16]
    q = _low_high_nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6])
    return _f16(b, 0) * (q.astype(np.int8) - 16).astype(np.float32)


def _q5_1(b):  # d, m, qh[4], qs[16]
    q = _low_high_nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8])
    return _f16(b, 0) * q.astype(np.float32) + _f16(b, 2)


def _q8_0(b):  # d, qs[32] (int8)
    return _f16(b, 0) * b[:, 2:34].view(np.int8).astype(np.float32)


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """[B, 64] bytes -> [B, 256] 2-bit values in ggml's order: each half of 32 bytes gives
    four 32-value groups, shifts 0, 2, 4, 6."""
    halves = qs.reshape(-1, 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return ((halves >> shifts) & 3).reshape(-1, QK_K)


def _q2_k(b):  # scales[16], qs[64], d, dmin
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = d * (scales & 0x0F).astype(np.float32)  # [B, 16], one per 16 values
    ml = dmin * (scales >> 4).astype(np.float32)
    q = _two_bit_planes(b[:, 16:80]).reshape(-1, 16, 16).astype(np.float32)
    return (dl[:, :, None] * q - ml[:, :, None]).reshape(-1, QK_K)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """[B, 12] bytes -> [B, 16] signed 6-bit scales (low 4 bits from bytes 0..7, high 2
    bits from bytes 8..11), minus 32."""
    low = np.concatenate([packed[:, 0:8] & 0x0F, packed[:, 0:8] >> 4], axis=1)  # [B, 16]
    high_bytes = packed[:, 8:12]  # [B, 4]; scale i takes bits 2*(i // 4) of byte i % 4
    shifts = (2 * (np.arange(16) // 4)).astype(np.uint8)
    high = (high_bytes[:, np.arange(16) % 4] >> shifts) & 3
    return (low | (high << 4)).astype(np.int8) - 32


def _q3_k(b):  # hmask[32], qs[64], scales[12], d
    d = _f16(b, 108)
    scales = _q3_k_scales(b[:, 96:108]).astype(np.float32)  # [B, 16]
    low = _two_bit_planes(b[:, 32:96]).astype(np.int8)  # [B, 256]
    # The high bit of value 32 * g + l is bit g of hmask[l]; a clear bit subtracts 4.
    hmask = b[:, 0:32]
    high = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [B, 8, 32]
    q = low - np.where(high.reshape(-1, QK_K) != 0, 0, 4).astype(np.int8)
    dl = d * scales
    return (dl.reshape(-1, 16, 1) * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, QK_K)


def _k4_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[B, 12] bytes -> ([B, 8], [B, 8]) 6-bit scales and mins (ggml's get_scale_min_k4)."""
    first = packed[:, 0:4]
    second = packed[:, 4:8]
    third = packed[:, 8:12]
    scales = np.concatenate([first & 63, (third & 0x0F) | ((first >> 6) << 4)], axis=1)
    mins = np.concatenate([second & 63, (third >> 4) | ((second >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _nibble_groups(qs: np.ndarray) -> np.ndarray:
    """[B, 128] bytes -> [B, 256]: four chunks of 32 bytes, each low nibbles then high."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, QK_K)


def _q4_k(b):  # d, dmin, scales[12], qs[128]
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _k4_scales_mins(b[:, 4:16])
    q = _nibble_groups(b[:, 16:144]).reshape(-1, 8, 32).astype(np.float32)
    return ((d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]).reshape(-1, QK_K)


def _q5_k(b):  # d, dmin, scales[12], qh[32], qs[128]
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _k4_scales_mins(b[:, 4:16])
    qh = b[:, 16:48]
    # Group g of 32 values takes its fifth bit from bit g of qh[l].
    high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    q = (_nibble_groups(b[:, 48:176]).reshape(-1, 8, 32) | high).astype(np.float32)
    return ((d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]).reshape(-1, QK_K)


def _q6_k(b):  # ql[128], qh[64], scales[16] (int8), d
    d = _f16(b, 208)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)  # [B, 16]
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # [half, first/second 32 bytes, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)  # [half, -, l]
    # Per half of 128 values: q1 = ql[l] low, q2 = ql[l+32] low, q3 = ql[l] high,
    # q4 = ql[l+32] high; their top two bits are bits 0-1, 2-3, 4-5, 6-7 of qh[l].
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32)  # [B, 2, 4, 32]
    # Scale index of value 32 * k + l within a half: 2 * k + l // 16.
    sc = scales.reshape(-1, 2, 4, 2, 1)
    dl = d.reshape(-1, 1, 1, 1, 1) * sc
    return (dl * q.reshape(-1, 2, 4, 2, 16)).reshape(-1, QK_K)


# name -> (values per block, bytes per block, dequantizer of [blocks, bytes] -> [blocks, values])
_BLOCK_FORMATS = {
    "Q4_0": (QK, 18, _q4_0),
    "Q4_1": (QK, 20, _q4_1),
    "Q5_0": (QK, 22, _q5_0),
    "Q5_1": (QK, 24, _q5_1),
    "Q8_0": (QK, 34, _q8_0),
    "Q2_K": (QK_K, 84, _q2_k),
    "Q3_K": (QK_K, 110, _q3_k),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
}
_FLOAT_FORMATS = ("F32", "F16", "BF16")
SUPPORTED_TYPES = (*_FLOAT_FORMATS, *_BLOCK_FORMATS)


# The block formats whose values are scale * q + min per group of inputs, with q small
# integers: what `decompose` splits (and models/quantize.py keeps quantized).
def _d_q8_0(b):
    return b[:, 2:34].view(np.int8), _f16(b, 0), None, QK


def _d_q4_0(b):  # d * (q - 8) = d * q - 8 d (exact: q has 4 bits, d 11)
    d = _f16(b, 0)
    return _low_high_nibbles(b[:, 2:18]), d, -8.0 * d, QK


def _d_q4_1(b):
    return _low_high_nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2), QK


def _d_q5_0(b):
    q = _low_high_nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6])
    return q.astype(np.int8) - 16, _f16(b, 0), None, QK


def _d_q5_1(b):
    q = _low_high_nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8])
    return q, _f16(b, 0), _f16(b, 2), QK


def _d_q4_k(b):  # 8 groups of 32: d * sc and dmin * m exact (11 x 6 bits)
    scales, mins = _k4_scales_mins(b[:, 4:16])
    q = _nibble_groups(b[:, 16:144])
    return q, _f16(b, 0) * scales, -(_f16(b, 2) * mins), QK


def _d_q5_k(b):
    scales, mins = _k4_scales_mins(b[:, 4:16])
    high = ((b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    q = _nibble_groups(b[:, 48:176]).reshape(-1, 8, 32) | high
    return q.reshape(-1, QK_K), _f16(b, 0) * scales, -(_f16(b, 2) * mins), QK


def _d_q6_k(b):  # 16 groups of 16: d * sc exact (11 x 8 bits)
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).astype(np.int8) - 32
    scales = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    return q.reshape(-1, QK_K), scales, None, 16


_DECOMPOSERS = {
    "Q8_0": _d_q8_0,
    "Q4_0": _d_q4_0,
    "Q4_1": _d_q4_1,
    "Q5_0": _d_q5_0,
    "Q5_1": _d_q5_1,
    "Q4_K": _d_q4_k,
    "Q5_K": _d_q5_k,
    "Q6_K": _d_q6_k,
}
DECOMPOSABLE = tuple(_DECOMPOSERS)


def decompose(raw: np.ndarray, type_name: str, shape: tuple[int, ...]):
    """A block-quantized tensor [..., D] as (q, scales, mins, group): small integers q
    [..., D] (in input order), float32 scales and mins (None where the format has none)
    [..., D / group], such that `scales * q + mins` per group is exactly `dequantize`'s
    result (the same float operations as ggml's)."""
    if type_name not in _DECOMPOSERS:
        raise ValueError(f"GGUF type {type_name} does not decompose; these do: {DECOMPOSABLE}")
    values_per_block, bytes_per_block, _ = _BLOCK_FORMATS[type_name]
    *rows, dim = shape
    if dim % values_per_block:
        raise ValueError(f"{type_name} rows of {dim} values are not whole blocks")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, bytes_per_block)
    q, scales, mins, group = _DECOMPOSERS[type_name](blocks)
    groups = dim // group

    def shaped(a):
        return None if a is None else np.ascontiguousarray(a, np.float32).reshape(*rows, groups)

    return q.reshape(*rows, dim), shaped(scales), shaped(mins), group


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of `shape` from the tensor's data as the `gguf` reader gives it."""
    if type_name == "F32":
        return np.asarray(raw, np.float32).reshape(shape)
    if type_name == "F16":
        return np.asarray(raw).view(np.float16).astype(np.float32).reshape(shape)
    if type_name == "BF16":
        bits = np.asarray(raw).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if type_name not in _BLOCK_FORMATS:
        raise ValueError(
            f"GGUF tensor type {type_name} is not supported; jengine reads "
            f"{', '.join(SUPPORTED_TYPES)}"
        )
    values_per_block, bytes_per_block, dequantize_blocks = _BLOCK_FORMATS[type_name]
    if shape[-1] % values_per_block:
        raise ValueError(f"{type_name} rows of {shape[-1]} values are not whole blocks")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, bytes_per_block)
    return dequantize_blocks(blocks).reshape(shape)
