"""llama.cpp as a benchmark peer: find the binaries, convert the model, drive the tools.

Built by `bench/peers/build_llama_cpp.sh` (bench/peers/README.md). No jax, no torch here
(the converter, run as a subprocess, needs torch, transformers and sentencepiece).

- `find_llama_cpp()`: the `llama-server`, `llama-bench`, `llama-batched-bench` binaries
  (under a given folder; else on PATH, under `$LLAMA_CPP_DIR` or in the build cache), or
  None;
- `convert_to_gguf()`: an HF folder to a float32 GGUF with llama.cpp's own converter,
  cached next to the folder;
- `LlamaServer` lives in llama_server.py: `llama-server` with continuous batching as a
  context manager, driven with greedy token-id requests;
- `run_llama_bench()` / `run_batched_bench()`: `llama-bench` / `llama-batched-bench`
  results as dicts;
- `LlamaCpp.repacking_off()`: whether a GGUF runs without llama.cpp's weight repacking
  (where llama.cpp crashes with it), and why; every tool above follows it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_DIR = os.path.expanduser("~/.cache/jengine/llama.cpp")
SERVER, BENCH, BATCHED_BENCH = "llama-server", "llama-bench", "llama-batched-bench"
CONVERTER = "convert_hf_to_gguf.py"


@dataclass
class LlamaCpp:
    """Paths of the llama.cpp tools (`converter` may be None: then no conversion)."""

    server: str
    bench: str
    batched_bench: str
    converter: str | None = None
    python: str = sys.executable  # runs the converter
    # GGUF path -> why its weight repacking is off, or None (`repacking_off`).
    _repacking: dict[str, str | None] = dataclasses.field(default_factory=dict, repr=False)

    def repacking_off(self, gguf_path: str) -> str | None:
        """Why the tools run `gguf_path` with llama.cpp's weight repacking off, or None: they
        run it as llama.cpp ships. At load llama.cpp moves quantized weights into its extra
        buffer types (repacked CPU layouts, AMX tiles where the CPU has them); on an AMX
        Xeon VM its AMX matmul died of SIGSEGV on SmolLM2's Q4_1 file, in every tool. A
        short llama-bench run tells, once per file: where it dies of a signal with
        repacking and runs without, the tools run without it (`--repack 0` /
        `--no-repack`), as a user of that CPU would, and the results say so."""
        if gguf_path not in self._repacking:

            def probe(*extra: str) -> int:
                command = [self.bench, "-m", gguf_path, "-p", "8", "-n", "4", "-r", "1", *extra]
                return subprocess.run(command, capture_output=True, timeout=600).returncode

            why = None
            code = probe()
            if code < 0 and probe("--repack", "0") == 0:
                why = (
                    f"weight repacking off: llama-bench died of {signal.Signals(-code).name} "
                    "with it (llama.cpp's AMX / repacked CPU buffers) and runs without"
                )
            self._repacking[gguf_path] = why
        return self._repacking[gguf_path]

    def version(self) -> str:
        """`llama-server --version`'s version line, e.g. 'version: 1 (abc1234)', plus the
        source the build script took it from, when known."""
        proc = subprocess.run(
            [self.server, "--version"], capture_output=True, text=True, timeout=60
        )
        lines = (proc.stdout + proc.stderr).splitlines()
        version = next((ln.strip() for ln in lines if ln.startswith("version")), None)
        version = version or (lines[0].strip() if lines else "unknown")
        stamp = os.path.join(os.path.dirname(os.path.dirname(self.server)), "SOURCE")
        if os.path.isfile(stamp):
            with open(stamp) as f:
                version += f" [{f.read().strip()}]"
        return version


def _tools_in(folder: str) -> LlamaCpp | None:
    for bin_dir in (os.path.join(folder, "bin"), folder, os.path.join(folder, "build", "bin")):
        paths = [os.path.join(bin_dir, name) for name in (SERVER, BENCH, BATCHED_BENCH)]
        if all(os.path.isfile(p) and os.access(p, os.X_OK) for p in paths):
            return LlamaCpp(*paths, converter=_converter_near(folder, bin_dir))
    return None


def _converter_near(*folders: str) -> str | None:
    for folder in folders:
        for candidate in (
            os.path.join(folder, CONVERTER),
            os.path.join(folder, "src", CONVERTER),
            os.path.join(os.path.dirname(folder), CONVERTER),
        ):
            if os.path.isfile(candidate):
                return os.path.abspath(candidate)
    return None


def find_llama_cpp(llama_cpp_dir: str | None = None) -> LlamaCpp | None:
    """The llama.cpp tools, or None when they are not there (the benchmarks then skip it).

    Given `llama_cpp_dir`: only there (its bin/, itself or its build/bin/). Otherwise on
    PATH, then under `$LLAMA_CPP_DIR`, then in the build cache (~/.cache/jengine/llama.cpp).
    The converter is looked for beside the binaries, then in the build cache.
    """
    if llama_cpp_dir:
        return _tools_in(os.path.expanduser(llama_cpp_dir))
    paths = [shutil.which(name) for name in (SERVER, BENCH, BATCHED_BENCH)]
    if all(paths):
        bin_dir = os.path.dirname(os.path.realpath(paths[0]))
        converter = (
            shutil.which(CONVERTER)
            or _converter_near(os.path.dirname(bin_dir), bin_dir)
            or _converter_near(DEFAULT_DIR)
        )
        return LlamaCpp(*paths, converter=converter)
    for folder in filter(None, [os.environ.get("LLAMA_CPP_DIR"), DEFAULT_DIR]):
        found = _tools_in(os.path.expanduser(folder))
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------- conversion


def _source_stamp(llama_cpp: LlamaCpp, hf_folder: str) -> str:
    """What the GGUF is made from: the folder's files (name, size, mtime) and the converter."""
    entries = []
    for name in sorted(os.listdir(hf_folder)):
        path = os.path.join(hf_folder, name)
        if os.path.isfile(path) and not name.startswith("."):
            st = os.stat(path)
            entries.append([name, st.st_size, st.st_mtime_ns])
    converter = os.path.realpath(llama_cpp.converter or "")
    stamp = dict(files=entries, converter=converter, outtype="f32")
    return hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()


