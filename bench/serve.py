"""Serving under load: a Poisson load generator against `jengine serve` and llama.cpp's
`llama-server`, both started by the benchmark on the same model, swept over arrival rates.

Where it sits: each server gets, per rate, the same `--num-requests` requests (128-token
prompts, 64 greedy output tokens, EOS masked) with exponential gaps (seed 0), bounded by
`--max-seconds` of sending; every request streams, and the client stamps each chunk that
carries text. Per rate: time to first token, inter-token latency, time per output token
and end-to-end latency (p50 / p90 / p99), and request and output-token throughput over
the time from the first send to the last finish. The sweep stops early once a server
is past saturation (its p99 TTFT passes 5 s: requests queue without bound). Loopback only; the
benchmark model has a tokenizer, so every token arrives as text.

    jengine bench serve [--rates 1,2,4,8,16] [--num-requests 48] [--skip-llama-cpp]
"""

import argparse
import asyncio
import os
import random
import statistics
import time

import httpx2

from .common import (
    add_common_args,
    add_llama_cpp_args,
    count,
    package_versions,
    print_header,
    write_result,
)
from .http_client import JengineServer, stream_completion
from .workloads import make_bench_model

PROMPT_LEN = 128
OUTPUT_LEN = 64
MAX_MODEL_LEN = 512
SATURATED_TTFT_S = 5.0


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q):
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return dict(p50=at(0.50), p90=at(0.90), p99=at(0.99), mean=statistics.fmean(ordered))


async def run_rate(stream, prompts: list[list[int]], rate: float, max_seconds: float) -> dict:
    """Send `prompts` at Poisson arrivals of `rate` per second; `stream(prompt)` returns the
    arrival times of the request's text chunks and its completion tokens."""
    gaps = random.Random(0)
    records = []

    async def one(prompt):
        sent = time.perf_counter()
        arrivals, tokens = await stream(prompt)
        records.append((sent, arrivals, tokens))

    tasks, started = [], time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        await asyncio.sleep(gaps.expovariate(rate))
        if time.perf_counter() - started > max_seconds:
            break
    await asyncio.gather(*tasks)
    finished = max(arrivals[-1] for _, arrivals, _ in records if arrivals)
    ttft, itl, tpot, e2e = [], [], [], []
    for sent, arrivals, tokens in records:
        ttft.append(arrivals[0] - sent)
        e2e.append(arrivals[-1] - sent)
        itl += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        if tokens > 1:
            tpot.append((arrivals[-1] - arrivals[0]) / (tokens - 1))
    duration = finished - started
    return dict(
        rate=rate,
        requests=len(records),
        duration_s=duration,
        request_throughput=len(records) / duration,
        output_tok_per_s=sum(tokens for *_, tokens in records) / duration,
        ttft_s=percentiles(ttft),
        itl_s=percentiles(itl),
        tpot_s=percentiles(tpot),
        e2e_s=percentiles(e2e),
    )


def sweep(name: str, stream_factory, prompts, rates, max_seconds) -> list[dict]:
    results = []
    for rate in rates:

        async def go(rate=rate):
            async with stream_factory() as stream:
                return await run_rate(stream, prompts, rate, max_seconds)

        result = asyncio.run(go())
        results.append(result)
        print(
            f"{name:>14} @ {rate:5.1f} req/s: TTFT p50 {1000 * result['ttft_s']['p50']:7.1f} "
            f"p99 {1000 * result['ttft_s']['p99']:7.1f} ms, ITL p50 "
            f"{1000 * result['itl_s'].get('p50', 0):6.1f} ms, {result['output_tok_per_s']:7.1f} "
            f"tok/s, {result['request_throughput']:5.2f} req/s",
            flush=True,
        )
        # Past saturation requests queue without bound: once the p99 TTFT passes
        # SATURATED_TTFT_S the knee (where it passes 1 s) has been swept.
        if result["ttft_s"]["p99"] > SATURATED_TTFT_S:
            print(f"{name}: saturated at {rate} req/s")
            break
    return results


class _HttpStreams:
    """An async client bound to one server; calling it streams one completion."""

    def __init__(self, base_url: str, send):
        self.base_url, self.send = base_url, send

    async def __aenter__(self):
        limits = httpx2.Limits(max_connections=512)
        self.client = httpx2.AsyncClient(base_url=self.base_url, timeout=None, limits=limits)
        return lambda prompt: self.send(self.client, prompt, OUTPUT_LEN)

    async def __aexit__(self, *exc):
        await self.client.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="jengine bench serve", description=__doc__.split("\n\n")[0]
    )
    add_common_args(parser, "serve")
    add_llama_cpp_args(parser)
    parser.add_argument("--rates", default="1,2,4,8,16", help="arrival rates (req/s) to sweep")
    parser.add_argument("--num-requests", type=count, default=48)
    parser.add_argument("--max-seconds", type=float, default=60.0, help="of sending, per rate")
    parser.add_argument("--llama-np", type=count, default=16, help="llama-server -np")
    parser.add_argument("--threads", type=count, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args(argv)

    versions = package_versions()
    print_header("serve", args, versions)
    path = make_bench_model(args.model_dir)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 31000) for _ in range(PROMPT_LEN)] for _ in range(args.num_requests)
    ]
    rates = [float(r) for r in args.rates.split(",")]
    results = {}
    flags = [
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--no-enable-prefix-caching",
    ]
    with JengineServer(path, flags) as server:
        results["jengine serve"] = sweep(
            "jengine serve",
            lambda: _HttpStreams(server.base_url, stream_completion),
            prompts,
            rates,
            args.max_seconds,
        )
    if not args.skip_llama_cpp:
        from .peers.llama_cpp import convert_to_gguf, find_llama_cpp
        from .peers.llama_server import LlamaServer

        llama_cpp = find_llama_cpp(args.llama_cpp_dir)
        if llama_cpp is None:
            print("llama.cpp: not found (bench/peers/build_llama_cpp.sh builds it); skipped")
        else:
            with LlamaServer(
                llama_cpp,
                convert_to_gguf(llama_cpp, path),
                parallel=args.llama_np,
                ctx_size=args.llama_np * MAX_MODEL_LEN,
                threads=args.threads,
            ) as llama:
                results["llama-server"] = sweep(
                    "llama-server",
                    lambda: _HttpStreams(llama.base_url, llama.stream_completion),
                    prompts,
                    rates,
                    args.max_seconds,
                )
    write_result(
        "serve",
        args,
        versions,
        dict(prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN, results=results),
    )


if __name__ == "__main__":
    main()
