"""The CPU quantized-matmul kernel (`pallas_kernels/quantized_matmul/cpu.cc`) against its
XLA reference and a float64 oracle, for every layout it reads (int8 per channel and per
group, fp8, uint4 in groups of 32, 64 or a row, every GGUF type kept): one row to the most
it takes, odd output counts and group counts, the layer's neighbours' scales NaN so a
read outside `w[layer]` shows, derivatives through the reference, operands it must
refuse, and the entry point's choice (kernel for a few float32 rows, reference otherwise)."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.models.quantize import FP8, GGUF_KEPT, INT8_PER_CHANNEL
from jengine.pallas_kernels.quantized_matmul import (
    QuantFormat,
    QuantizedWeight,
    cpu,
    dequantize,
    quantized_matmul,
    quantized_matmul_reference,
    quantized_matmuls,
)

kernel = jax.jit(cpu.quantized_matmul_cpu)
RUN_TIME_REFUSAL = (jax.errors.JaxRuntimeError, ValueError)  # as in test_cpu_kernel_errors
INT8_GROUPS_OF_64 = QuantFormat("int8-g64", "int8", group_size=64)
# compressed-tensors' int4 (models/compressed_tensors.py): runs of 32 in larger groups.
UINT4_GROUPS_OF_64 = QuantFormat("uint4-g64", "uint4", group_size=64, has_mins=True)
UINT4_PER_CHANNEL = QuantFormat("uint4-row", "uint4", group_size=None, has_mins=True)
# Per channel; `--quantization int8` (groups of 32) has Q8_0's layout, among FORMATS too.
INT8 = INT8_PER_CHANNEL
Q8_0, Q4_0, Q4_1 = GGUF_KEPT["Q8_0"], GGUF_KEPT["Q4_0"], GGUF_KEPT["Q4_1"]
FORMATS = [INT8, INT8_GROUPS_OF_64, FP8, UINT4_GROUPS_OF_64, UINT4_PER_CHANNEL, *GGUF_KEPT.values()]


def weight(fmt, outputs: int, dim: int, layers: int = 3, layer: int = 1, seed: int = 0):
    """A random [layers, outputs, dim] weight in `fmt` whose layers other than `layer` have
    NaN scales and mins."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, (shape, dtype) in fmt.shapes((layers, outputs), dim).items():
        if name == "values" and dtype == "float8_e4m3fn":
            # Every finite bit pattern (subnormals included); NaN (S.1111.111) has its test.
            bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
            bits[(bits & 0x7F) == 0x7F] -= 1
            arrays[name] = bits.view(jnp.float8_e4m3fn)
        elif name == "values":
            info = np.iinfo(dtype)
            arrays[name] = rng.integers(info.min, info.max + 1, size=shape, dtype=dtype)
        else:
            array = np.full(shape, np.nan, dtype)
            array[layer] = rng.standard_normal(shape[1:]).astype(dtype) * 0.05
            arrays[name] = array
    return QuantizedWeight(arrays["values"], arrays["scales"], arrays.get("mins"), fmt)


def oracle(x: np.ndarray, w: QuantizedWeight, layer: int) -> np.ndarray:
    """float64 x @ dequantize(w[layer]).T."""
    dense = np.asarray(dequantize(w.map(lambda a: a[layer])), np.float64)
    return x.astype(np.float64) @ dense.T


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(
    "rows, dim, outputs",
    [
        (1, 576, 1536),
        (1, 64, 1),
        (2, 64, 17),
        (3, 128, 7),
        (4, 192, 33),
        (5, 64, 40),
        (16, 256, 100),
        # Items whose rows do not split evenly into the parts read side by side.
        (1, 64, 150),
        (2, 64, 150),
        # Past 16 rows: dequantized panels (panel.h), 16 rows of x a vector, 64 a chunk.
        (17, 64, 1),
        (33, 576, 45),
        (64, 320, 33),
        (100, 192, 37),
        (256, 128, 6),
    ],
)
def test_kernel_matches_reference_and_float64(fmt, rows, dim, outputs):
    w = weight(fmt, outputs, dim)
    x = np.random.default_rng(1).standard_normal((rows, dim)).astype(np.float32)
    ours = np.asarray(kernel(x, w, 1))
    assert np.isfinite(ours).all()  # nothing read from the NaN layers
    scale = np.abs(oracle(x, w, 1)).max()
    np.testing.assert_allclose(ours, oracle(x, w, 1), rtol=0, atol=2e-6 * scale)
    reference = quantized_matmul_reference(x, w, 1)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-6 * scale)


