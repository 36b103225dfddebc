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

The source is compiled on first use with the machine's C++ compiler (`$CXX`, which may
carry arguments such as `ccache g++`, else `c++`; GCC or Clang) for the CPU it runs on,
against the FFI headers jaxlib ships, and cached under `$JENGINE_KERNEL_CACHE` (default
`~/.cache/jengine/kernels`) by a hash of everything that goes into the build: source,
compiler command and version, flags, jax and jaxlib versions, the FFI headers' contents
and the CPU model (-march=native code must not run on another CPU). No compiler, a failed
build or one past `BUILD_TIMEOUT_S` leaves the reference in charge with a warning saying
why. Threads starting together build and register once (`load` holds a lock).

Malformed operands never reach memory the kernel should not touch: `check_operands`
rejects bad shapes at trace time, and `cpu.cc` checks the same shapes again plus the
metadata only known at run time (an XLA runtime error naming the operand).
"""

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jengine.pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu.cc")
TARGET_NAME = "jengine_ragged_paged_attention"
SYMBOL = "JengineRaggedPagedAttention"
CXX_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
# The build takes ~5 s; a compiler still running after this is stuck (or swapping), and
# a server start must not wait on it forever.
BUILD_TIMEOUT_S = 300.0
# The kernel works on eight floats at a time and serves up to 64 query rows per kv head.
LANES = 8
MAX_GROUP = 64
# The /proc/cpuinfo lines that tell apart what -march=native compiles for (x86: model name
# and flags; aarch64: implementer, part and features).
CPUINFO_FIELDS = ("model name", "flags", "CPU implementer", "CPU part", "Features")

_load_lock = threading.Lock()


def supports(q: jax.Array, kv_cache: jax.Array) -> bool:
    """Whether the kernel handles these operands (else the reference must)."""
    if len(q.shape) != 3 or len(kv_cache.shape) != 6 or kv_cache.shape[2] < 1:
        return False  # malformed: not the kernel's to take
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


def _compiler() -> list[str] | None:
    """`$CXX` (or `c++`) as a command line, its first word resolved on PATH; None if absent
    (or unparsable)."""
    try:
        words = shlex.split(os.environ.get("CXX") or "c++")
    except ValueError:  # unbalanced quotes
        return None
    path = shutil.which(words[0]) if words else None
    return [path, *words[1:]] if path else None


def _cpu_signature() -> str:
    """What -march=native compiles for: a cached library is only reused on the same CPU."""
    lines = [platform.machine(), platform.processor()]
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        lines += sorted({line for line in cpuinfo if line.startswith(CPUINFO_FIELDS)})
    return "\n".join(lines)


def _headers_digest(include_dir: str) -> bytes:
    """The FFI headers' contents: the handler ABI can change without a version bump."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(include_dir).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(include_dir)).encode() + b"\0" + path.read_bytes())
    return digest.digest()


def _run(command: list[str]) -> subprocess.CompletedProcess:
    """Run the compiler for at most BUILD_TIMEOUT_S; a failure or timeout raises. It runs in
    a session of its own, so a timeout kills its whole process group: a driver's cc1plus or
    linker left running would hold the pipes open and keep us waiting."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=BUILD_TIMEOUT_S)
    except BaseException as error:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        if isinstance(error, subprocess.TimeoutExpired):
            raise RuntimeError(
                f"{shlex.join(command)} did not finish within {BUILD_TIMEOUT_S:g} s"
            ) from None
        raise
    if process.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{stderr[-2000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _build(compiler: list[str]) -> Path:
    include_dir = jax.ffi.include_dir()
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        shlex.join(compiler).encode(),
        _run([*compiler, "--version"]).stdout.encode(),
        shlex.join(CXX_FLAGS).encode(),
        _headers_digest(include_dir),
        jax.__version__.encode(),
        jaxlib.__version__.encode(),
        _cpu_signature().encode(),
    ):
        key.update(hashlib.sha256(part).digest())  # parts hashed apart: no ambiguous joins
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
        _run([*compiler, *CXX_FLAGS, f"-I{include_dir}", str(SOURCE), "-o", str(output)])
        os.replace(output, library)
    return library


def load_in_background() -> None:
    """Start `load()` on a thread: the first build on a machine is seconds of the C++
    compiler, which can run beside the rest of start-up (imports, weights, tokenizer);
    whoever calls `load()` next waits for it under the lock."""
    threading.Thread(target=load, name="cpu-attention-build", daemon=True).start()


def load() -> str | None:
    """Build (once per machine) and register the kernel: None if it is ready, else why not
    (logged once). Under a lock: XLA keeps one registration per target name per process,
    and threads that start serving together must not both build and register."""
    with _load_lock:
        return _load_once()


@functools.cache
def _load_once() -> str | None:
    compiler = _compiler()
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
    check_operands(q, kv_cache, layer, kv_lens, block_tables, query_start_loc)
    if not supports(q, kv_cache):
        raise ValueError(
            "the CPU attention kernel takes float32 with head and page sizes multiples of "
            f"{LANES} and at most {MAX_GROUP} q heads per kv head; got q "
            f"{q.dtype}{tuple(q.shape)}, kv_cache {kv_cache.dtype}{tuple(kv_cache.shape)}"
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
