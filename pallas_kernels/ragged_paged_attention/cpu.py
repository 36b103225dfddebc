"""Ragged paged attention on CPU: the fused C++ kernel in `cpu.cc`, called through the XLA FFI.

Where it sits: `ragged_paged_attention` picks it on the CPU backend (float32 queries; a
float32, bfloat16 or fp8 cache, `CACHE_DTYPES`; head and page sizes multiples of 8), in
place of the XLA reference, which stays the oracle it is tested
against and the fallback for everything else. It promises exactly the reference's
contract (see `reference.py`): same inputs, same outputs to float32 rounding, NaN in
unused cache slots never reaching the output, zeros for padding tokens, and derivatives
(taken through the reference, which computes the same function).

Why a C++ kernel on CPU: XLA:CPU emits a page gather as an element-wise loop and cannot
fuse it into a dot, so the reference spends most of a decode step's attention copying
pages and dispatching tiny batched dots; the kernel reads each page once, straight from
the cache (bench/README.md has the measurements).

The source is built on first use and registered by `native_build.NativeKernel` (cached
per machine, compiler and CPU; no compiler, a failed build or one past its timeout leaves
the reference in charge with a warning saying why).

Malformed operands never reach memory the kernel should not touch: `check_operands`
rejects bad shapes at trace time, and `cpu.cc` checks the same shapes again plus the
metadata only known at run time (an XLA runtime error naming the operand).
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jengine.pallas_kernels.native_build import NativeKernel
from jengine.pallas_kernels.ragged_paged_attention.metadata import layer_window
from jengine.pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

TARGET_NAME = "jengine_ragged_paged_attention"
KERNEL = NativeKernel(
    Path(__file__).with_name("cpu.cc"),
    symbol="JengineRaggedPagedAttention",
    target=TARGET_NAME,
    what="CPU attention kernel",
)
# The kernel works on eight floats at a time and serves up to 64 query rows per kv head.
LANES = 8
MAX_GROUP = 64
# The caches it reads: a narrow one's pages are widened to float32 as the walk reaches them.
CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2)


def supports(q: jax.Array, kv_cache: jax.Array) -> bool:
    """Whether the kernel handles these operands (else the reference must)."""
    if len(q.shape) != 3 or len(kv_cache.shape) != 6 or kv_cache.shape[2] < 1:
        return False  # malformed: not the kernel's to take
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[4]
    return (
        q.dtype == jnp.float32
        and kv_cache.dtype in CACHE_DTYPES
        and head_dim % LANES == 0
        and block_size % LANES == 0
        and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= MAX_GROUP
    )


def check_operands(q, kv_cache, layer, kv_lens, block_tables, query_start_loc) -> None:
    """Raise ValueError for the shapes the kernel would index out of bounds (cpu.cc refuses
    them again at run time); a concrete `layer` is checked too, a traced one in cpu.cc."""
    shapes = (
        f"got q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)}, kv_lens "
        f"{tuple(kv_lens.shape)}, block_tables {tuple(block_tables.shape)}, query_start_loc "
        f"{tuple(query_start_loc.shape)}"
    )
    if len(q.shape) != 3:
        problem = "q must be [tokens, q heads, head dim]"
    elif len(kv_cache.shape) != 6 or kv_cache.shape[1] != 2:
        problem = "kv_cache must be [layers, 2 (k and v), kv heads, pages, page size, head dim]"
    elif len(kv_lens.shape) != 1 or len(block_tables.shape) != 2 or len(query_start_loc.shape) != 1:
        problem = "kv_lens must be [R], block_tables [R, P], query_start_loc [R + 1]"
    elif q.shape[2] != kv_cache.shape[5]:
        problem = "q's head dim must equal kv_cache's"
    elif kv_cache.shape[2] < 1 or q.shape[1] < 1 or q.shape[1] % kv_cache.shape[2]:
        problem = "q heads must be a multiple of kv_cache's kv heads"
    elif kv_cache.shape[3] < 1:
        problem = "kv_cache must hold a page"
    elif block_tables.shape[0] < kv_lens.shape[0]:
        problem = "block_tables needs a row for every request of kv_lens"
    elif query_start_loc.shape[0] != kv_lens.shape[0] + 1:
        problem = "query_start_loc needs one entry more than kv_lens"
    elif np.size(layer) != 1:
        problem = f"layer must be one index, got shape {np.shape(layer)}"
    elif not isinstance(layer, jax.core.Tracer) and not 0 <= _index(layer) < kv_cache.shape[0]:
        problem = f"layer {_index(layer)} is outside the cache's {kv_cache.shape[0]} layers"
    else:
        return
    raise ValueError(f"ragged paged attention: {problem}; {shapes}")


def _index(x) -> int:
    return int(np.asarray(x).reshape(()))


def load() -> str | None:
    """Build and register the kernel (once): None if it is ready, else why not."""
    return KERNEL.load()


def load_in_background() -> None:
    KERNEL.load_in_background()


def ragged_paged_attention_cpu(
    q: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array | int,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    *,
    sm_scale: float,
    q_block_size: int = 16,
    sliding_window=None,
    soft_cap: float | None = None,
    kernel: NativeKernel = KERNEL,
) -> jax.Array:
    """See `reference.ragged_paged_attention_reference`; `q_block_size` only matters to the
    reference that computes derivatives (the kernel sizes its own work items). The window
    reaches the kernel as an operand (a layer's own, traced, inside a layer scan).
    `kernel`: the build to call (the tests pass an AVX2 CPU's)."""
    check_operands(q, kv_cache, layer, kv_lens, block_tables, query_start_loc)
    if not supports(q, kv_cache):
        raise ValueError(
            "the CPU attention kernel takes float32 queries, a float32, bfloat16 or fp8 "
            f"cache, head and page sizes multiples of {LANES} and at most {MAX_GROUP} q "
            "heads per kv head; got q "
            f"{q.dtype}{tuple(q.shape)}, kv_cache {kv_cache.dtype}{tuple(kv_cache.shape)}"
        )
    kernel.require()
    return _attention(
        float(sm_scale),
        None if soft_cap is None else float(soft_cap),
        q_block_size,
        kernel.target,
        q,
        kv_cache,
        layer_window(layer, sliding_window),
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _attention(sm_scale, soft_cap, q_block_size, target, q, kv_cache, layer_window, *metadata):
    """`layer_window`: [2] int32, the layer and its sliding window (0: none)."""
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        kv_cache,
        layer_window,
        *metadata,
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0),
    )


@_attention.defjvp
def _attention_jvp(sm_scale, soft_cap, q_block_size, target, primals, tangents):
    # The kernel has no derivative of its own; the reference computes the same function.
    q, kv_cache, layer_window, *metadata = primals
    q_dot, kv_cache_dot = tangents[:2]

    def reference(q, kv_cache):
        return ragged_paged_attention_reference(
            q,
            kv_cache,
            layer_window[0],
            *metadata,
            sm_scale=sm_scale,
            q_block_size=q_block_size,
            sliding_window=layer_window[1],
            soft_cap=soft_cap,
        )

    return jax.jvp(reference, (q, kv_cache), (q_dot, kv_cache_dot))
