"""What every benchmark shares: the machine and versions it ran on, its settings, the
JSON it writes under bench/results/, and the output comparison between engines.

Where it sits: each `bench/<name>.py` (run as `jengine bench <name>` or
`python -m bench.<name>`) builds its engines, times them, and hands a payload to
`write_result`, which prints and stores it with the machine, the versions and the
settings; `bench/report.py` builds the README table and plots from those files.

What it promises: a result file says everything needed to judge it — the CPU, cores and
memory, every engine's version, the settings (all command-line values), and, where engines
produced text, how often their greedy tokens agree (random weights make near-ties, so a
mismatch is reported, never hidden).
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import traceback
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL_DIR = os.path.expanduser("~/.cache/jengine/bench-llama-56m")


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory_gib = None
    return dict(
        cpu=cpu,
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        memory_gib=round(memory_gib, 1) if memory_gib else None,
        system=f"{platform.system()} {platform.release()}",
        python=platform.python_version(),
    )


def package_versions(*names: str) -> dict:
    versions = {}
    for name in ("jengine", "jax", "jaxlib", *names):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def count(value: str) -> int:
    """An argparse type: a whole number of at least 1 (requests, rounds, threads, ...),
    refused before any model loads."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def add_common_args(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--model-dir", default=DEFAULT_MODEL_DIR, help="benchmark model folder")
    parser.add_argument(
        "--model",
        default=None,
        help="a GGUF to run instead of the benchmark model ('smollm2' or a .gguf path): "
        "jengine and llama.cpp each run it as it is (kept quantized) and as float32, "
        "transformers dequantizes it to float32",
    )
    parser.add_argument(
        "--out", default=str(RESULTS_DIR / f"{name}.json"), help="where the JSON goes"
    )


def add_scheduler_steps_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-scheduler-steps",
        type=count,
        default=1,
        help="jengine's decode steps per program launch (the engine flag; default 1: off)",
    )


def add_llama_cpp_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--llama-cpp-dir",
        default=None,
        help="folder with llama-server / llama-bench (default: PATH, then the build cache of "
        "bench/peers/build_llama_cpp.sh)",
    )
    parser.add_argument("--skip-llama-cpp", action="store_true")


def gguf_model(args: argparse.Namespace) -> str | None:
    """The GGUF `--model` names, or None for the benchmark model."""
    if args.model is None:
        return None
    from jengine.models.checkpoint import gguf_file, resolve_model

    path = gguf_file(resolve_model(args.model))
    if path is None:
        raise SystemExit(f"--model {args.model}: not a GGUF file")
    return path


def model_config(path: str) -> dict:
    """The HF config of the benchmark model or a GGUF (what the rooflines need)."""
    from jengine.models.checkpoint import read_hf_config

    return read_hf_config(path)


def llama_cpp_models(llama_cpp, path: str, int8: bool = False) -> dict[str, str]:
    """llama.cpp's row name -> the GGUF it runs: the benchmark model converted to F32 by
    llama.cpp's converter (and with `int8` to its Q8_0, beside jengine's int8); a GGUF as
    it is (named by its weights' type) and an F32 copy."""
    from jengine.models.checkpoint import gguf_file

    from .peers.llama_cpp import convert_to_gguf, gguf_to_f32

    if gguf_file(path) is None:
        rows = {"llama.cpp": convert_to_gguf(llama_cpp, path)}
        if int8:
            rows["llama.cpp (Q8_0)"] = convert_to_gguf(llama_cpp, path, outtype="q8_0")
        return rows
    return {f"llama.cpp ({gguf_weight_type(path)})": path, "llama.cpp (F32)": gguf_to_f32(path)}


