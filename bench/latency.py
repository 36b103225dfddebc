"""Single-stream latency, workload C: time to first token and decode tokens/s of one
request, jengine against transformers and llama.cpp, with this machine's bandwidth
roofline.

Workload C (bench/workloads.py): one request, a 128-token prompt, 256 greedy output tokens
(EOS masked on every side), on the benchmark model or a GGUF (`--model smollm2`: jengine
and llama.cpp then run the file as it is, its matrices quantized, and as F32; each row is
compared with the other engine's row on the same weights). In one run:
- jengine: the request through `LLMEngine` with per-token timestamps (TTFT = the first
  token's arrival, decode rate = the rest over the time they took), best of `--repeats`;
- transformers `generate`: TTFT = a 1-token generate, decode rate from a 256-token one;
- llama.cpp `llama-bench` (if built): pp128 (TTFT = 128 / its prompt rate) and tg256.
jengine's engines and llama-bench take turns for `--rounds` rounds, and a ratio to
llama.cpp is the median of the rounds' own ratios: this VM's memory rate drifts by 15-25%
within minutes, for both engines alike, so only figures measured side by side compare.
The roofline of a decode step is the weight bytes it must read over the measured memory
bandwidth (a multi-threaded read of 1 GiB through XLA).

    jengine bench latency [--repeats 5] [--rounds 3] [--skip-llama-cpp]
        [--num-scheduler-steps K]
"""

import argparse
import os
import statistics
import time

from .common import (
    add_common_args,
    add_llama_cpp_args,
    add_scheduler_steps_arg,
    count,
    gguf_model,
    jengine_rows,
    llama_cpp_models,
    model_config,
    package_versions,
    print_header,
    same_weights,
    weights_of,
    write_result,
)
from .roofline import read_bandwidth_gbs, weight_bytes
from .workloads import make_bench_model, workload_c


def single_stream(llm, prompt: list[int], max_tokens: int, repeats: int, top_p=None) -> dict:
    """`prompt` alone through `llm`'s engine, prefix cache reset, `repeats` times after a
    first run that pays first-use costs: the best TTFT and decode rate, and the compiles
    after warmup."""
    from jengine import SamplingParams
    from jengine.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    sampling = dict(temperature=1.0, top_p=top_p, seed=0) if top_p else dict(temperature=0)
    params = SamplingParams(**sampling, max_tokens=max_tokens, min_tokens=max_tokens)
    runs = []
    for repeat in range(repeats + 1):  # the first run pays first-use costs
        llm.reset_prefix_cache()
        started, host_started = time.perf_counter(), time.thread_time()
        engine.add_request(
            f"latency-{repeat}",
            {"prompt_token_ids": prompt},
            params,
            output_kind=RequestOutputKind.DELTA,
        )
        arrivals = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                arrivals += [time.perf_counter()] * len(output.outputs[0].token_ids)
        assert len(arrivals) == max_tokens, len(arrivals)
        runs.append(
            dict(
                ttft_s=arrivals[0] - started,
                decode_tok_per_s=(max_tokens - 1) / (arrivals[-1] - arrivals[0]),
                # The engine's own thread (the in-process engine core runs here): on a CPU
                # its host work takes cores from the device's threads, async or not.
                host_cpu_ms_per_token=(time.thread_time() - host_started) * 1e3 / max_tokens,
            )
        )
    runs = runs[1:]
    return dict(
        ttft_s=min(r["ttft_s"] for r in runs),
        decode_tok_per_s=max(r["decode_tok_per_s"] for r in runs),
        host_cpu_ms_per_token=min(r["host_cpu_ms_per_token"] for r in runs),
        runs=runs,
        compiles_after_warmup=llm.engine_core.compiles_after_warmup(),
        # The weights' pages (jengine/runner/huge_pages.py): 4 KiB pages stream slower.
        huge_pages=llm.engine_core.runner.huge_pages.result().describe(),
    )


def llama_cpp_peer(args, path: str):
    """(llama.cpp, its row name -> the GGUF it runs, its version) for the rounds, found and
    converted once; None where llama.cpp is not built."""
    from .peers.llama_cpp import find_llama_cpp

    llama_cpp = find_llama_cpp(args.llama_cpp_dir)
    if llama_cpp is None:
        print("llama.cpp: not found (bench/peers/build_llama_cpp.sh builds it); skipped")
        return None
    models = llama_cpp_models(llama_cpp, path, args.int8)
    for name, gguf in models.items():
        if why := llama_cpp.repacking_off(gguf):
            print(f"{name}: {why}")
    return llama_cpp, models, llama_cpp.version()


