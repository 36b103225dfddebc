"""The in-place KV-cache write for narrow caches on CPU (`cpu_kv_write`): the reference's
scatter, byte for byte, without the two whole-cache copies XLA:CPU makes to scatter into
a bfloat16 or fp8 buffer.

`update_kv_cache` (the entry point the models call) takes the C++ write for every cache
narrower than float32 on this CPU backend; each case compares it with
`reference.update_kv_cache` on the same inputs, including the slots the reference drops or
wraps (out of range, negative) and a write inside a scan over layers, as the models make
it. The compiled program is checked for what made the scatter slow: a widened copy of the
cache.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.pallas_kernels import update_kv_cache
from jengine.pallas_kernels.ragged_paged_attention import cpu_kv_write
from jengine.pallas_kernels.ragged_paged_attention.reference import (
    update_kv_cache as reference_write,
)

NARROW = [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]
IDS = ["bf16", "f16", "e4m3", "e5m2"]
# [L, 2, K, pages, S, H]
SHAPE = (3, 2, 2, 6, 4, 8)


def _as_float(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    cache = jnp.asarray(rng.standard_normal(SHAPE) * 3, jnp.float32).astype(dtype)
    # Large values too: an fp8 cache saturates them.
    k = jnp.asarray(rng.standard_normal((6, SHAPE[2], SHAPE[5])) * 200, jnp.float32)
    v = jnp.asarray(rng.standard_normal((6, SHAPE[2], SHAPE[5])), jnp.float32)
    pages, block = SHAPE[3], SHAPE[4]
    # Two slots of page 3, the null page's slot 0, the last slot, one past the cache
    # (dropped), and -5 (page -1 wraps to the last page, as jnp indexing does).
    slots = jnp.array([3 * block + 1, 3 * block + 2, 0, pages * block - 1, pages * block, -5])
    return cache, k, v, slots.astype(jnp.int32)


@pytest.mark.parametrize("dtype", NARROW, ids=IDS)
@pytest.mark.parametrize("layer", [1, -1, 7])
def test_the_write_is_the_references(dtype, layer):
    assert cpu_kv_write.wanted(jnp.zeros((), dtype)) and cpu_kv_write.KERNEL.load() is None
    cache, k, v, slots = _inputs(dtype)
    expected = jax.jit(reference_write)(cache, jnp.int32(layer), k, v, slots)
    out = jax.jit(update_kv_cache, donate_argnums=0)(cache.copy(), jnp.int32(layer), k, v, slots)
    assert out.dtype == dtype and out.shape == SHAPE
    np.testing.assert_array_equal(_as_float(out), _as_float(expected))
    assert np.isfinite(_as_float(out)).all()  # fp8: saturated, not NaN or infinite


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_writes_inside_a_layer_scan_and_no_widened_cache(dtype):
    """Each layer of a scan writes its own slots (the models' pattern: the cache is the
    carry, donated), and the compiled program holds no float16/float32 copy of the cache."""
    cache, k, v, slots = _inputs(dtype, seed=1)
    ks = jnp.stack([k * (i + 1) for i in range(SHAPE[0])])

    def all_layers(write, cache, ks):
        def layer_step(cache, xs):
            layer, k_layer = xs
            return write(cache, layer, k_layer, -k_layer, slots), None

        return jax.lax.scan(layer_step, cache, (jnp.arange(SHAPE[0]), ks))[0]

    expected = jax.jit(lambda c, ks: all_layers(reference_write, c, ks))(cache, ks)
    ours = jax.jit(lambda c, ks: all_layers(update_kv_cache, c, ks), donate_argnums=0)
    compiled = ours.lower(cache, ks).compile().as_text()
    widened = re.findall(r"\b(?:f16|f32)\[" + ",".join(map(str, SHAPE)) + r"\]", compiled)
    assert not widened, "the program widens the whole cache"
    np.testing.assert_array_equal(_as_float(ours(cache.copy(), ks)), _as_float(expected))


def test_float32_caches_keep_xla_scatter():
    """XLA:CPU scatters float32 in place already: those writes stay the reference's."""
    assert not cpu_kv_write.wanted(jnp.zeros((), jnp.float32))