def jengine_rows(path: str, int8: bool = False) -> dict[str, str | None]:
    """jengine's row names -> the `quantization` each runs: the benchmark model as it is
    ("jengine", and with `int8` "jengine (int8)"); a GGUF as it is, its matrices kept
    quantized ("jengine (Q4_1)"), and dequantized to float32 ("jengine (F32)"), beside
    llama.cpp's rows of the same weights."""
    from jengine.models.checkpoint import gguf_file

    if gguf_file(path) is None:
        return {"jengine": None, "jengine (int8)": "int8"} if int8 else {"jengine": None}
    return {f"jengine ({gguf_weight_type(path)})": None, "jengine (F32)": "none"}


def weights_of(row: str) -> str:
    """The weights a result row ran: "(Q4_1)" for "jengine (Q4_1)" or "llama.cpp (Q4_1)",
    "" for the benchmark model's rows; transformers dequantizes a GGUF, so its rows count
    as "(F32)" wherever rows name their weights (`same_weights` takes care of that).
    jengine's int8 (a scale per 32 inputs) is llama.cpp's Q8_0 of the same weights."""
    weights = row[row.index("(") :] if "(" in row else ""
    return "(Q8_0)" if weights == "(int8)" else weights


def same_weights(ours: list[str], peers: list[str]) -> list[tuple[str, str]]:
    """(jengine row, peer row) pairs that ran the same weights: what a ratio may compare."""
    gguf = any(weights_of(row) for row in ours)
    pairs = []
    for peer in peers:
        weights = "(F32)" if gguf and peer.startswith("transformers") else weights_of(peer)
        pairs += [(row, peer) for row in ours if weights_of(row) == weights]
    return pairs


def gguf_weight_type(path: str) -> str:
    """The type most of a GGUF's matrices are stored in ("Q4_1", "F16", ...)."""
    import collections

    from jengine.models.gguf_reader import read_gguf

    tensors = read_gguf(path).tensors.values()
    types = collections.Counter(t.type_name for t in tensors if len(t.shape) == 2)
    return types.most_common(1)[0][0]


def print_header(name: str, args: argparse.Namespace, versions: dict) -> None:
    machine = machine_info()
    print(f"== jengine bench {name} ==")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
        f"{machine['system']}, Python {machine['python']}"
    )
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    print("settings: " + ", ".join(f"{k}={v}" for k, v in sorted(vars(args).items())))


def write_result(name: str, args: argparse.Namespace, versions: dict, payload: dict) -> dict:
    report = dict(
        benchmark=name,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        machine=machine_info(),
        versions=versions,
        settings={k: v for k, v in sorted(vars(args).items())},
        **payload,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")
    return report


def error_text(exc: BaseException) -> str:
    """The exception and the last frames that raised it, short enough for a report."""
    lines = traceback.format_exception(exc)
    return "".join(lines[-6:])[-3000:]


def token_match(a: list[list[int]], b: list[list[int]]) -> dict:
    """How two engines' greedy outputs agree: identical sequences, and tokens equal up to
    each sequence's first difference (after a difference, the contexts differ)."""
    same_sequences = sum(x == y for x, y in zip(a, b, strict=True))
    prefix_tokens = total = 0
    for x, y in zip(a, b, strict=True):
        total += max(len(x), len(y))
        for tx, ty in zip(x, y, strict=False):
            if tx != ty:
                break
            prefix_tokens += 1
    return dict(
        identical_sequences=same_sequences,
        sequences=len(a),
        sequence_match_rate=same_sequences / max(1, len(a)),
        token_match_rate=prefix_tokens / max(1, total),
    )


def compare_outputs(outputs: dict[str, list[list[int]]]) -> dict[str, dict]:
    """`token_match` between every pair of engines that returned outputs."""
    names = [n for n, o in outputs.items() if o is not None]
    pairs = {}
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            match = token_match(outputs[first], outputs[second])
            pairs[f"{first} vs {second}"] = match
            print(
                f"greedy outputs {first} vs {second}: {match['identical_sequences']}/"
                f"{match['sequences']} sequences identical, "
                f"{100 * match['token_match_rate']:.1f}% of tokens before the first difference"
            )
    return pairs
