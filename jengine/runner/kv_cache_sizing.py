"""How many KV cache blocks fit in a memory budget, and the capacity line the engine logs.

Where it sits: `ModelRunner.__init__` builds a `KVCacheSizing` from the model's KV cache
shape, picks a budget (`kv_cache_memory_bytes`, else `default_kv_budget`) unless the
config fixed `num_gpu_blocks`, allocates `blocks_from_budget(budget)` blocks and reports
`capacity_report(num_blocks)`; `EngineCore` logs that line and hands it to the front end.
The scheduler's block pool then has exactly that many blocks. No jax arrays are made here.
`weights_report` is the line beside it on the weights: their resident bytes and, quantized,
what the saving buys in KV-cache tokens.

Promises:
- the cache's element type is `kv_cache_dtype_of(name, model dtype)`: the model's for "auto",
  else what vLLM's `--kv-cache-dtype` name says;
- a block is one page of every layer's K and V: `bytes_per_block` is the size of
  `kv_cache_shape(1, block_size)` in the cache dtype;
- a budget too small for one request of `max_model_len` plus the null block 0 is an error
  that says which knob to turn, never a cache that cannot serve a single request;
- on CPU the default budget is `CPU_DEFAULT_KV_BYTES`; on an accelerator it is
  `gpu_memory_utilization` of the device's memory limit minus the weights and headroom for
  the largest step's activations (also `CPU_DEFAULT_KV_BYTES` when the device reports no
  limit);
- the report counts usable blocks (the null block excluded) as tokens and as how many
  requests of `max_model_len` fit at once.
"""

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

CPU_DEFAULT_KV_BYTES = 1 << 30
# vLLM's --kv-cache-dtype names (jengine/config.py's KV_CACHE_DTYPE_CHOICES but "auto").
KV_CACHE_DTYPES = {
    "bfloat16": jnp.bfloat16,
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}


def kv_cache_dtype_of(name: str, model_dtype) -> jnp.dtype:
    """The KV cache's element type for a `--kv-cache-dtype` name ("auto": the model's)."""
    return jnp.dtype(model_dtype if name == "auto" else KV_CACHE_DTYPES[name])


@dataclass(frozen=True)
class KVCacheSizing:
    block_size: int
    bytes_per_block: int
    max_model_len: int
    max_pages: int  # pages of one request of max_model_len
    num_shards: int = 1  # devices the cache is split over (tensor parallel)
    dtype: jnp.dtype = jnp.dtype(jnp.float32)  # the cache's element type

    @classmethod
    def create(
        cls,
        kv_cache_shape: Callable[[int, int], tuple[int, ...]],
        model_dtype,
        *,
        block_size: int,
        max_model_len: int,
        max_pages: int,
        num_shards: int = 1,
        kv_cache_dtype: str = "auto",
    ) -> "KVCacheSizing":
        """`kv_cache_shape(num_blocks, block_size)` is the model's cache shape, its elements
        `kv_cache_dtype_of(kv_cache_dtype, model_dtype)`; with tensor parallelism it is split
        `num_shards` ways and every figure here is per device."""
        shape = kv_cache_shape(1, block_size)
        dtype = kv_cache_dtype_of(kv_cache_dtype, model_dtype)
        bytes_per_block = int(np.prod(shape)) * dtype.itemsize // num_shards
        return cls(block_size, bytes_per_block, max_model_len, max_pages, num_shards, dtype)

    def blocks_from_budget(self, kv_cache_memory_bytes: int) -> int:
        num_blocks = kv_cache_memory_bytes // self.bytes_per_block
        pages = self.max_pages
        if num_blocks < pages + 1:
            raise ValueError(
                f"a KV cache budget of {kv_cache_memory_bytes} bytes holds {num_blocks} "
                f"blocks; one request of max_model_len={self.max_model_len} needs {pages} "
                "plus the null block: raise kv_cache_memory_bytes or lower max_model_len"
            )
        return int(num_blocks)

    def capacity_report(self, num_blocks: int) -> str:
        tokens = (num_blocks - 1) * self.block_size
        size = _size(num_blocks * self.bytes_per_block)
        where = f" on each of {self.num_shards} devices" if self.num_shards > 1 else ""
        return (
            f"KV cache: {num_blocks - 1} blocks x {self.block_size} tokens = {tokens} "
            f"tokens of {self.dtype.name} ({size}{where}); max concurrency at "
            f"max_model_len={self.max_model_len}: {tokens / self.max_model_len:.2f}x"
        )


def default_kv_budget(
    device: jax.Device,
    params,
    *,
    max_num_batched_tokens: int,
    vocab_size: int,
    gpu_memory_utilization: float,
) -> int:
    """Bytes for the KV cache when the config names none (see the module promises)."""
    if device.platform == "cpu":
        return CPU_DEFAULT_KV_BYTES
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return CPU_DEFAULT_KV_BYTES
    weights = sum(  # this device's share (all of it without tensor parallelism)
        shard.data.nbytes
        for x in jax.tree.leaves(params)
        for shard in x.addressable_shards
        if shard.device == device
    )
    # Headroom for the largest step's activations, dominated by its f32 logits.
    activations = 4 * max_num_batched_tokens * vocab_size * 4
    return max(0, int(limit * gpu_memory_utilization) - weights - activations)


def weight_bytes(params: dict, dtype) -> tuple[int, int]:
    """(resident bytes, bytes in `dtype` unquantized) of a pure params dict."""

    def dense_bytes(tree) -> int:
        if isinstance(tree, dict) and "values" in tree:  # a quantized weight
            values = tree["values"]
            per_byte = 2 if values.dtype == jnp.uint8 else 1  # uint4: two to a byte
            return values.size * per_byte * jnp.dtype(dtype).itemsize
        if isinstance(tree, dict):
            return sum(dense_bytes(child) for child in tree.values())
        return tree.nbytes

    return sum(leaf.nbytes for leaf in jax.tree.leaves(params)), dense_bytes(params)


def weights_report(params: dict, config, dtype, sizing: KVCacheSizing) -> str:
    """The weights' resident bytes (a pure params dict); with quantized weights also their
    formats and the KV-cache tokens that the bytes saved against `dtype` weights hold."""
    resident, dense = weight_bytes(params, dtype)
    text = f"weights: {_size(resident)} resident"
    if not config.quantization:
        return text
    formats: dict[str, list[str]] = {}
    for name, fmt in config.quantization:
        formats.setdefault(fmt.name, []).append(name)
    held = "; ".join(f"{fmt}: {', '.join(names)}" for fmt, names in formats.items())
    saved = dense - resident
    # Both per device: the weights' saving (global here) and a block (per shard).
    tokens = saved // (sizing.bytes_per_block * sizing.num_shards) * sizing.block_size
    name = jnp.dtype(dtype).name
    return (
        f"{text}, quantized ({held}; the rest {name}), against {_size(dense)} in {name}: "
        f"the {_size(saved)} saved hold {tokens} KV-cache tokens"
    )


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
