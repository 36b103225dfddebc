"""Kernels for jengine; each kernel ships beside its pure-jnp reference: ragged paged
attention, and `x @ w[layer].T` over layer-stacked weights, float or quantized."""

import jax

from jengine.pallas_kernels import ragged_paged_attention as _attention
from jengine.pallas_kernels.quantized_matmul import cpu as _quantized_matmul_cpu
from jengine.pallas_kernels.quantized_matmul import quantized_matmul, quantized_matmuls
from jengine.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
    update_kv_cache,
)
from jengine.pallas_kernels.stacked_matmul import cpu as _stacked_matmul_cpu
from jengine.pallas_kernels.stacked_matmul import stacked_matmul, stacked_matmuls


def prepare(attention_impl: str | None = None, backend: str | None = None) -> None:
    """Get the kernels a start-up will use ready without waiting: on CPU their C++ builds
    (seconds each, the first time on a machine) start in the background, beside imports
    and weight loading."""
    _attention.prepare(attention_impl, backend)
    if (backend or jax.default_backend()) == "cpu":
        _stacked_matmul_cpu.KERNEL.load_in_background()
        _quantized_matmul_cpu.KERNEL.load_in_background()


__all__ = [
    "prepare",
    "ragged_paged_attention",
    "quantized_matmul",
    "quantized_matmuls",
    "ragged_paged_attention_reference",
    "stacked_matmul",
    "stacked_matmuls",
    "update_kv_cache",
]
