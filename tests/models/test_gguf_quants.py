"""Every GGUF tensor type jengine dequantizes, and every type it keeps quantized, against
the `gguf` package's reference dequantizer (llama.cpp's own numpy port), bit for bit."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from jengine.models.gguf_quants import DECOMPOSABLE, SUPPORTED_TYPES, decompose, dequantize
from jengine.models.quantize import GGUF_KEPT, common_format, repack_gguf
from jengine.pallas_kernels.quantized_matmul import QuantizedWeight
from jengine.pallas_kernels.quantized_matmul import dequantize as kernel_dequantize

BLOCK_TYPES = [name for name in SUPPORTED_TYPES if name not in ("F32", "F16", "BF16")]


def _random_blocks(name: str, rows: int, blocks_per_row: int, rng) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    return rng.integers(0, 256, (rows, blocks_per_row * type_size), dtype=np.uint8)


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("finite_scales", [True, False])
def test_block_types_equal_the_reference(name, finite_scales):
    """Random bytes are valid blocks of every type: each bit pattern of scales, mins and
    quants is covered. With `finite_scales` the float16 scales stay finite (the top bits
    of every odd byte cleared); without, inf/nan scales must come out the same too."""
    rng = np.random.default_rng(sum(map(ord, name)))
    raw = _random_blocks(name, rows=5, blocks_per_row=3, rng=rng)
    if finite_scales:
        raw[:, 1::2] &= 0x3F
    block_size, _ = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    shape = (5, 3 * block_size)
    ours = dequantize(raw, name, shape)
    theirs = reference_dequantize(raw, GGMLQuantizationType[name])
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(ours, theirs.astype(np.float32))
    if finite_scales:
        assert np.isfinite(ours).all()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantized_real_weights_round_trip(name):
    """Weights quantized by the reference quantizer come back as the reference says, and
    near the originals (a dequantizer bug would not stay within one quantization step)."""
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((8, 64)).astype(np.float32)
    qtype = GGMLQuantizationType[name]
    raw = reference_quantize(weights, qtype)
    ours = dequantize(raw, name, weights.shape)
    np.testing.assert_array_equal(ours, reference_dequantize(raw, qtype))
    step = np.abs(weights).max() / (7 if name.startswith("Q4") else 15 if "5" in name else 127)
    assert np.abs(ours - weights).max() <= step


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types(name):
    rng = np.random.default_rng(1)
    values = rng.standard_normal((4, 32)).astype(np.float32)
    if name == "F32":
        raw, want = values, values
    elif name == "F16":
        raw, want = values.astype(np.float16), values.astype(np.float16).astype(np.float32)
    else:
        raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(4, 64)
        want = reference_dequantize(raw, GGMLQuantizationType.BF16)
    np.testing.assert_array_equal(dequantize(raw, name, (4, 32)), want)


def test_a_scale_float16_cannot_hold_is_refused_by_name():
    """Q4_0 keeps -8 * d as its min, in float16 like the file's d: a d of 8192 would make
    it -65536, past float16's range, so the repack refuses rather than store -inf."""
    block = np.zeros((1, 18), np.uint8)
    block[0, :2] = np.array([8192], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="Q4_0: a block's scale or min does not fit float16"):
        repack_gguf(block, "Q4_0", (1, 32), GGUF_KEPT["Q4_0"])
    block[0, :2] = np.array([4096], np.float16).view(np.uint8)  # -32768 fits
    assert repack_gguf(block, "Q4_0", (1, 32), GGUF_KEPT["Q4_0"])["mins"][0, 0] == -32768


def test_unsupported_type_is_named():
    with pytest.raises(ValueError, match="IQ2_XXS is not supported.*Q4_K"):
        dequantize(np.zeros((1, 66), np.uint8), "IQ2_XXS", (1, 256))


@pytest.mark.parametrize("name", DECOMPOSABLE)
def test_kept_types_repack_to_the_reference_dequantization(name):
    """The types kept quantized: `decompose` (q, scales, mins) and the packed layout the
    matmul reads (models/quantize.py) dequantize to the reference's floats, bit for bit,
    over random blocks (finite scales) of several rows."""
    rng = np.random.default_rng(sum(map(ord, name)) + 1)
    raw = _random_blocks(name, rows=4, blocks_per_row=2, rng=rng)
    raw[:, 1::2] &= 0x3F
    block_size, _ = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    shape = (4, 2 * block_size)
    theirs = reference_dequantize(raw, GGMLQuantizationType[name]).astype(np.float32)
    q, scales, mins, group = decompose(raw, name, shape)
    assert q.shape == shape and scales.shape == (4, shape[1] // group)
    grouped = q.reshape(4, -1, group).astype(np.float32) * scales[..., None]
    if mins is not None:
        grouped = grouped + mins[..., None]
    np.testing.assert_array_equal(grouped.reshape(shape), theirs)
    # In its own format, and in the common one it shares with Q6_K (groups of 16, int8).
    for fmt in (GGUF_KEPT[name], common_format({name, "Q6_K", "Q4_0"})):
        arrays = repack_gguf(raw, name, shape, fmt)
        packed = QuantizedWeight(arrays["values"], arrays["scales"], arrays.get("mins"), fmt)
        np.testing.assert_array_equal(np.asarray(kernel_dequantize(packed)), theirs)
        if fmt.kind == "uint4":
            assert arrays["values"].nbytes == q.size // 2
