"""Prefix caching: 64 requests that share a 1024-token system prompt, with jengine's
prefix cache on and off, in the same run.

Where it sits: two `LLM` engines over the benchmark model, identical but for
`enable_prefix_caching`; their passes alternate. With the cache on, the shared blocks are
computed once (the cache is reset before every pass, so the first request of a pass pays
for them) and later requests prefill only their own 32 tokens; with it off, every request
prefills all 1056. The speed-up is the off pass's time over the on pass's; the prefill
tokens saved bound it (printed beside it). Outputs of both must be identical.

    jengine bench prefix [--rounds 2]
"""

import argparse
import time

from .common import add_common_args, count, package_versions, print_header, write_result
from .workloads import make_bench_model, workload_prefix

MAX_MODEL_LEN = 1280


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="jengine bench prefix", description=__doc__.split("\n\n")[0]
    )
    add_common_args(parser, "prefix")
    parser.add_argument("--num-requests", type=count, default=64)
    parser.add_argument("--rounds", type=count, default=2)
    args = parser.parse_args(argv)

    from jengine import LLM, SamplingParams

    versions = package_versions()
    print_header("prefix", args, versions)
    path = make_bench_model(args.model_dir)
    prompts, max_tokens = workload_prefix(num_requests=args.num_requests)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    engines = {
        caching: LLM(
            path, dtype="float32", max_model_len=MAX_MODEL_LEN, enable_prefix_caching=caching
        )
        for caching in (True, False)
    }
    passes = {True: [], False: []}
    outputs = {}
    for _ in range(args.rounds):
        for caching, llm in engines.items():
            llm.reset_prefix_cache()
            started = time.perf_counter()
            result = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
            )
            passes[caching].append(time.perf_counter() - started)
            outputs[caching] = [list(o.outputs[0].token_ids) for o in result]
            cached = sum(o.num_cached_tokens for o in result)
            print(f"prefix caching {'on ' if caching else 'off'}: {passes[caching][-1]:.2f} s "
                  f"({cached} prompt tokens from the cache)")  # fmt: skip
    best_on, best_off = min(passes[True]), min(passes[False])
    prefill_off = sum(map(len, prompts))
    shared = len(prompts[0]) - 32
    prefill_on = prefill_off - (len(prompts) - 1) * (shared // 16 * 16)
    speedup = best_off / best_on
    token_bound = (prefill_off + max_tokens * len(prompts)) / (
        prefill_on + max_tokens * len(prompts)
    )
    print(f"speed-up {speedup:.1f}x (prefill + decode tokens saved allow {token_bound:.1f}x); "
          f"outputs identical: {outputs[True] == outputs[False]}")  # fmt: skip
    write_result(
        "prefix",
        args,
        versions,
        dict(
            num_requests=len(prompts),
            shared_prefix_len=shared,
            output_len=max_tokens,
            seconds_cache_on=passes[True],
            seconds_cache_off=passes[False],
            speedup=speedup,
            token_bound=token_bound,
            outputs_identical=outputs[True] == outputs[False],
        ),
    )


if __name__ == "__main__":
    main()
