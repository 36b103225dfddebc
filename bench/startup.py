"""Start-up: launch to first token, cold (empty compilation and kernel caches) and warm,
for `jengine generate` on the bundled model and `jengine serve` on the benchmark model.

Where it sits: every start is a fresh process, as a user runs it. "Cold" points
`JENGINE_COMPILATION_CACHE` and `JENGINE_KERNEL_CACHE` at empty folders, so XLA compiles
every step shape and the CPU attention kernel is built; "warm" runs the same command again
with those folders filled. For `generate` the figure is the whole command (it prints one
short completion); for `serve` it is launch to the first token of one request. The engine's
log gives the number of compiled step shapes, the warmup seconds and the ready time.

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

from .common import add_common_args, package_versions, print_header, write_result
from .http_client import JengineServer, completion_body
from .workloads import make_bench_model

READY_LINE = re.compile(
    r"warmup compiled (\d+) step shapes in ([\d.]+)s; engine ready in ([\d.]+)s"
)


def parse_log(text: str) -> dict:
    match = READY_LINE.search(text)
    if match is None:
        return {}
    shapes, warmup, ready = match.groups()
    return dict(step_shapes=int(shapes), warmup_s=float(warmup), engine_ready_s=float(ready))


def time_generate() -> dict:
    command = [sys.executable, "-m", "jengine.entrypoints.cli", "generate", "ROMEO:",
               "--max-tokens", "16", "--temperature", "0"]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"jengine generate failed:\n{result.stderr[-3000:]}")
    return dict(seconds=elapsed, **parse_log(result.stderr))


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
        prog="jengine bench startup", description=__doc__.split("\n")[0]
    )
    add_common_args(parser, "startup")
    parser.add_argument("--skip-serve", action="store_true")
    args = parser.parse_args(argv)

    versions = package_versions()
    print_header("startup", args, versions)
    model = make_bench_model(args.model_dir)
    results = {}
    with tempfile.TemporaryDirectory(prefix="jengine-startup-") as caches:
        for command, run in (("generate", time_generate), ("serve", lambda: time_serve(model))):
            if command == "serve" and args.skip_serve:
                continue
            # Fresh, empty caches for this command's cold start; the warm start reuses them.
            os.environ["JENGINE_COMPILATION_CACHE"] = os.path.join(caches, command, "xla")
            os.environ["JENGINE_KERNEL_CACHE"] = os.path.join(caches, command, "kernels")
            for state in ("cold", "warm"):
                result = run()
                results[f"{command} {state}"] = result
                print(
                    f"jengine {command} {state}: {result['seconds']:.1f} s to the first token; "
                    f"{result.get('step_shapes')} step shapes, warmup "
                    f"{result.get('warmup_s')} s, engine ready in {result.get('engine_ready_s')} s"
                )
    write_result("startup", args, versions, dict(results=results))


if __name__ == "__main__":
    main()
