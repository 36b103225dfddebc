"""What serving LoRA adapters costs: workload A with four adapters mixed against the same
engine shapes with no adapter, and single-stream decode with one adapter against none.

On the 56M-parameter benchmark Llama (float32), in one run, passes alternating:
- "no LoRA": an engine without `enable_lora` (the baseline);
- "LoRA engine, base requests": `enable_lora=True, max_loras=4, max_lora_rank=16`, every
  request on the base model (what turning LoRA on costs a request that uses none);
- "4 adapters mixed": the same engine, request i on adapter i % 4 (rank 16 on all seven
  projections, random weights handed over with `add_lora`).
Workload A (bench/workloads.py): 128 requests, prompts of 64-256 tokens, 128 greedy
output tokens each; prefix cache reset before every pass. Single stream: workload C (one
128-token prompt, 256 output tokens), decode tok/s after the first token. Each row's
figure is its best pass; the ratio is against "no LoRA". The base-model rows are checked
to give the same tokens.

    jengine bench lora [--rounds 2] [--out bench/results/lora.json]
"""

import argparse
import time

import numpy as np

from .common import add_common_args, count, package_versions, print_header, write_result
from .workloads import make_bench_model, workload_a, workload_c

MAX_MODEL_LEN = 512
NUM_ADAPTERS = 4
RANK = 16


def _random_adapter(config, seed: int) -> dict:
    """Rank-16 A and B on every projection, small enough to keep the text plausible."""
    from jengine.models.lora import TARGETS, projection_sizes

    rng = np.random.default_rng(seed)
    layers = config.num_hidden_layers
    weights = {}
    for target in TARGETS:
        out, inputs = projection_sizes(config)[target]
        a = rng.standard_normal((layers, RANK, inputs)).astype(np.float32) / np.sqrt(inputs)
        b = rng.standard_normal((layers, out, RANK)).astype(np.float32) * 0.01
        weights[target] = (a, b)
    return weights


class Engine:
    def __init__(self, path: str, args, lora: bool):
        from jengine import LLM

        options = dict(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK) if lora else {}
        self.llm = LLM(
            path,
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=args.kv_cache_gib << 30,
            **options,
        )
        self.adapters = []
        if lora:
            config = self.llm.engine_core.runner.lora.model_config
            self.adapters = [
                self.llm.add_lora(f"adapter{i}", _random_adapter(config, i))
                for i in range(NUM_ADAPTERS)
            ]

    def run(self, prompts, max_tokens, adapters: bool) -> tuple[float, list[list[int]]]:
        from jengine import SamplingParams

        if not self.llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset")
        loras = [self.adapters[i % NUM_ADAPTERS] for i in range(len(prompts))] if adapters else None
        params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
        started = time.perf_counter()
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
        )
        seconds = time.perf_counter() - started
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        assert all(len(t) == max_tokens for t in tokens)
        return seconds, tokens

    def decode_rate(self, prompt, max_tokens, adapter: bool) -> float:
        """Decode tok/s of one stream: the tokens after the first over the time after it."""
        from jengine import SamplingParams

        lora = self.adapters[0] if adapter else None
        params = SamplingParams(temperature=0, max_tokens=1, min_tokens=1)
        self.llm.reset_prefix_cache()
        started = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora)
        first = time.perf_counter() - started
        params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
        self.llm.reset_prefix_cache()
        started = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora)
        return (max_tokens - 1) / (time.perf_counter() - started - first)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="jengine bench lora", description=__doc__)
    add_common_args(parser, "lora")
    parser.add_argument("--rounds", type=count, default=2)
    parser.add_argument("--kv-cache-gib", type=count, default=2)
    args = parser.parse_args(argv)
    versions = package_versions("jax", "jaxlib")
    print_header("lora", args, versions)
    path = make_bench_model(args.model_dir)
    plain, lora = Engine(path, args, lora=False), Engine(path, args, lora=True)
    prompts, max_tokens = workload_a()
    num_tokens = len(prompts) * max_tokens
    rows = {"no LoRA": [], "LoRA engine, base requests": [], "4 adapters mixed": []}
    base_tokens = {}
    for _ in range(args.rounds):
        for name, engine, adapters in (
            ("no LoRA", plain, False),
            ("LoRA engine, base requests", lora, False),
            ("4 adapters mixed", lora, True),
        ):
            seconds, tokens = engine.run(prompts, max_tokens, adapters)
            rows[name].append(num_tokens / seconds)
            if not adapters:
                base_tokens[name] = tokens
    same = base_tokens["no LoRA"] == base_tokens["LoRA engine, base requests"]
    baseline = max(rows["no LoRA"])
    throughput = {
        name: dict(tok_s=round(max(rates), 1), ratio=round(max(rates) / baseline, 3))
        for name, rates in rows.items()
    }
    (prompt,), decode_tokens = workload_c()
    decode = {"no LoRA": [], "one adapter": []}
    for _ in range(args.rounds):
        decode["no LoRA"].append(plain.decode_rate(prompt, decode_tokens, adapter=False))
        decode["one adapter"].append(lora.decode_rate(prompt, decode_tokens, adapter=True))
    decode_base = max(decode["no LoRA"])
    single = {
        name: dict(tok_s=round(max(rates), 1), ratio=round(max(rates) / decode_base, 3))
        for name, rates in decode.items()
    }
    print(f"\nworkload A ({len(prompts)} requests x {max_tokens} tokens), best of {args.rounds}")
    for name, row in throughput.items():
        print(f"  {name:28s} {row['tok_s']:9.1f} tok/s  {row['ratio']:.3f}x no LoRA")
    print(f"  base-model tokens identical with and without LoRA: {same}")
    print("single stream (workload C), decode")
    for name, row in single.items():
        print(f"  {name:28s} {row['tok_s']:9.1f} tok/s  {row['ratio']:.3f}x no LoRA")
    compiles = lora.llm.engine_core.compiles_after_warmup()
    print(f"compiles after warmup (LoRA engine): {compiles}")
    write_result(
        "lora",
        args,
        versions,
        dict(
            throughput=throughput,
            single_stream_decode=single,
            base_tokens_identical=same,
            compiles_after_warmup=compiles,
        ),
    )


if __name__ == "__main__":
    main()