@pytest.mark.parametrize("fmt", [INT8, Q8_0, Q4_1, GGUF_KEPT["Q6_K"]], ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_an_output_has_the_same_bits_read_beside_others_or_alone(fmt, rows):
    """Rows of an item are read several at a time, side by side (cpu.cc's `Outputs`);
    each output must still be summed as if it were read alone."""
    w = weight(fmt, 150, 256, layers=1, layer=0)
    x = np.random.default_rng(5).standard_normal((rows, 256)).astype(np.float32)
    together = np.asarray(kernel(x, w, 0))
    alone = [np.asarray(kernel(x, w.map(lambda a, f=f: a[:, f : f + 1]), 0)) for f in range(150)]
    np.testing.assert_array_equal(together, np.concatenate(alone, axis=1))


@pytest.mark.parametrize("fmt", [INT8, Q4_1], ids=lambda f: f.name)
def test_every_layer_and_a_traced_index(fmt):
    w = weight(fmt, 12, 64, layers=4, layer=0)
    w = w.map(lambda a: np.nan_to_num(a, nan=0.01))
    x = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
    for layer in range(4):
        np.testing.assert_allclose(
            kernel(x, w, jnp.int32(layer)), oracle(x, w, layer), rtol=1e-5, atol=1e-5
        )


def test_derivatives_with_respect_to_x_are_the_reference_ones():
    w = weight(Q4_1, 9, 64).map(lambda a: np.nan_to_num(a, nan=0.0))
    x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)

    def loss(matmul, x):
        return jnp.sum(jnp.sin(matmul(x, w, 1)))

    ours = jax.grad(lambda x: loss(cpu.quantized_matmul_cpu, x))(x)
    theirs = jax.grad(lambda x: loss(quantized_matmul_reference, x))(x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "rows, dim, fmt, dtype",
    [
        (cpu.MAX_ROWS + 1, 64, Q4_1, np.float32),
        (2, 48, INT8, np.float32),
        (2, 80, GGUF_KEPT["Q6_K"], np.float32),
        (2, 64, Q8_0, jnp.bfloat16),
        (2, 96, QuantFormat("int8-g48", "int8", group_size=48), np.float32),
    ],
    ids=[
        "too-many-rows",
        "row-not-whole-groups-of-32",
        "groups-of-16-rows-of-80",
        "bfloat16",
        "groups-of-48",
    ],
)
def test_operands_it_does_not_take_go_to_the_reference(rows, dim, fmt, dtype):
    w = weight(fmt, 8, dim).map(lambda a: np.nan_to_num(a, nan=0.0))
    x = jnp.ones((rows, dim), dtype)
    assert not cpu.supports(x, w)
    with pytest.raises(ValueError, match="quantized-matmul kernel takes float32"):
        cpu.quantized_matmul_cpu(x, w, 0)
    text = jax.jit(lambda x, w: quantized_matmul(x, w, 1)).lower(x, w).as_text()
    assert cpu.TARGET_NAME not in text  # the entry point chose the reference
    np.testing.assert_allclose(
        np.asarray(quantized_matmul(x, w, 1), np.float32),
        np.asarray(quantized_matmul_reference(x, w, 1), np.float32),
    )


def test_the_entry_point_takes_the_kernel_for_a_few_float32_rows():
    assert cpu.KERNEL.load() is None
    w = weight(Q4_0, 8, 64)
    x = jnp.ones((4, 64), jnp.float32)
    text = jax.jit(lambda x, w: quantized_matmul(x, w, 1)).lower(x, w).as_text()
    assert cpu.TARGET_NAME in text
    forced = jax.jit(lambda x, w: quantized_matmul(x, w, 1, impl="reference")).lower(x, w)
    assert cpu.TARGET_NAME not in forced.as_text()


