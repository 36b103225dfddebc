"""Offline throughput, workload A (DESIGN.md §9): jengine vs Hugging Face transformers.

Both run the same 56M-parameter random Llama (float32) on the same 128 prompts in one
process run, greedy, exactly 128 output tokens each:
- jengine: `LLM.generate` on all prompts (continuous batching, chunked prefill);
- transformers: `generate` in static batches of 32, left-padded, greedy, KV cache on.
Prints both output-token rates and their ratio, and writes them to JSON.

    python -m bench.throughput [--num-requests 128] [--out bench/results/throughput.json]
"""

import argparse
import json
import os
import time

import torch

from bench.workloads import make_bench_model, workload_a


def run_jengine(path: str, prompts, max_tokens: int, args) -> dict:
    from jengine import LLM, SamplingParams

    started = time.perf_counter()
    limits = dict(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=args.kv_cache_gib << 30,
        **{name: value for name, value in limits.items() if value is not None},
    )
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # first-run costs
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == max_tokens * len(prompts)
    return dict(
        engine="jengine",
        startup_s=startup,
        elapsed_s=elapsed,
        output_tokens=tokens,
        output_tok_per_s=tokens / elapsed,
        compiles_after_warmup=llm.engine_core.compiles_after_warmup(),
    )


def run_transformers(path: str, prompts, max_tokens: int, batch_size: int) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0

    def generate(batch):
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, prompt in enumerate(batch):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
            )
        return (out.shape[1] - width) * len(batch)

    generate(prompts[:2])  # first-run costs
    started = time.perf_counter()
    tokens = sum(generate(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size))
    elapsed = time.perf_counter() - started
    return dict(
        engine="transformers",
        batch_size=batch_size,
        elapsed_s=elapsed,
        output_tokens=tokens,
        output_tok_per_s=tokens / elapsed,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir", default=os.path.expanduser("~/.cache/jengine/bench-llama-56m")
    )
    parser.add_argument("--num-requests", type=int, default=128)
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
    results = [run_jengine(path, prompts, max_tokens, args)]
    if not args.skip_transformers:
        results.append(run_transformers(path, prompts, max_tokens, args.hf_batch_size))
    report = dict(workload="A", num_requests=len(prompts), output_len=max_tokens, results=results)
    for r in results:
        print(
            f"{r['engine']:>12}: {r['output_tok_per_s']:8.1f} output tok/s ({r['elapsed_s']:.1f} s)"
        )
    if len(results) == 2:
        report["ratio"] = results[0]["output_tok_per_s"] / results[1]["output_tok_per_s"]
        print(f"jengine / transformers = {report['ratio']:.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
