"""How the CPU kernels get built and loaded (`native_build.py`): with every C++ compiler on
PATH (GCC and Clang both; the attention and stacked-matmul kernels each), with a `$CXX` that
carries arguments, by two threads at once (one build, one registration), and past a build
timeout (the reference takes over, saying why).

Each case runs in a fresh interpreter: a process loads and registers the kernel once, and
this one already has. Builds go to a temporary `JENGINE_KERNEL_CACHE`, so every compiler
really compiles; `apt-get install clang` adds the Clang case on Debian.
"""

import ctypes
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Builds the kernels and checks them against their references (attention on a small batch
# with NaN traps).
CHECK_BUILD = """
import numpy as np
from jengine.pallas_kernels.ragged_paged_attention import cpu, ragged_paged_attention_reference
from tests.kernels.conftest import build_batch
assert cpu.load() is None, cpu.load()
batch = build_batch(0, [5, 1, 20, 0], [5, 30, 40, 0], num_q_heads=4, num_kv_heads=2,
                    head_dim=32, block_size=16, pad_tokens=2)
out = cpu.ragged_paged_attention_cpu(*batch.args, sm_scale=0.2, sliding_window=25)
expected = ragged_paged_attention_reference(*batch.args, sm_scale=0.2, sliding_window=25)
np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
assert np.isfinite(out).all()
from jengine.pallas_kernels.stacked_matmul import cpu as matmul_cpu
assert matmul_cpu.KERNEL.load() is None, matmul_cpu.KERNEL.load()
x, w = np.ones((3, 16), np.float32), np.arange(2 * 5 * 16, dtype=np.float32).reshape(2, 5, 16)
np.testing.assert_allclose(matmul_cpu.stacked_matmul_cpu(x, w, 1), x @ w[1].T)
from jengine.models.quantize import INT8_PER_CHANNEL as INT8
from jengine.pallas_kernels.quantized_matmul import QuantizedWeight, cpu as quantized_cpu
assert quantized_cpu.KERNEL.load() is None, quantized_cpu.KERNEL.load()
x = np.ones((2, 32), np.float32)
q = QuantizedWeight(np.ones((2, 5, 32), np.int8), np.full((2, 5, 1), 0.5, np.float32), None, INT8)
np.testing.assert_allclose(quantized_cpu.quantized_matmul_cpu(x, q, 1), np.full((2, 5), 16.0))
print("kernel ok")
"""


def _compilers() -> dict[str, str]:
    """The C++ compilers on PATH (and `$CXX`), one per distinct executable."""
    found, seen = {}, set()
    for command in ("g++", "clang++", "c++", os.environ.get("CXX", "")):
        words = shlex.split(command)
        path = shutil.which(words[0]) if words else None
        if path and (key := (os.path.realpath(path), *words[1:])) not in seen:
            seen.add(key)
            found[command] = command
    return found


def _run(code: str, cache: Path, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    environ = dict(os.environ, JENGINE_KERNEL_CACHE=str(cache), **env)
    environ.pop("JENGINE_ATTENTION_IMPL", None)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=environ,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("cxx", sorted(_compilers()))
def test_every_compiler_on_path_builds_a_correct_kernel(tmp_path, cxx):
    result = _run(CHECK_BUILD, tmp_path, CXX=cxx)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernel ok" in result.stdout
    assert len(list(tmp_path.glob("*.so"))) == 3, "every kernel built into the given cache"


def test_cxx_with_arguments(tmp_path):
    """`CXX="ccache g++"` style: a launcher word before the compiler."""
    result = _run(CHECK_BUILD, tmp_path, CXX="env g++")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernel ok" in result.stdout


def test_two_threads_loading_at_once_build_and_register_once():
    code = """
import threading, time
import jax
from jengine.pallas_kernels.ragged_paged_attention import cpu
calls = {"build": 0, "register": 0}
build, register = cpu.KERNEL.build, jax.ffi.register_ffi_target

def slow_build(compiler):
    calls["build"] += 1
    time.sleep(1.0)  # the other thread is in load() by now
    return build(compiler)

def counting_register(*args, **kwargs):
    calls["register"] += 1
    return register(*args, **kwargs)

cpu.KERNEL.build, jax.ffi.register_ffi_target = slow_build, counting_register
barrier, results = threading.Barrier(2), []

def start():
    barrier.wait()
    results.append(cpu.load())

threads = [threading.Thread(target=start) for _ in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(results, calls)
assert results == [None, None] and calls == {"build": 1, "register": 1}
"""
    # The session's own cache (the kernel is built there already): the race is the point.
    cache = os.environ.get("JENGINE_KERNEL_CACHE", os.path.expanduser("~/.cache/jengine/kernels"))
    result = _run(code, Path(cache))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


def test_a_build_past_the_timeout_leaves_the_reference_in_charge(tmp_path):
    """A compiler that hangs (here a driver whose child sleeps: the child holds the pipes)
    is killed with its process group after BUILD_TIMEOUT_S, and the reference serves."""
    compiler = tmp_path / "hanging-c++"
    compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && echo hanging 1.0 && exit 0\nsleep 60\n')
    compiler.chmod(0o755)
    code = """
from jengine.pallas_kernels import native_build
from jengine.pallas_kernels.ragged_paged_attention import default_impl
native_build.BUILD_TIMEOUT_S = 1
print(default_impl())
"""
    start = time.monotonic()
    result = _run(code, tmp_path / "cache", timeout=50, CXX=str(compiler))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "reference"
    assert "did not finish within 1 s" in result.stderr
    assert time.monotonic() - start < 45
    assert not list((tmp_path / "cache").glob("*.so"))


def test_a_header_beside_the_source_or_shared_is_part_of_its_build(tmp_path, monkeypatch):
    """A kernel's own headers (quantized_matmul/cpu.cc includes values.h and integer_x.h)
    and the kernels' shared ones (include/panel.h) are hashed with its source: an edited
    header builds anew, never a stale library."""
    from jengine.pallas_kernels.native_build import NativeKernel, compiler

    folder, shared = tmp_path / "kernel", tmp_path / "include"
    folder.mkdir()
    shared.mkdir()
    (folder / "cpu.cc").write_text(
        '#include "part.h"\n#include "shared.h"\n'
        'extern "C" int value() { return VALUE + SHARED; }\n'
    )
    monkeypatch.setenv("JENGINE_KERNEL_CACHE", str(tmp_path / "cache"))
    kernel = NativeKernel(
        folder / "cpu.cc", symbol="value", target="unused", what="test", shared_headers=shared
    )
    libraries = []
    for value, shared_value in ((1, 10), (2, 10), (2, 20)):
        (folder / "part.h").write_text(f"#define VALUE {value}\n")
        (shared / "shared.h").write_text(f"#define SHARED {shared_value}\n")
        libraries.append(kernel.build(compiler()))
    assert len(set(libraries)) == 3 and all(path.exists() for path in libraries)
    for library, expected in zip(libraries, (11, 12, 22), strict=True):
        assert ctypes.CDLL(str(library)).value() == expected
