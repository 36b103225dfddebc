"""Building and registering jengine's C++ kernels for XLA:CPU (the `cpu.cc` beside a
kernel's reference), shared by every kernel that has one.

Where it sits: a kernel's `cpu.py` holds one `NativeKernel` and calls `load()` before it
emits its `jax.ffi.ffi_call`; the kernel's entry point falls back to its XLA reference
when `load()` says why it cannot.

Promises:
- the source is compiled on first use with the machine's C++ compiler (`$CXX`, which may
  carry arguments such as `ccache g++`, else `c++`; GCC or Clang) for the CPU it runs on,
  against the FFI headers jaxlib ships, and cached under `$JENGINE_KERNEL_CACHE` (default
  `~/.cache/jengine/kernels`) by a hash of everything that goes into the build: source,
  the headers beside it and the kernels' shared ones (`include/`), compiler command and
  version, flags, jax and jaxlib versions, the FFI headers' contents and the CPU model
  (-march=native code must not run on another CPU);
- no compiler, a failed build or one past `BUILD_TIMEOUT_S` is a reason returned by
  `load()` and logged once, never an exception;
- threads starting together build and register once (`load` holds a lock), and processes
  building together never load a half-written library (build beside, then rename).
"""

import contextlib
import ctypes
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
import jaxlib

logger = logging.getLogger(__name__)

CXX_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
# A build takes seconds; a compiler still running after this is stuck (or swapping), and
# a server start must not wait on it forever.
BUILD_TIMEOUT_S = 300.0
# The /proc/cpuinfo lines that tell apart what -march=native compiles for (x86: model name
# and flags; aarch64: implementer, part and features).
CPUINFO_FIELDS = ("model name", "flags", "CPU implementer", "CPU part", "Features")


def compiler() -> list[str] | None:
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


def _headers_digest(include_dir: str, pattern: str = "*") -> bytes:
    """The contents of the headers under `include_dir` (the FFI's: the handler ABI can
    change without a version bump; a kernel's own beside its source)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(include_dir).rglob(pattern) if p.is_file()):
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


# Headers more than one kernel includes (`#include "panel.h"`), on every build's path.
SHARED_HEADERS = Path(__file__).with_name("include")


class NativeKernel:
    """One C++ source exporting one XLA FFI handler `symbol`, registered for the CPU
    platform as `target` (the name its `ffi_call` uses); `what` names it in logs.
    `shared_headers`: the folder of headers kernels share (the tests point it elsewhere);
    `extra_flags`: compiler flags after CXX_FLAGS (the tests build an AVX2 CPU's code with
    `-mno-avx512f` on an AVX-512 one)."""

    def __init__(
        self,
        source: Path,
        symbol: str,
        target: str,
        what: str,
        shared_headers=SHARED_HEADERS,
        extra_flags: tuple[str, ...] = (),
    ):
        self.source, self.symbol, self.target, self.what = source, symbol, target, what
        self.shared_headers = Path(shared_headers)
        self.flags = (*CXX_FLAGS, *extra_flags)
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._loaded = False

    def build(self, compiler: list[str]) -> Path:
        """The library for this source, compiled now unless the cache has it."""
        include_dir = jax.ffi.include_dir()
        key = hashlib.sha256()
        for part in (
            self.source.read_bytes(),
            _headers_digest(str(self.source.parent), "*.h"),  # the headers it includes
            _headers_digest(str(self.shared_headers), "*.h"),
            shlex.join(compiler).encode(),
            _run([*compiler, "--version"]).stdout.encode(),
            shlex.join(self.flags).encode(),
            _headers_digest(include_dir),
            jax.__version__.encode(),
            jaxlib.__version__.encode(),
            _cpu_signature().encode(),
        ):
            key.update(hashlib.sha256(part).digest())  # parts hashed apart: no ambiguous joins
        cache_dir = Path(
            os.environ.get("JENGINE_KERNEL_CACHE", os.path.expanduser("~/.cache/jengine/kernels"))
        )
        library = cache_dir / f"{self.source.parent.name}-{key.hexdigest()[:16]}.so"
        if library.exists():
            return library
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as build_dir:
            output = Path(build_dir) / library.name
            includes = [f"-I{self.shared_headers}", f"-I{include_dir}"]
            _run([*compiler, *self.flags, *includes, str(self.source), "-o", str(output)])
            os.replace(output, library)
        return library

    def load(self) -> str | None:
        """Build (once per machine) and register the kernel: None if it is ready, else why
        not (logged once). Under a lock: XLA keeps one registration per target name per
        process, and threads that start serving together must not both build."""
        with self._lock:
            if not self._loaded:
                self._reason = self._load()
                self._loaded = True
            return self._reason

    def require(self) -> None:
        """`load()`, raising RuntimeError with the reason where the kernel is unavailable
        (what a kernel's direct entry point does; the dispatchers fall back instead)."""
        reason = self.load()
        if reason is not None:
            raise RuntimeError(f"{self.what} unavailable: {reason}")

    def load_in_background(self) -> None:
        """Start `load()` on a thread: the first build on a machine is seconds of the C++
        compiler, which can run beside the rest of start-up (imports, weights, tokenizer);
        whoever calls `load()` next waits for it under the lock."""
        threading.Thread(target=self.load, name=f"{self.target}-build", daemon=True).start()

    def _load(self) -> str | None:
        command = compiler()
        if command is None:
            reason = "no C++ compiler found (set CXX)"
        else:
            try:
                library = ctypes.CDLL(str(self.build(command)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                reason = f"the kernel did not build: {error}"
            else:
                handler = jax.ffi.pycapsule(getattr(library, self.symbol))
                jax.ffi.register_ffi_target(self.target, handler, platform="cpu")
                return None
        logger.warning("%s unavailable, using the XLA reference: %s", self.what, reason)
        return reason