def convert_to_gguf(
    llama_cpp: LlamaCpp, hf_folder: str, out_path: str | None = None, outtype: str = "f32"
) -> str:
    """The HF model in `hf_folder` as a GGUF of `outtype` ("f32", or "q8_0": llama.cpp's
    own 8-bit quantization), made by llama.cpp's converter.

    Written to `out_path` (default `<hf_folder>.<outtype>.gguf`, next to the folder) and reused
    while the folder's files and the converter are unchanged (a `.stamp` file beside it).
    The converter runs under `llama_cpp.python` and needs torch, numpy, transformers,
    sentencepiece, pyyaml, tqdm and requests there (it uses the gguf-py kept beside it).
    """
    if llama_cpp.converter is None:
        raise FileNotFoundError(f"no {CONVERTER} next to the llama.cpp build")
    hf_folder = os.path.abspath(os.path.expanduser(hf_folder))
    out_path = os.path.abspath(out_path or hf_folder.rstrip("/") + f".{outtype}.gguf")
    stamp_path = out_path + ".stamp"
    stamp = _source_stamp(llama_cpp, hf_folder)
    if os.path.isfile(out_path) and os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            if f.read().strip() == stamp:
                return out_path
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".gguf", dir=os.path.dirname(out_path))
    os.close(fd)
    try:
        proc = subprocess.run(
            [
                llama_cpp.python,
                llama_cpp.converter,
                hf_folder,
                "--outfile",
                tmp,
                "--outtype",
                outtype,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{CONVERTER} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        os.replace(tmp, out_path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    with open(stamp_path, "w") as f:
        f.write(stamp + "\n")
    return out_path


def gguf_to_f32(gguf_path: str, out_path: str | None = None) -> str:
    """An F32 copy of a (quantized) GGUF for llama.cpp: the same metadata, every tensor
    dequantized by jengine's dequantizers (equal to the gguf package's reference) and kept
    in llama.cpp's own layout. Written once under ~/.cache/jengine (`<name>.f32.gguf`) and
    reused while the source's size and mtime stay the same."""
    import gguf

    from jengine.models.gguf_quants import dequantize

    name = os.path.basename(os.path.splitext(gguf_path)[0]) + ".f32.gguf"
    out_path = out_path or os.path.join(os.path.expanduser("~/.cache/jengine"), name)
    st = os.stat(gguf_path)
    stamp = f"{os.path.abspath(gguf_path)} {st.st_size} {st.st_mtime_ns}"
    stamp_path = out_path + ".stamp"
    if os.path.isfile(out_path) and os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            if f.read().strip() == stamp:
                return out_path
    reader = gguf.GGUFReader(gguf_path)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = out_path + ".tmp"
    writer = gguf.GGUFWriter(tmp, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = 0 if key == "general.file_type" else field.contents()  # 0: all F32
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        writer.add_tensor(tensor.name, dequantize(tensor.data, tensor.tensor_type.name, shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out_path)
    with open(stamp_path, "w") as f:
        f.write(stamp + "\n")
    return out_path


# -------------------------------------------------------------------------------- server


# --------------------------------------------------------------------------- bench tools


def _json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return rows


def run_llama_bench(
    llama_cpp: LlamaCpp,
    gguf_path: str,
    *,
    n_prompt: int,
    n_gen: int,
    threads: int,
    repetitions: int = 3,
    extra_args: Sequence[str] = (),
) -> dict:
    """`llama-bench -o json`: prompt processing (one `n_prompt`-token batch) and text
    generation (`n_gen` tokens one at a time, batch 1), averaged over `repetitions`.
    llama-bench's own settings otherwise: its KV cache is f16 (it takes no f32 cache
    type), flash attention "auto"; `extra_args` (e.g. `["-fa", "off"]`) changes them.

    Returns pp_tok_per_s / tg_tok_per_s (means) with their standard deviations, the
    per-repetition samples and the best of them (pp_best_tok_per_s, tg_best_tok_per_s),
    `version()`, the build and CPU llama-bench reports, `repacking_off` (`LlamaCpp.
    repacking_off`) and `raw` (its JSON).
    """
    repacking_off = llama_cpp.repacking_off(gguf_path)
    cmd = [
        llama_cpp.bench, "-m", gguf_path,
        "-p", str(n_prompt), "-n", str(n_gen),
        "-t", str(threads), "-r", str(repetitions),
        "-o", "json", *(["--repack", "0"] if repacking_off else []), *extra_args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    raw = json.loads(proc.stdout)
    result: dict = dict(
        n_prompt=n_prompt,
        n_gen=n_gen,
        threads=threads,
        repetitions=repetitions,
        repacking_off=repacking_off,
    )
    for test in raw:
        kind = "pp" if test["n_gen"] == 0 else "tg" if test["n_prompt"] == 0 else None
        if kind is None:
            continue
        result[f"{kind}_tok_per_s"] = test["avg_ts"]
        result[f"{kind}_tok_per_s_stddev"] = test["stddev_ts"]
        samples = test.get("samples_ts") or [test["avg_ts"]]
        result[f"{kind}_samples_tok_per_s"] = samples
        result[f"{kind}_best_tok_per_s"] = max(samples)  # the undisturbed repetition
    result["version"] = llama_cpp.version()
    if raw:
        first = raw[0]
        for key in ("build_commit", "build_number", "cpu_info", "backends", "n_batch", "n_ubatch"):
            if key in first:
                result[key] = first[key]
    result["raw"] = raw
    return result


def no_repack_args(llama_cpp: LlamaCpp, gguf_path: str) -> list[str]:
    """llama-server's and llama-batched-bench's flag for `LlamaCpp.repacking_off`."""
    return ["--no-repack"] if llama_cpp.repacking_off(gguf_path) else []


def run_batched_bench(
    llama_cpp: LlamaCpp,
    gguf_path: str,
    *,
    n_prompt: int | Sequence[int],
    n_gen: int | Sequence[int],
    n_parallel: int | Sequence[int],
    threads: int,
    ctx_size: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[dict]:
    """`llama-batched-bench --output-format jsonl`: for every (pp, tg, pl), `pl` sequences
    of `pp` prompt tokens decoded as one batch, then `tg` steps of `pl` tokens.

    One dict per combination with llama.cpp's fields (pp, tg, pl, t_pp, speed_pp, t_tg,
    speed_tg, t, speed; speeds in tokens/s over all sequences). `ctx_size` defaults to
    what the largest combination needs.
    """

    def listed(x):
        return [int(x)] if isinstance(x, int) else [int(v) for v in x]

    pps, tgs, pls = listed(n_prompt), listed(n_gen), listed(n_parallel)
    ctx = ctx_size or max(pls) * (max(pps) + max(tgs))
    cmd = [
        llama_cpp.batched_bench, "-m", gguf_path,
        "-c", str(ctx),
        "-npp", ",".join(map(str, pps)),
        "-ntg", ",".join(map(str, tgs)),
        "-npl", ",".join(map(str, pls)),
        "-t", str(threads), "-tb", str(threads),
        "--output-format", "jsonl", *no_repack_args(llama_cpp, gguf_path), *extra_args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"llama-batched-bench failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    rows = [
        dict(r, repacking_off=llama_cpp.repacking_off(gguf_path))
        for r in _json_lines(proc.stdout + "\n" + proc.stderr)
        if "speed_tg" in r
    ]
    if not rows:
        raise RuntimeError("llama-batched-bench printed no results:\n" + proc.stderr[-4000:])
    return rows
