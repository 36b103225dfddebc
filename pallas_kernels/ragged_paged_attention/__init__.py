"""One entry point for ragged paged attention that picks the implementation by backend.

On CPU the fused C++ kernel (`cpu`, through the XLA FFI) where it builds, else the XLA
`reference`; the Pallas GPU kernel on CUDA/ROCm; the Pallas TPU kernel on TPU.
`impl=` or the `JENGINE_ATTENTION_IMPL` environment variable forces one of
"reference", "cpu", "gpu", "tpu"; `interpret=True` runs a Pallas kernel in the interpreter
(how they are tested on a CPU-only machine). "cpu" hands what the kernel does not take
(float32 queries, a float32/bf16/fp8 cache, head and page sizes multiples of 8) to the
reference. `update_kv_cache`
writes a step's keys and values: XLA's scatter, or on CPU for a cache narrower than float32
the in-place C++ write (`cpu_kv_write`).
"""

import os

import jax

from jengine.pallas_kernels.ragged_paged_attention import cpu, cpu_kv_write
from jengine.pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
)
from jengine.pallas_kernels.ragged_paged_attention.reference import (
    update_kv_cache as update_kv_cache_reference,
)

IMPLEMENTATIONS = ("reference", "cpu", "gpu", "tpu")


def default_impl(backend: str | None = None) -> str:
    forced = os.environ.get("JENGINE_ATTENTION_IMPL")
    if forced:
        if forced not in IMPLEMENTATIONS:
            raise ValueError(
                f"JENGINE_ATTENTION_IMPL={forced!r}; expected one of {IMPLEMENTATIONS}"
            )
        return forced
    backend = backend or jax.default_backend()
    if backend == "cpu":
        return "cpu" if cpu.load() is None else "reference"
    return {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(backend, "reference")


def resolve_impl(impl: str | None, q, kv_cache, backend: str | None = None) -> str:
    """The implementation that runs for operands shaped like `q` and `kv_cache` (arrays or
    `jax.ShapeDtypeStruct`s): `impl` or the backend's default, with what the CPU kernel
    does not take handed to the reference."""
    impl = impl or default_impl(backend)
    if impl == "cpu" and not cpu.supports(q, kv_cache):
        return "reference"
    return impl


def prepare(impl: str | None, backend: str | None = None) -> None:
    """Get ready to run `impl` (or the backend's default) without waiting: the CPU kernel
    starts building in the background."""
    if (impl or default_impl(backend)) == "cpu":
        cpu.load_in_background()


def update_kv_cache(kv_cache, layer, k, v, slot_mapping):
    """See `reference.update_kv_cache`. On CPU a cache narrower than float32 is written in
    place by `cpu_kv_write` (XLA:CPU would copy all of it to scatter), where it builds."""
    if cpu_kv_write.wanted(kv_cache) and cpu_kv_write.KERNEL.load() is None:
        return cpu_kv_write.update_kv_cache_cpu(kv_cache, layer, k, v, slot_mapping)
    return update_kv_cache_reference(kv_cache, layer, k, v, slot_mapping)


def ragged_paged_attention(
    q,
    kv_cache,
    layer,
    kv_lens,
    block_tables,
    query_start_loc,
    *,
    sm_scale: float,
    q_block_size: int = 16,
    sliding_window=None,
    soft_cap: float | None = None,
    impl: str | None = None,
    interpret: bool = False,
):
    """See `reference.ragged_paged_attention_reference` for the arguments and promises."""
    impl = resolve_impl(impl, q, kv_cache)
    kwargs = dict(
        sm_scale=sm_scale,
        q_block_size=q_block_size,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    args = (q, kv_cache, layer, kv_lens, block_tables, query_start_loc)
    if impl == "reference":
        return ragged_paged_attention_reference(*args, **kwargs)
    if impl == "cpu":
        return cpu.ragged_paged_attention_cpu(*args, **kwargs)
    if impl == "gpu":
        from jengine.pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu

        return ragged_paged_attention_gpu(*args, **kwargs, interpret=interpret)
    if impl == "tpu":
        from jengine.pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(*args, **kwargs, interpret=interpret)
    raise ValueError(f"unknown attention implementation {impl!r}; expected {IMPLEMENTATIONS}")


__all__ = [
    "IMPLEMENTATIONS",
    "default_impl",
    "resolve_impl",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "update_kv_cache",
]