def llama_cpp_latency(args, peer, prompt_len: int, max_tokens: int) -> dict:
    """llama-bench pp/tg on each of `peer`'s GGUFs (`llama_cpp_peer`), by row."""
    from .peers.llama_cpp import run_llama_bench

    llama_cpp, models, version = peer
    results = {}
    for name, gguf in models.items():
        result = run_llama_bench(
            llama_cpp,
            gguf,
            n_prompt=prompt_len,
            n_gen=max_tokens,
            threads=args.threads,
            repetitions=args.repeats,
        )
        results[name] = dict(
            ttft_s=prompt_len / result["pp_tok_per_s"],
            decode_tok_per_s=result["tg_tok_per_s"],
            llama_bench=result,
            version=version,
        )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="jengine bench latency", description=__doc__.split("\n\n")[0]
    )
    add_common_args(parser, "latency")
    add_llama_cpp_args(parser)
    add_scheduler_steps_arg(parser)
    parser.add_argument("--repeats", type=count, default=5)
    parser.add_argument(
        "--rounds",
        type=count,
        default=3,
        help="turns jengine and llama.cpp take, each with --repeats runs (ratios: the median "
        "of the rounds' own)",
    )
    parser.add_argument("--threads", type=count, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--int8",
        action="store_true",
        help="also jengine with --quantization int8 against llama.cpp's Q8_0 of the same "
        "weights (the benchmark model)",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        help="sample at temperature 1 with this top_p (jengine and transformers; default "
        "greedy; llama-bench's figures do not depend on it)",
    )
    args = parser.parse_args(argv)

    versions = package_versions("transformers", "torch")
    print_header("latency", args, versions)
    path = gguf_model(args) or make_bench_model(args.model_dir)
    (prompt,), max_tokens = workload_c()
    step_bytes = weight_bytes(model_config(path))
    bandwidth = read_bandwidth_gbs(step_bytes)
    roofline = bandwidth * 1e9 / step_bytes
    print(f"memory bandwidth {bandwidth:.1f} GB/s; weights {step_bytes / 1e6:.0f} MB "
          f"per decode step; roofline {roofline:.0f} tok/s")  # fmt: skip

    from jengine import LLM

    # A GGUF runs as it is (kept quantized: "jengine (Q4_1)") and dequantized ("jengine
    # (F32)"), beside llama.cpp's rows of the same names.
    rows = jengine_rows(path, args.int8)
    engines = {
        name: LLM(
            path,
            dtype="float32",
            max_model_len=512,
            quantization=quantization,
            num_scheduler_steps=args.num_scheduler_steps,
        )
        for name, quantization in rows.items()
    }
    peer = None if args.skip_llama_cpp else llama_cpp_peer(args, path)
    rounds = []
    for _ in range(max(1, args.rounds)):
        figures = {
            name: single_stream(llm, prompt, max_tokens, args.repeats, args.top_p)
            for name, llm in engines.items()
        }
        if peer is not None:
            figures |= llama_cpp_latency(args, peer, len(prompt), max_tokens)
        rounds.append(figures)
    # Each row's best over the rounds, with every round's own figures (the rest, such as
    # the compiles after warmup so far, from the last round).
    results = {
        name: dict(
            rounds[-1][name],
            ttft_s=min(r[name]["ttft_s"] for r in rounds),
            decode_tok_per_s=max(r[name]["decode_tok_per_s"] for r in rounds),
            rounds=[{key: r[name][key] for key in ("ttft_s", "decode_tok_per_s")} for r in rounds],
        )
        for name in rounds[-1]
    }
    if not args.skip_transformers:
        from .peers.transformers_peer import TransformersPeer

        peer = TransformersPeer(path, args.threads)
        runs = [
            peer.latency(prompt, max_tokens, args.top_p) for _ in range(max(1, args.repeats // 2))
        ]
        results["transformers"] = dict(
            ttft_s=min(r["ttft_s"] for r in runs),
            decode_tok_per_s=max(r["decode_tok_per_s"] for r in runs),
            runs=runs,
        )
    for name, r in results.items():
        host = r.get("host_cpu_ms_per_token")
        print(f"{name:>12}: TTFT {1000 * r['ttft_s']:6.1f} ms, decode "
              f"{r['decode_tok_per_s']:6.1f} tok/s"
              + (f", engine thread {host:.2f} ms CPU a token" if host else ""))  # fmt: skip
    ratios = {}
    for row in rows:
        if weights_of(row) in ("", "(F32)"):  # the float32 weights the roofline counts
            ratios[f"{row} decode / bandwidth roofline"] = (
                results[row]["decode_tok_per_s"] / roofline
            )
    peers = [name for name in results if name not in rows]
    for row, peer in same_weights(list(rows), peers):
        # Side by side: each round's ratio (transformers runs once, after the rounds).
        pairs = [(r[row], r[peer]) for r in rounds if peer in r] or [(results[row], results[peer])]
        for what, key in (("decode", "decode_tok_per_s"), ("TTFT", "ttft_s")):
            per_round = [ours[key] / theirs[key] for ours, theirs in pairs]
            ratios[f"{row} {what} / {peer}"] = statistics.median(per_round)
            if len(per_round) > 1:
                print(f"{row} {what} / {peer}, by round: "
                      + ", ".join(f"{ratio:.2f}x" for ratio in per_round))  # fmt: skip
    for name, ratio in ratios.items():
        print(f"{name} = {ratio:.2f}x")
    write_result(
        "latency",
        args,
        versions,
        dict(
            workload="C",
            top_p=args.top_p,
            prompt_len=len(prompt),
            output_len=max_tokens,
            memory_bandwidth_gbs=bandwidth,
            weight_bytes=step_bytes,
            bandwidth_roofline_tok_per_s=roofline,
            results=results,
            ratios=ratios,
        ),
    )


if __name__ == "__main__":
    main()
