"""Offline throughput, workload A: jengine against the peers a CPU user would pick.

Workload A (bench/workloads.py): 128 requests, prompts of 64-256 tokens, exactly 128
greedy output tokens each, on the 56M-parameter random Llama (float32), or on a GGUF
(`--model smollm2`: jengine runs the file as it is, its matrices kept quantized, and
dequantized to float32, llama.cpp the file as it is and an F32 copy, transformers
dequantizes it; each jengine row is compared with the peers on the same weights). In one
run:
- jengine `LLM.generate` (engine defaults; prefix cache reset before every pass);
- `jengine serve` (prefix caching off), every request sent at once over HTTP;
- Hugging Face transformers `generate`, prompts sorted by length, one pass per batch size
  (default 16, 32, 64), its best pass being its figure;
- llama.cpp's `llama-server` (if built: bench/peers/build_llama_cpp.sh), one pass per
  `-np` (default 16, 64), its best being its figure.
Passes alternate between the engines so all meet the same spells of machine noise. EOS
is masked the same way everywhere (min_tokens / min_new_tokens / ignore_eos), every pass
is checked to make 128 x 128 tokens, and the greedy outputs are compared between every
pair of engines. The compute roofline is the workload's model FLOPs over this machine's
measured matmul rate.

    jengine bench throughput [--rounds 2] [--skip-llama-cpp] [--out bench/results/throughput.json]
"""

import argparse
import asyncio
import os
import statistics
import time

from .common import (
    add_common_args,
    add_llama_cpp_args,
    add_scheduler_steps_arg,
    compare_outputs,
    count,
    gguf_model,
    jengine_rows,
    llama_cpp_models,
    model_config,
    package_versions,
    print_header,
    same_weights,
    write_result,
)
from .http_client import JengineServer, complete_all
from .roofline import matmul_gflops, workload_flops
from .workloads import make_bench_model, workload_a

MAX_MODEL_LEN = 512


class JengineOffline:
    def __init__(self, path: str, args, name: str = "jengine", **engine_kwargs):
        """`engine_kwargs`: more LLM arguments (bench/parallel.py's tensor and data
        parallel sizes)."""
        from jengine import LLM, SamplingParams

        self.name = name
        limits = dict(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        )
        self.llm = LLM(
            path,
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=args.kv_cache_gib << 30,
            num_scheduler_steps=args.num_scheduler_steps,
            **{name: value for name, value in limits.items() if value is not None},
            **engine_kwargs,
        )
        self.sampling_params = SamplingParams
        self.configs = ["defaults"] * args.rounds

    def run(self, config, prompts, max_tokens):
        # Every pass computes every prompt: nothing may come from the prefix cache.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset: requests still running")
        params = self.sampling_params(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        if any(o.num_cached_tokens for o in outputs):
            raise RuntimeError("a prompt was served from the prefix cache")
        return [list(o.outputs[0].token_ids) for o in outputs]

    def details(self) -> dict:
        client = self.llm.llm_engine.client
        return dict(compiles_after_warmup=client.call_utility("compiles_after_warmup"))

    def close(self) -> None:
        self.llm.shutdown()


class JengineServe:
    def __init__(self, path: str, args, name: str = "jengine serve"):
        self.name = name
        flags = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                 "--kv-cache-memory-bytes", str(args.kv_cache_gib << 30),
                 "--no-enable-prefix-caching",
                 "--num-scheduler-steps", str(args.num_scheduler_steps)]  # fmt: skip
        self.server = JengineServer(path, flags)
        self.configs = ["defaults"] * args.rounds

    def run(self, config, prompts, max_tokens):
        tokens = asyncio.run(complete_all(self.server.base_url, prompts, max_tokens))
        return tokens  # the server path reports counts only

    def details(self) -> dict:
        return dict(startup_s=self.server.startup_s)

    def close(self) -> None:
        self.server.stop()