@pytest.mark.parametrize("rows", [1, 4, 7, 16, 40])
def test_several_weights_in_one_call_give_each_ones_own_bits(rows):
    """A layer's q, k, v in one call, each in its own format (GGUF's Q4_K_M mixes them),
    a weight with mins beside ones without: the same bits as a call per weight, and the
    reference's products. 576 x 1536 rows are enough for the call to share work out."""
    formats = (Q4_1, GGUF_KEPT["Q6_K"], Q8_0, FP8, UINT4_GROUPS_OF_64)
    ws = [
        weight(fmt, out, 576, seed=i)
        for i, (fmt, out) in enumerate(zip(formats, (1536, 64, 64, 40, 9)))
    ]
    x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
    together = jax.jit(cpu.quantized_matmuls_cpu)(x, ws, 1)
    assert len(together) == len(ws)
    for w, out in zip(ws, together, strict=True):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(kernel(x, w, 1)))
    entry = jax.jit(lambda x, ws: quantized_matmuls(x, ws, 1))
    assert cpu.TARGET_NAME in entry.lower(x, ws).as_text()
    for out, reference in zip(entry(x, ws), quantized_matmuls(x, ws, 1, impl="reference")):
        # fp8's outputs reach ~700: float32 rounding of the largest, as elsewhere here.
        np.testing.assert_allclose(out, reference, rtol=0, atol=2e-6 * np.abs(reference).max())


# Every 4-bit format a loader makes has mins, whose term (min times x's group sum) carries
# a NaN of x to the output whatever the products do; one without them shows the products'.
UINT4_NO_MINS = QuantFormat("uint4-no-mins", "uint4", group_size=32)
FOUR_BIT = [Q4_1, Q4_0, GGUF_KEPT["Q4_K"], UINT4_GROUPS_OF_64, UINT4_PER_CHANNEL, UINT4_NO_MINS]


