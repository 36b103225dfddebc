"""Attention kernels for jengine; each kernel ships beside its pure-jnp reference."""

from jengine.pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
    update_kv_cache,
)

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "update_kv_cache"]
