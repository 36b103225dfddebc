"""Offline throughput, workload A (bench/README.md): jengine vs Hugging Face transformers.

Both run the same 56M-parameter random Llama (float32) on the same 128 prompts in one
process run, greedy, exactly 128 output tokens each:
- jengine: `LLM.generate` on all prompts (continuous batching, chunked prefill);
- transformers: `generate` in static batches of 32, left-padded, greedy, KV cache on.

Each engine is set up and warmed once, then timed over the whole workload in `--rounds`
rounds that alternate between the engines (jengine, transformers, jengine, ...), so both
see the same spells of machine noise. Every round is reported; the headline rate of an
engine is its best round (what it does undisturbed, as `timeit` reports a minimum), and
the ratio is of those. Written to JSON with the per-round figures.

    python -m bench.throughput [--rounds 2] [--out bench/results/throughput.json]
"""

import argparse
import json
import os
import statistics
import time

import torch

from bench.workloads import make_bench_model, workload_a


class JengineRun:
    """`LLM.generate` over the whole workload; the engine is built once."""

    name = "jengine"

    def __init__(self, path: str, prompts, max_tokens: int, args):
        from jengine import LLM, SamplingParams

        started = time.perf_counter()
        limits = dict(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        )
        self.llm = LLM(
            path,
            dtype="float32",
            max_model_len=512,
            kv_cache_memory_bytes=args.kv_cache_gib << 30,
            **{name: value for name, value in limits.items() if value is not None},
        )
        self.startup_s = time.perf_counter() - started
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.prompts = [{"prompt_token_ids": p} for p in prompts]
        self.llm.generate(self.prompts[:1], self.params, use_tqdm=False)  # first-run costs

    def run(self) -> int:
        # Every round computes every prompt: nothing may be served from the blocks the
        # previous round (or the warm-up request) left in the prefix cache.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset: requests still running")
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        assert not any(o.num_cached_tokens for o in outputs)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    def details(self) -> dict:
        return dict(
            startup_s=self.startup_s,
            compiles_after_warmup=self.llm.engine_core.compiles_after_warmup(),
        )


class TransformersRun:
    """`generate` in static, left-padded batches; the model is loaded once."""

    name = "transformers"

    def __init__(self, path: str, prompts, max_tokens: int, batch_size: int):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32
        ).eval()
        self.model.generation_config.pad_token_id = 0
        self.prompts, self.max_tokens, self.batch_size = prompts, max_tokens, batch_size
        self._generate(prompts[:2])  # first-run costs

    def _generate(self, batch) -> int:
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, prompt in enumerate(batch):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=self.max_tokens,
                min_new_tokens=self.max_tokens,
                do_sample=False,
            )
        return (out.shape[1] - width) * len(batch)

    def run(self) -> int:
        size = self.batch_size
        return sum(
            self._generate(self.prompts[i : i + size]) for i in range(0, len(self.prompts), size)
        )

    def details(self) -> dict:
        return dict(batch_size=self.batch_size)


def timed_round(engine, expected_tokens: int) -> dict:
    started = time.perf_counter()
    tokens = engine.run()
    elapsed = time.perf_counter() - started
    assert tokens == expected_tokens, (engine.name, tokens, expected_tokens)
    return dict(elapsed_s=elapsed, output_tok_per_s=tokens / elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir", default=os.path.expanduser("~/.cache/jengine/bench-llama-56m")
    )
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    # Unset: the engine's defaults (128 sequences, a 2048-token budget).
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default="bench/results/throughput.json")
    args = parser.parse_args()

    path = make_bench_model(args.model_dir)
    prompts, max_tokens = workload_a(num_requests=args.num_requests)
    expected_tokens = max_tokens * len(prompts)
    engines = [JengineRun(path, prompts, max_tokens, args)]
    if not args.skip_transformers:
        engines.append(TransformersRun(path, prompts, max_tokens, args.hf_batch_size))
    rounds = {engine.name: [] for engine in engines}
    for number in range(1, args.rounds + 1):
        for engine in engines:
            result = timed_round(engine, expected_tokens)
            rounds[engine.name].append(result)
            print(
                f"round {number} {engine.name:>12}: {result['output_tok_per_s']:8.1f} "
                f"output tok/s ({result['elapsed_s']:.1f} s)",
                flush=True,
            )

    results = []
    for engine in engines:
        rates = [r["output_tok_per_s"] for r in rounds[engine.name]]
        results.append(
            dict(
                engine=engine.name,
                output_tokens=expected_tokens,
                output_tok_per_s=max(rates),  # the best round
                median_output_tok_per_s=statistics.median(rates),
                rounds=rounds[engine.name],
                **engine.details(),
            )
        )
    report = dict(
        workload="A",
        num_requests=len(prompts),
        output_len=max_tokens,
        rounds=args.rounds,
        results=results,
    )
    for r in results:
        print(
            f"{r['engine']:>12}: best {r['output_tok_per_s']:8.1f}, "
            f"median {r['median_output_tok_per_s']:8.1f} output tok/s"
        )
    if len(results) == 2:
        jengine, hf = results
        report["ratio"] = jengine["output_tok_per_s"] / hf["output_tok_per_s"]
        report["ratio_of_medians"] = (
            jengine["median_output_tok_per_s"] / hf["median_output_tok_per_s"]
        )
        report["ratio_per_round"] = [
            j["output_tok_per_s"] / h["output_tok_per_s"]
            for j, h in zip(jengine["rounds"], hf["rounds"], strict=True)
        ]
        print(
            f"jengine / transformers = {report['ratio']:.2f}x (best rounds), "
            f"{report['ratio_of_medians']:.2f}x (medians), per round "
            + ", ".join(f"{x:.2f}x" for x in report["ratio_per_round"])
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
