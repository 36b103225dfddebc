"""Embeddings: a batch of 64 prompts embedded by jengine's pooling runner and by
transformers' forward pass, in the same run.

Where it sits: `LLM(runner="pooling")` over the benchmark model (float32, last-token
pooling, normalised: the defaults of a checkpoint without a sentence-transformers config)
against `AutoModel` with the same weights, the same threads and the same inputs: workload
A's first 64 prompts (64-256 tokens). transformers runs them as one right-padded batch
with an attention mask (what "batch 64" means to a sentence-transformers user) and pools
the last real token's hidden state by hand; jengine's prefix cache is reset before every
pass (transformers recomputes everything). The rate is embeddings per second over whole
passes, best of `--rounds`; the two engines' embeddings are compared (largest difference
of any value).

    jengine bench embed [--rounds 3] [--batch 64]
"""

import argparse
import os
import time

import numpy as np

from .common import add_common_args, count, package_versions, print_header, write_result
from .workloads import make_bench_model, workload_a


def transformers_embeddings(model, prompts: list[list[int]]) -> np.ndarray:
    """[N, D] last-token hidden states of one right-padded batch, normalised."""
    import torch

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
        mask[row, : len(prompt)] = 1
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    last = hidden[torch.arange(len(prompts)), torch.tensor([len(p) - 1 for p in prompts])]
    return torch.nn.functional.normalize(last, dim=-1).numpy()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="jengine bench embed", description=__doc__.split("\n\n")[0]
    )
    add_common_args(parser, "embed")
    parser.add_argument("--batch", type=count, default=64)
    parser.add_argument("--rounds", type=count, default=3)
    parser.add_argument("--threads", type=count, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args(argv)

    from jengine import LLM

    versions = package_versions("transformers", "torch")
    print_header("embed", args, versions)
    path = make_bench_model(args.model_dir)
    prompts = workload_a(num_requests=args.batch)[0]
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm = LLM(path, runner="pooling", dtype="float32", max_num_seqs=args.batch)
    peer = None
    if not args.skip_transformers:
        import torch
        import transformers

        torch.set_num_threads(args.threads)
        peer = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    seconds = {"jengine": [], "transformers": []}
    ours = theirs = None
    for _ in range(args.rounds + 1):  # the first round pays first-use costs, not counted
        llm.reset_prefix_cache()
        started = time.perf_counter()
        outputs = llm.embed(requests, use_tqdm=False)
        seconds["jengine"].append(time.perf_counter() - started)
        ours = np.array([o.outputs.embedding for o in outputs])
        if peer is not None:
            started = time.perf_counter()
            theirs = transformers_embeddings(peer, prompts)
            seconds["transformers"].append(time.perf_counter() - started)
    rates = {name: len(prompts) / min(times[1:]) for name, times in seconds.items() if times[1:]}
    for name, rate in rates.items():
        print(f"{name}: {rate:.1f} embeddings/s (passes: "
              f"{', '.join(f'{t:.2f}' for t in seconds[name][1:])} s)")  # fmt: skip
    payload = dict(
        batch=len(prompts),
        prompt_tokens=sum(map(len, prompts)),
        threads=args.threads,
        seconds=seconds,
        embeddings_per_s=rates,
        compiles_after_warmup=llm.engine_core.runner.compiles_after_warmup,
    )
    if theirs is not None:
        payload["ratio"] = rates["jengine"] / rates["transformers"]
        payload["max_abs_difference"] = float(np.abs(ours - theirs).max())
        print(f"jengine / transformers: {payload['ratio']:.2f}x; embeddings differ by at most "
              f"{payload['max_abs_difference']:.1e}")  # fmt: skip
    write_result("embed", args, versions, payload)


if __name__ == "__main__":
    main()
