"""Ragged paged attention on CPU: the fused C++ kernel in `cpu.cc`, called through the XLA FFI.

Where it sits: `ragged_paged_attention` picks it on the CPU backend (float32, head and page
sizes multiples of 8), in place of the XLA reference, which stays the oracle it is tested
against and the fallback for everything else. It promises exactly the reference's
contract (see `reference.py`): same inputs, same outputs to float32 rounding, NaN in
unused cache slots never reaching the output, zeros for padding tokens, and derivatives
(taken through the reference, which computes the same function).

Why a C++ kernel on CPU: XLA:CPU emits a page gather as an element-wise loop and cannot
fuse it into a dot, so the reference spends most of a decode step's attention copying
pages and dispatching tiny batched dots; the kernel reads each page once, straight from
the cache (bench/README.md has the measurements).

The source is compiled on first use with the machine's C++ compiler (`$CXX`, else `c++`)
for the CPU it runs on, against the FFI headers jaxlib ships, and cached under
`$JENGINE_KERNEL_CACHE` (default `~/.cache/jengine/kernels`) by a hash of everything that
goes into the build. No compiler, or a failed build, leaves the reference in charge with a
warning saying why.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jengine.pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu.cc")
TARGET_NAME = "jengine_ragged_paged_attention"
SYMBOL = "JengineRaggedPagedAttention"
CXX_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
# The kernel works on eight floats at a time and serves up to 64 query rows per kv head.
LANES = 8
MAX_GROUP = 64


def supports(q: jax.Array, kv_cache: jax.Array) -> bool:
    """Whether the kernel handles these operands (else the reference must)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[4]
    return (
        q.dtype == jnp.float32
        and kv_cache.dtype == jnp.float32
        and head_dim % LANES == 0
        and block_size % LANES == 0
        and num_q_heads % num_kv_heads == 0
        and num_q_heads // num_kv_heads <= MAX_GROUP
    )


def _cpu_signature() -> str:
    """What -march=native compiles for: a cached library is only reused on the same CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(
            sorted({line for line in lines if line.startswith(("flags", "model name"))})
        )
    except OSError:
        return platform.processor() or platform.machine()


def _build(compiler: str) -> Path:
    include_dir = jax.ffi.include_dir()
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        subprocess.run([compiler, "--version"], capture_output=True, check=True).stdout,
        " ".join(CXX_FLAGS).encode(),
        include_dir.encode(),
        jax.__version__.encode(),
        _cpu_signature().encode(),
    ):
        key.update(part)
    cache_dir = Path(
        os.environ.get("JENGINE_KERNEL_CACHE", os.path.expanduser("~/.cache/jengine/kernels"))
    )
    library = cache_dir / f"ragged_paged_attention-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=cache_dir) as build_dir:
        output = Path(build_dir) / library.name
        command = [compiler, *CXX_FLAGS, f"-I{include_dir}", str(SOURCE), "-o", str(output)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(output, library)
    return library


@functools.cache
def load() -> str | None:
    """Build (once per machine) and register the kernel: None if it is ready, else why not
    (logged once). Cached: XLA keeps one registration per target name per process."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        reason = "no C++ compiler found (set CXX)"
    else:
        try:
            library = ctypes.CDLL(str(_build(compiler)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            reason = f"the kernel did not build: {error}"
        else:
            handler = jax.ffi.pycapsule(getattr(library, SYMBOL))
            jax.ffi.register_ffi_target(TARGET_NAME, handler, platform="cpu")
            return None
    logger.warning("CPU attention kernel unavailable, using the XLA reference: %s", reason)
    return reason


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
    sliding_window: int | None = None,
) -> jax.Array:
    """See `reference.ragged_paged_attention_reference`; `q_block_size` only matters to the
    reference that computes derivatives (the kernel sizes its own work items)."""
    if not supports(q, kv_cache):
        raise ValueError(
            "the CPU attention kernel takes float32 with head and page sizes multiples of "
            f"{LANES}; got q {q.dtype}{tuple(q.shape)}, kv_cache "
            f"{kv_cache.dtype}{tuple(kv_cache.shape)}"
        )
    reason = load()
    if reason is not None:
        raise RuntimeError(f"CPU attention kernel unavailable: {reason}")
    return _attention(
        float(sm_scale),
        sliding_window,
        q_block_size,
        q,
        kv_cache,
        jnp.asarray(layer, jnp.int32).reshape(1),
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _attention(sm_scale, sliding_window, q_block_size, q, kv_cache, layer, *metadata):
    call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        kv_cache,
        layer,
        *metadata,
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0),
    )


@_attention.defjvp
def _attention_jvp(sm_scale, sliding_window, q_block_size, primals, tangents):
    # The kernel has no derivative of its own; the reference computes the same function.
    q, kv_cache, layer, *metadata = primals
    q_dot, kv_cache_dot = tangents[:2]

    def reference(q, kv_cache):
        return ragged_paged_attention_reference(
            q,
            kv_cache,
            layer[0],
            *metadata,
            sm_scale=sm_scale,
            q_block_size=q_block_size,
            sliding_window=sliding_window,
        )

    return jax.jvp(reference, (q, kv_cache), (q_dot, kv_cache_dot))
