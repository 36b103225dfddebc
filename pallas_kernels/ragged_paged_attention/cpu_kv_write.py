"""Writing a step's keys and values into a narrow KV cache on CPU: the C++ kernel in
`cpu_kv_write.cc`, called through the XLA FFI with the cache as its aliased result.

Where it sits: `update_kv_cache` (the package's entry point) takes it on the CPU backend
for caches narrower than float32 (bfloat16, float16, fp8: `--dtype bfloat16`,
`--kv-cache-dtype fp8`); `reference.update_kv_cache`, XLA's scatter, stays the oracle it is
tested against and what writes float32 caches and every cache on GPU and TPU.

Why: XLA:CPU scatters no bfloat16 or fp8 buffer in place. It widens the whole cache to a
type it computes in, scatters, and narrows it back, so each layer of each step copied the
entire cache twice (1 GiB of fp8 cache: ~0.9 s a layer; bench/README.md). The kernel copies
the new values, cast to the cache's type by XLA beforehand, into their slots.

It promises the reference's result: the same slots written with the same values (the
reference's saturating cast to fp8 included), slots outside the cache and a layer outside
it writing nothing. No compiler, or a failed build, leaves the reference in charge, with
the build's warning.
"""

from pathlib import Path

import jax
import jax.numpy as jnp

from jengine.pallas_kernels.native_build import NativeKernel
from jengine.pallas_kernels.ragged_paged_attention.reference import to_cache_dtype

KERNEL = NativeKernel(
    Path(__file__).with_name("cpu_kv_write.cc"),
    symbol="JengineWriteKV",
    target="jengine_kv_cache_write",
    what="CPU KV-cache write kernel",
)


def wanted(kv_cache) -> bool:
    """Whether this cache is one XLA:CPU would widen whole to scatter into."""
    return jax.default_backend() == "cpu" and jnp.dtype(kv_cache.dtype).itemsize < 4


def update_kv_cache_cpu(
    kv_cache: jax.Array, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """See `reference.update_kv_cache`: the same write, in place."""
    KERNEL.require()
    new = to_cache_dtype(jnp.stack([k, v], axis=1), kv_cache.dtype)  # [T, 2, K, H]
    call = jax.ffi.ffi_call(
        KERNEL.target,
        jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={0: 0},
    )
    return call(
        kv_cache,
        new,
        jnp.asarray(layer, jnp.int32).reshape(()),
        slot_mapping.astype(jnp.int32),
    )