def cpu_flags() -> set[str]:
    """This CPU's /proc/cpuinfo flags (none where there is no such file)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))


def integer_x_builds(flags: set[str]) -> bool:
    """Whether a build for a CPU with these /proc/cpuinfo flags multiplies 4-bit weights
    by integer x (integer_x.h): AVX-512 VNNI, or AVX2 and FMA without AVX-512."""
    return {"avx512_vnni", "avx512bw"} <= flags or (
        {"avx2", "fma"} <= flags and "avx512f" not in flags
    )


def check_integer_x(fmt, rows: int, build=cpu.KERNEL, integer_runs: bool | None = None):
    """4-bit weights multiply x as integers where the build can (integer_x.h: each run of
    32 inputs exact to 2^-23 of its largest |x|): float64's result to float32 rounding like
    float x's, with outliers 300x the rest in x; 576 inputs are 4 whole blocks of 4 runs
    and a part. A row holding inf or NaN, or only values below 2^-104, keeps float x: the
    same bits as float x, inf and NaN where those put them. `integer_runs`: whether the
    build has integer products (then their rounding is not float x's)."""
    w = weight(fmt, 100, 576)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    x[:, ::37] *= 300.0

    def run(x, integer_x):
        call = jax.jit(
            lambda x, w: cpu.quantized_matmuls_cpu(x, [w], 1, integer_x=integer_x, kernel=build)
        )
        return np.asarray(call(x, w)[0])

    exact = oracle(x, w, 1)
    scale = np.abs(exact).max()
    integer, floats = run(x, True), run(x, False)
    np.testing.assert_allclose(integer, exact, rtol=0, atol=2e-6 * scale)
    np.testing.assert_allclose(floats, exact, rtol=0, atol=2e-6 * scale)
    if integer_runs:
        assert not np.array_equal(integer, floats)

    # The last row's pass is its own where rows % 4 == 1. A NaN among a run's first 16
    # inputs, where a float maximum would drop it.
    for value, at in ((np.inf, 100), (np.nan, 3)):
        special = x.copy()
        special[-1, at] = value
        np.testing.assert_array_equal(run(special, True)[-1], run(special, False)[-1])
    special = x.copy()
    special[-1] = x[-1] * 1e-38
    tiny = run(special, True)[-1]
    assert (tiny != 0).any()
    np.testing.assert_array_equal(tiny, run(special, False)[-1])


@pytest.mark.parametrize("fmt", FOUR_BIT, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_4_bit_weights_with_integer_x_give_float_xs_result(fmt, rows):
    """`check_integer_x` on the native build (test_avx2_build.py: an AVX2 CPU's build)."""
    check_integer_x(fmt, rows, integer_runs=integer_x_builds(cpu_flags()))


def test_a_layer_outside_the_stack_is_refused():
    w = weight(Q8_0, 4, 32, layers=2)
    x = np.ones((1, 32), np.float32)
    for layer in (2, -1):
        with pytest.raises(RUN_TIME_REFUSAL, match=f"layer {layer} is outside the 2 layers"):
            np.asarray(kernel(x, w, layer))


def test_the_target_refuses_what_it_cannot_read():
    """Called directly (past `supports`), cpu.cc checks the operands itself."""
    assert cpu.KERNEL.load() is None
    w = weight(Q4_1, 4, 64)
    call = jax.ffi.ffi_call(cpu.TARGET_NAME, jax.ShapeDtypeStruct((2, 4), jnp.float32))
    layer = jnp.ones((1,), jnp.int32)
    x = jnp.ones((2, 64), jnp.float32)

    def run(x, values, scales, mins, kind=1):
        attributes = dict(kinds=np.array([kind]), has_mins=np.array([1]), integer_x=np.int64(1))
        return np.asarray(
            jax.jit(lambda *a: call(*a, **attributes))(x, layer, values, scales, mins)
        )

    with pytest.raises(RUN_TIME_REFUSAL, match="x's D must match"):
        run(x[:, :32], w.values, w.scales, w.mins)
    with pytest.raises(RUN_TIME_REFUSAL, match="values must be int8"):
        run(x, w.values, w.scales, w.mins, kind=0)
    with pytest.raises(RUN_TIME_REFUSAL, match="mins must be shaped like scales"):
        run(x, w.values, w.scales, w.mins[:, :2])
    with pytest.raises(RUN_TIME_REFUSAL, match="mins must be shaped like scales, of their"):
        run(x, w.values, w.scales, w.mins.astype(jnp.float32))
    with pytest.raises(RUN_TIME_REFUSAL, match="scales must be float32 or float16"):
        run(x, w.values, w.scales.astype(jnp.bfloat16), w.mins.astype(jnp.bfloat16))
    with pytest.raises(RUN_TIME_REFUSAL, match="each weight needs values, scales, mins"):
        np.asarray(
            jax.jit(lambda *a: call(*a, kinds=np.array([1]), has_mins=np.array([1]), integer_x=1))(
                x, layer, w.values, w.scales
            )
        )


@pytest.mark.parametrize("dim, groups", [(96, 3), (80, 1)], ids=["groups-of-32", "per-row"])
def test_a_float_weight_quantized_to_int8_stays_close(dim, groups):
    """`--quantization int8`: symmetric per group of 32 inputs (per row where a row is not
    whole groups), round to nearest."""
    from jengine.models.quantize import method_format, quantize

    fmt = method_format("int8", dim)
    rng = np.random.default_rng(4)
    dense = rng.standard_normal((2, 40, dim)).astype(np.float32)
    dense[0, 3] = 0.0  # an all-zero row keeps a usable scale
    arrays = quantize(dense, fmt)
    w = QuantizedWeight(arrays["values"], arrays["scales"], None, fmt)
    assert arrays["values"].dtype == np.int8 and arrays["scales"].shape == (2, 40, groups)
    assert np.abs(arrays["values"]).max() == 127
    blocks = dense.reshape(2, 40, groups, -1)
    step = np.repeat(np.abs(blocks).max(axis=-1) / 127, dim // groups, axis=-1)
    assert (np.abs(np.asarray(dequantize(w)) - dense) <= step / 2 + 1e-7).all()
    assert (np.asarray(dequantize(w))[0, 3] == 0).all()


def test_fp8_bits_widen_exactly_nan_included():
    """Every float8 e4m3fn bit pattern, NaN and subnormals included, through the kernel:
    the same values as XLA's conversion (a one-hot x picks each weight out)."""
    bits = np.arange(256, dtype=np.uint8).reshape(8, 32)
    w = QuantizedWeight(
        bits.view(jnp.float8_e4m3fn)[None], np.ones((1, 8, 1), np.float32), None, FP8
    )
    x = np.eye(32, dtype=np.float32)[:16]  # rows 0-15 pick inputs 0-15, a second call 16-31
    ours = np.concatenate([np.asarray(kernel(x, w, 0)), np.asarray(kernel(x[:, ::-1], w, 0))])
    expected = bits.view(jnp.float8_e4m3fn).astype(np.float32)
    picked = np.concatenate([expected[:, :16], expected[:, 16:][:, ::-1]], axis=1).T
    # A NaN weight makes its whole row NaN (0 * NaN); the other rows are exact.
    nan_rows = np.isnan(expected).any(axis=1)
    assert nan_rows.sum() == 2 and np.isnan(ours[:, nan_rows]).all()
    np.testing.assert_array_equal(ours[:, ~nan_rows], picked[:, ~nan_rows])


def test_a_float_weight_quantized_to_fp8_stays_close():
    from jengine.models.quantize import quantize

    dense = np.random.default_rng(5).standard_normal((3, 24, 64)).astype(np.float32)
    arrays = quantize(dense, FP8)
    assert arrays["values"].dtype == jnp.float8_e4m3fn
    assert np.abs(arrays["values"].astype(np.float32)).max() == 448.0
    w = QuantizedWeight(arrays["values"], arrays["scales"], None, FP8)
    scale = arrays["scales"]
    # e4m3: 3 mantissa bits (half a step: 1/16 relative); subnormal steps of 2^-9 * scale.
    bound = np.maximum(np.abs(dense) / 16, scale * 2.0**-10) + 1e-7
    assert (np.abs(np.asarray(dequantize(w)) - dense) <= bound).all()


def test_formats_check_their_groups():
    with pytest.raises(ValueError, match="uint4 groups are multiples of 32"):
        QuantFormat("bad", "uint4", group_size=48)
    with pytest.raises(ValueError, match="not whole groups of 48"):
        UINT4_PER_CHANNEL.shapes((4,), 48)
    with pytest.raises(ValueError, match="not whole groups of 32"):
        Q4_1.shapes((4,), 48)
    with pytest.raises(ValueError, match="groups are multiples of 16"):
        QuantFormat("bad", "int8", group_size=24)
    with pytest.raises(ValueError, match="scale dtype 'bfloat16'"):
        QuantFormat("bad", "int8", group_size=32, scale_dtype="bfloat16")
    # Q4_1 as in the file: 16 bytes of nibbles and two float16s a block of 32.
    assert Q4_1.bytes_per_weight(64) == 0.5 + 4 / 32
    assert dataclasses.replace(Q4_1, scale_dtype="float32").bytes_per_weight(64) == 0.5 + 8 / 32


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize(
    "fmt", [INT8, UINT4_GROUPS_OF_64, *GGUF_KEPT.values()], ids=lambda f: f.name
)
def test_the_reference_lowers_for_gpu_and_tpu_under_a_layer_scan(platform, fmt):
    """On GPU and TPU the quantized weights go through the reference (XLA fuses the
    dequantization into the dot's operand): it lowers for both at a Llama-3-8B layer's
    shape, bfloat16 activations, abstract weights (nothing allocated)."""
    layers, rows, dim, outputs = 32, 256, 4096, 14336
    arrays = {
        name: jax.ShapeDtypeStruct(shape, dtype)
        for name, (shape, dtype) in fmt.shapes((layers, outputs), dim).items()
    }
    w = QuantizedWeight(arrays["values"], arrays["scales"], arrays.get("mins"), fmt)
    x = jax.ShapeDtypeStruct((rows, dim), jnp.bfloat16)

    def model(x, w):
        def layer(h, index):
            out = quantized_matmul(h, w, index, impl="reference")
            return h + out[:, :dim], None

        return jax.lax.scan(layer, x, jnp.arange(layers))[0]

    text = jax.jit(model).trace(x, w).lower(lowering_platforms=(platform,)).as_text()
    assert "custom_call @jengine" not in text and "dot_general" in text
