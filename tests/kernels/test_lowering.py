"""Both Pallas kernels lower for their real backends on a CPU-only machine.

No GPU or TPU is attached to the development machines, so this is how the kernels are
known to get through the Triton (`cuda`) and Mosaic (`tpu`) lowerings at production shapes:
`jax.jit(f).trace(*args).lower(lowering_platforms=(platform,))` with abstract inputs (no
memory is allocated, so the cache can be as large as on a real device). What the backends'
compilers do after that (Triton to PTX, Mosaic layout passes) is out of reach here.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jengine.pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from jengine.pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

KERNELS = {
    "cuda": (ragged_paged_attention_gpu, "__gpu$xla.gpu.triton"),
    "tpu": (ragged_paged_attention_tpu, "tpu_custom_call"),
}

# A Llama-3-8B-like layer: 32 q heads over 8 kv heads of 128, 512 scheduled tokens of up to
# 64 requests with up to 2048 tokens of context in pages of 16.
NUM_TOKENS, NUM_REQUESTS, PAGES_PER_REQUEST = 512, 64, 128
NUM_LAYERS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 32, 8, 128, 16


def _abstract_args(dtype, num_pages, cache_dtype=None):
    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    cache_shape = (NUM_LAYERS, 2, NUM_KV_HEADS, num_pages, BLOCK_SIZE, HEAD_DIM)
    return (
        jax.ShapeDtypeStruct((NUM_TOKENS, NUM_Q_HEADS, HEAD_DIM), dtype),
        jax.ShapeDtypeStruct(cache_shape, cache_dtype or dtype),
        i32(),  # layer: traced, as in a scan over layers
        i32(NUM_REQUESTS),
        i32(NUM_REQUESTS, PAGES_PER_REQUEST),
        i32(NUM_REQUESTS + 1),
    )


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(
    "q_block_size, sliding_window, num_pages",
    [
        (16, None, 512),  # a 1 GiB (bf16) cache: 32-bit offsets in the Triton kernel
        (1, 1024, 512),  # decode blocks, sliding window
        (16, None, 20_000),  # a 42 GiB (bf16) cache: over 2**32 bytes, 64-bit offsets
    ],
)
def test_kernel_lowers(platform, dtype, q_block_size, sliding_window, num_pages):
    kernel, custom_call = KERNELS[platform]
    f = functools.partial(
        kernel, sm_scale=HEAD_DIM**-0.5, q_block_size=q_block_size, sliding_window=sliding_window
    )
    lowered = jax.jit(f).trace(*_abstract_args(dtype, num_pages))
    lowered = lowered.lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    assert custom_call in set(re.findall(r"custom_call @([\w$.]+)", text))


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_kernel_lowers_with_an_fp8_cache(platform, cache_dtype, dtype):
    """--kv-cache-dtype fp8: a one-byte cache (20,000 pages: 1.3 GiB) beside bf16 or f32
    queries."""
    kernel, custom_call = KERNELS[platform]
    f = functools.partial(kernel, sm_scale=HEAD_DIM**-0.5, q_block_size=16)
    traced = jax.jit(f).trace(*_abstract_args(dtype, 20_000, cache_dtype))
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert custom_call in set(re.findall(r"custom_call @([\w$.]+)", text))


@pytest.mark.parametrize("platform", sorted(KERNELS))
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_kernel_lowers_inside_a_layer_scan(platform, gemma):
    """The model calls attention inside a scan over layers with the stacked cache; Gemma's
    layers pass each its own window (traced: local layers 4096, global 0) and soft-cap."""
    kernel, custom_call = KERNELS[platform]
    args = _abstract_args(jnp.bfloat16, 4096)
    windows = jnp.where(jnp.arange(NUM_LAYERS) % 2 == 0, 4096, 0).astype(jnp.int32)

    def model(q, kv_cache, kv_lens, block_tables, query_start_loc):
        def layer_step(x, xs):
            layer, window = xs
            gemma_args = dict(sliding_window=window, soft_cap=50.0) if gemma else {}
            out = kernel(
                x,
                kv_cache,
                layer,
                kv_lens,
                block_tables,
                query_start_loc,
                sm_scale=0.1,
                **gemma_args,
            )
            return out, None

        return jax.lax.scan(layer_step, q, (jnp.arange(NUM_LAYERS), windows))[0]

    traced = jax.jit(model).trace(args[0], args[1], *args[3:])
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert custom_call in text