class Transformers:
    name = "transformers"

    def __init__(self, path: str, args):
        from .peers.transformers_peer import TransformersPeer

        self.peer = TransformersPeer(path, args.threads)
        self.peer.generate([[5, 6, 7]] * 2, 2, 2)  # first-run costs
        self.configs = [int(size) for size in args.hf_batch_sizes.split(",")]

    def run(self, batch_size, prompts, max_tokens):
        return self.peer.generate(prompts, max_tokens, batch_size)

    def details(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class LlamaCpp:
    def __init__(self, name: str, gguf: str, args, llama_cpp):
        self.name = name
        self.llama_cpp = llama_cpp
        self.gguf = gguf
        self.threads = args.threads
        self.configs = [int(n) for n in args.llama_np.split(",")]
        if why := llama_cpp.repacking_off(gguf):
            print(f"{name}: {why}")

    def before(self, parallel) -> None:
        """Start llama-server with `parallel` slots (not timed)."""
        from .peers.llama_server import LlamaServer

        # Each slot holds one request of at most MAX_MODEL_LEN tokens.
        self.server = LlamaServer(
            self.llama_cpp,
            self.gguf,
            parallel=parallel,
            ctx_size=parallel * MAX_MODEL_LEN,
            threads=self.threads,
        ).__enter__()

    def run(self, parallel, prompts, max_tokens):
        return asyncio.run(self.server.complete_all(prompts, max_tokens))

    def after(self) -> None:
        self.server.__exit__(None, None, None)

    def details(self) -> dict:
        return dict(
            version=self.llama_cpp.version(), repacking_off=self.llama_cpp.repacking_off(self.gguf)
        )

    def close(self) -> None:
        pass


def build_engines(path: str, args) -> list:
    # A GGUF: `LLM.generate` on the file as it is and dequantized, the server as it is.
    rows = jengine_rows(path)
    engines = [JengineOffline(path, args, row, quantization=q) for row, q in rows.items()]
    if not args.skip_serve:
        first = next(iter(rows))
        engines.append(JengineServe(path, args, first.replace("jengine", "jengine serve")))
    if not args.skip_transformers:
        engines.append(Transformers(path, args))
    if not args.skip_llama_cpp:
        from .peers.llama_cpp import find_llama_cpp

        llama_cpp = find_llama_cpp(args.llama_cpp_dir)
        if llama_cpp is None:
            print("llama.cpp: not found (bench/peers/build_llama_cpp.sh builds it); skipped")
        else:
            engines += [
                LlamaCpp(name, gguf, args, llama_cpp)
                for name, gguf in llama_cpp_models(llama_cpp, path).items()
            ]
    return engines


def timed_pass(engine, config, prompts, max_tokens) -> tuple[dict, list | None]:
    """One pass over the workload; set-up an engine needs per configuration (starting a
    server) happens in `before`, outside the timing."""
    getattr(engine, "before", lambda config: None)(config)
    try:
        started = time.perf_counter()
        result = engine.run(config, prompts, max_tokens)
        elapsed = time.perf_counter() - started
    finally:
        getattr(engine, "after", lambda: None)()
    tokens, outputs = (result, None) if isinstance(result, int) else (sum(map(len, result)), result)
    expected = max_tokens * len(prompts)
    if tokens != expected:
        raise RuntimeError(f"{engine.name} made {tokens} tokens, expected {expected}")
    return dict(config=config, elapsed_s=elapsed, output_tok_per_s=tokens / elapsed), outputs


def run_passes(engines, prompts, max_tokens) -> tuple[dict, dict]:
    """Every engine's passes, alternating between the engines; the outputs of each engine's
    best pass."""
    passes = {engine.name: [] for engine in engines}
    outputs = {engine.name: None for engine in engines}
    best = {engine.name: 0.0 for engine in engines}
    for index in range(max(len(engine.configs) for engine in engines)):
        for engine in engines:
            if index >= len(engine.configs):
                continue
            result, out = timed_pass(engine, engine.configs[index], prompts, max_tokens)
            passes[engine.name].append(result)
            if result["output_tok_per_s"] > best[engine.name]:
                best[engine.name], outputs[engine.name] = result["output_tok_per_s"], out
            print(
                f"{engine.name:>14} [{result['config']}]: {result['output_tok_per_s']:8.1f} "
                f"output tok/s ({result['elapsed_s']:.1f} s)",
                flush=True,
            )
    return passes, outputs


def engine_results(engines, passes) -> list[dict]:
    """Each engine's best pass, median and every pass, with its details."""
    results = []
    for engine in engines:
        rates = [p["output_tok_per_s"] for p in passes[engine.name]]
        best = max(passes[engine.name], key=lambda p: p["output_tok_per_s"])
        results.append(
            dict(
                engine=engine.name,
                output_tok_per_s=best["output_tok_per_s"],
                best_config=best["config"],
                median_output_tok_per_s=statistics.median(rates),
                passes=passes[engine.name],
                **engine.details(),
            )
        )
    return results


def summarize(engines, passes, roofline_tok_per_s) -> tuple[list, dict]:
    results = engine_results(engines, passes)
    by_name = {r["engine"]: r["output_tok_per_s"] for r in results}
    ours = [name for name in by_name if name.startswith("jengine")]
    peers = [name for name in by_name if name not in ours]
    ratios = {f"{a} / {b}": by_name[a] / by_name[b] for a, b in same_weights(ours, peers)}
    for row in ours:
        if row in ("jengine", "jengine (F32)"):  # the float32 FLOPs of the roofline
            ratios[f"{row} / compute roofline"] = by_name[row] / roofline_tok_per_s
    return results, ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="jengine bench throughput", description=__doc__.split("\n\n")[0]
    )
    add_common_args(parser, "throughput")
    add_scheduler_steps_arg(parser)
    add_llama_cpp_args(parser)
    parser.add_argument("--num-requests", type=count, default=128)
    parser.add_argument("--rounds", type=count, default=2, help="passes of each jengine engine")
    parser.add_argument("--threads", type=count, default=len(os.sched_getaffinity(0)))
    # Unset: the engine's defaults (128 sequences, a 2048-token budget).
    parser.add_argument("--max-num-seqs", type=count, default=None)
    parser.add_argument("--max-num-batched-tokens", type=count, default=None)
    parser.add_argument("--kv-cache-gib", type=count, default=1)
    parser.add_argument("--hf-batch-sizes", default="16,32,64")
    parser.add_argument("--llama-np", default="16,64", help="llama-server -np values to try")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    args = parser.parse_args(argv)

    versions = package_versions("transformers", "torch")
    print_header("throughput", args, versions)
    path = gguf_model(args) or make_bench_model(args.model_dir)
    prompts, max_tokens = workload_a(num_requests=args.num_requests)
    gflops = matmul_gflops()
    flops = workload_flops([len(p) for p in prompts], max_tokens, model_config(path))
    roofline = max_tokens * len(prompts) / (flops / (gflops * 1e9))
    print(f"matmul {gflops:.0f} GFLOP/s; workload {flops / 1e12:.2f} TFLOP; "
          f"compute roofline {roofline:.0f} output tok/s")  # fmt: skip

    engines = build_engines(path, args)
    try:
        passes, outputs = run_passes(engines, prompts, max_tokens)
        results, ratios = summarize(engines, passes, roofline)  # engines still up
    finally:
        for engine in engines:
            engine.close()
    for name, ratio in ratios.items():
        print(f"{name} = {ratio:.2f}x")
    write_result(
        "throughput",
        args,
        versions,
        dict(
            workload="A",
            num_requests=len(prompts),
            output_len=max_tokens,
            matmul_gflops=gflops,
            workload_tflop=flops / 1e12,
            compute_roofline_tok_per_s=roofline,
            results=results,
            ratios=ratios,
            output_match=compare_outputs(outputs),
        ),
    )


if __name__ == "__main__":
    main()
