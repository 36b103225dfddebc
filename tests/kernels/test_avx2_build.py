"""The CPU kernels as a CPU without AVX-512 builds them, on whatever x86 CPU runs the
suite: each built again with `-mno-avx512f` (no AVX-512 of any kind) under a target of its
own, then held to the float64 oracle and the XLA reference as the native build is
(test_quantized_matmul.py, test_stacked_matmul.py, test_cpu_kernel.py). On such a CPU the
kernels take other paths (`panel.h` in 8 lanes, `quantized_matmul/avx2_dots.h`, the
attention's scores in fewer keys at a time), which an AVX-512 machine's native build never
compiles; they once ran ~10x slower than they should and only a speed
measurement showed it, so the speed of the AVX2 build is checked too."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.pallas_kernels.native_build import NativeKernel
from jengine.pallas_kernels.quantized_matmul import cpu as quantized_cpu
from jengine.pallas_kernels.quantized_matmul import quantized_matmul_reference
from jengine.pallas_kernels.ragged_paged_attention import cpu as attention_cpu
from jengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from jengine.pallas_kernels.stacked_matmul import cpu as stacked_cpu
from jengine.pallas_kernels.stacked_matmul import stacked_matmul_reference
from tests.kernels.test_cpu_kernel import CASES, assert_every_fp8_value_widens_exactly, case_batch
from tests.kernels.test_quantized_matmul import (
    FORMATS,
    FOUR_BIT,
    Q4_1,
    check_integer_x,
    cpu_flags,
    oracle,
    weight,
)

pytestmark = pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="an x86 CPU with AVX2, FMA and F16C"
)


def _avx2_build(module, f16c: bool = True) -> NativeKernel:
    native = module.KERNEL
    suffix = "" if f16c else "_no_f16c"
    kernel = NativeKernel(
        native.source,
        native.symbol,
        target=f"{native.target}_avx2{suffix}",
        what=f"{native.what} (AVX2 build{'' if f16c else ', no F16C'})",
        extra_flags=("-mno-avx512f",) if f16c else ("-mno-avx512f", "-mno-f16c"),
    )
    assert kernel.load() is None, kernel.load()
    return kernel


@pytest.fixture(scope="module")
def quantized_avx2():
    return _avx2_build(quantized_cpu)


@pytest.fixture(scope="module")
def stacked_avx2():
    return _avx2_build(stacked_cpu)


@pytest.fixture(scope="module")
def attention_avx2():
    return _avx2_build(attention_cpu)


@pytest.fixture(scope="module")
def attention_without_f16c():
    """Widens fp8 pages in its own integer and float operations, as a CPU without F16C
    (not x86) builds the kernel; with F16C it takes the half-to-single conversion."""
    return _avx2_build(attention_cpu, f16c=False)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(
    "rows, dim, outputs",
    # Row by row (1-16 rows, passes of several rows and their remainders), then panels.
    [(1, 576, 67), (2, 64, 17), (3, 128, 7), (5, 192, 33), (16, 256, 40), (33, 320, 45)],
)
def test_quantized_avx2_build_matches_reference_and_float64(
    quantized_avx2, fmt, rows, dim, outputs
):
    w = weight(fmt, outputs, dim)
    x = np.random.default_rng(1).standard_normal((rows, dim)).astype(np.float32)
    ours = np.asarray(quantized_cpu.quantized_matmul_cpu(x, w, 1, kernel=quantized_avx2))
    assert np.isfinite(ours).all()  # nothing read from the NaN layers
    scale = np.abs(oracle(x, w, 1)).max()
    np.testing.assert_allclose(ours, oracle(x, w, 1), rtol=0, atol=2e-6 * scale)
    reference = quantized_matmul_reference(x, w, 1)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-6 * scale)


@pytest.mark.parametrize("fmt", FOUR_BIT, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_quantized_avx2_build_multiplies_4_bit_weights_by_integer_x(quantized_avx2, fmt, rows):
    check_integer_x(fmt, rows, quantized_avx2, integer_runs=True)


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40, 128])
def test_stacked_avx2_build_matches_reference_and_float64(stacked_avx2, rows):
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((3, 45, 136)).astype(np.float32)
    w[[0, 2]] = np.nan  # only w[1] may be read
    x = rng.standard_normal((rows, 136)).astype(np.float32)
    ours = np.asarray(stacked_cpu.stacked_matmul_cpu(x, w, 1, kernel=stacked_avx2))
    exact = x.astype(np.float64) @ w[1].T.astype(np.float64)
    np.testing.assert_allclose(ours, exact, rtol=1e-5, atol=2e-5 * 136**0.5)
    np.testing.assert_allclose(ours, stacked_matmul_reference(x, w, 1), rtol=1e-5, atol=1e-4)


def test_avx2_builds_are_not_slower_than_xla(quantized_avx2, stacked_avx2):
    """A prefill-sized product (64 rows: panels) through each AVX2 build against XLA's own
    dot of the same float weights, the three alternated so a busy machine slows each alike.
    The slow float32 build took 13x XLA's time on an AVX2 CPU; the fixed builds take less
    than XLA's there (bench/README.md). On an AVX-512 CPU XLA's dot uses all 16 lanes
    (~200 GFLOP/s against the AVX2 build's 8), so the bound is 4x."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 512)), jnp.float32)
    dense = jnp.asarray(np.random.default_rng(1).standard_normal((2, 1536, 512)), jnp.float32)
    q4 = jax.device_put(weight(Q4_1, 1536, 512, layers=2, layer=1))
    runs = {
        "xla": (jax.jit(lambda x, w: x @ w[1].T), dense),
        "stacked": (
            jax.jit(lambda x, w: stacked_cpu.stacked_matmul_cpu(x, w, 1, kernel=stacked_avx2)),
            dense,
        ),
        "quantized": (
            jax.jit(
                lambda x, w: quantized_cpu.quantized_matmul_cpu(x, w, 1, kernel=quantized_avx2)
            ),
            q4,
        ),
    }
    times = {name: [] for name in runs}
    for turn in range(16):
        for name, (run, w) in runs.items():
            started = time.perf_counter()
            jax.block_until_ready(run(x, w))
            if turn:  # the first call compiles
                times[name].append(time.perf_counter() - started)
    median = {name: float(np.median(t)) for name, t in times.items()}
    assert median["stacked"] < 4 * median["xla"], median
    assert median["quantized"] < 4 * median["xla"], median


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention_avx2_build_matches_the_oracle(attention_avx2, oracle, case):
    """Decode items of 1-7 rows score 8, 4 or 2 keys at a time in 16 registers (`oracle`: the
    attention oracle of conftest.py, a fixture, not the matmul one imported above)."""
    batch, kwargs = case_batch(case)
    out = np.asarray(
        attention_cpu.ragged_paged_attention_cpu(*batch.args, **kwargs, kernel=attention_avx2)
    )
    assert np.isfinite(out).all(), "the AVX2 build read a NaN slot it should have skipped"
    np.testing.assert_allclose(out, oracle(batch, **kwargs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["bf16", "e4m3", "e5m2"]
)
@pytest.mark.parametrize("f16c", [True, False], ids=["f16c", "no-f16c"])
def test_attention_avx2_build_reads_narrow_caches(
    attention_avx2, attention_without_f16c, cache_dtype, f16c
):
    """The widening of bf16 and fp8 pages, compiled for AVX2 with and without F16C
    (`reference`: the XLA reference over the same narrow cache); every fp8 byte pattern
    widens exactly."""
    build = attention_avx2 if f16c else attention_without_f16c
    batch, kwargs = case_batch(CASES[6])
    batch = batch._replace(kv_cache=batch.kv_cache.astype(cache_dtype))
    out = np.asarray(attention_cpu.ragged_paged_attention_cpu(*batch.args, **kwargs, kernel=build))
    assert np.isfinite(out).all()
    expected = ragged_paged_attention_reference(*batch.args, **kwargs)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    if cache_dtype != jnp.bfloat16:
        assert_every_fp8_value_widens_exactly(cache_dtype, kernel=build)
