"""Speculative decoding with n-gram drafts and with a draft model: single-stream speed-up,
throughput at batch 64 with speculation on vs off, and acceptance on real chat.

In one run, each group of engines on the same prompts, greedy, EOS masked, outputs
compared (they must be identical), passes alternating:
- single stream on the bundled model (a 4M-parameter Shakespeare model that repeats
  itself in long greedy continuations): 256 tokens per prompt, one request at a time,
  speculation off vs n-gram k = 3 and k = 5 vs its bundled 0.9M-parameter draft model
  (`shakespeare-draft`) k = 3 and k = 5;
- batch 64 on the benchmark model (workload A's first 64 prompts, 128 tokens each), off vs
  n-gram k = 3 with `disable_by_batch_size` 8 (so it stays off at this batch size); and
  batch 64 on the bundled model (its four story prompts 16 times), off vs the draft model
  k = 3 with `disable_by_batch_size` 8;
- SmolLM2-135M-Instruct chat answers (if installed), single stream, off vs n-gram k = 3.
Acceptance: accepted draft tokens / proposed draft tokens; mean accepted length: tokens a
verifying step yields (1 + accepted).

    jengine bench spec_decode [--rounds 2] [--out bench/results/spec_decode.json]
"""

import argparse
import os
import time

from .common import add_common_args, count, package_versions, print_header, write_result
from .workloads import make_bench_model, workload_a

STORY_PROMPTS = ["ROMEO:", "JULIET:", "First Citizen:", "KING RICHARD III:"]
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Explain what a CPU does in three sentences.",
    "List the planets of the solar system.",
    "How do I boil an egg?",
]


def ngram(k: int, **extra) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        **extra,
    }


def draft(k: int, **extra) -> dict:
    return {
        "method": "draft_model",
        "model": "shakespeare-draft",
        "num_speculative_tokens": k,
        **extra,
    }


def run_pass(llm, prompts, params, one_at_a_time: bool) -> tuple[float, list, dict]:
    """(output tok/s, token ids, spec counts) of one pass over `prompts`."""
    llm.reset_prefix_cache()
    before = dict(llm.engine_core.spec_decode_counts)
    started = time.perf_counter()
    if one_at_a_time:
        outputs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    counts = {k: v - before[k] for k, v in llm.engine_core.spec_decode_counts.items()}
    return sum(map(len, tokens)) / elapsed, tokens, counts


def compare(name: str, engines: dict, prompts, params, rounds: int, one_at_a_time: bool):
    """Passes alternating between the engines; best rate, acceptance, output match."""
    rates = {label: [] for label in engines}
    outputs, counts = {}, {}
    for _ in range(rounds):
        for label, llm in engines.items():
            rate, tokens, spec = run_pass(llm, prompts, params, one_at_a_time)
            rates[label].append(rate)
            outputs[label], counts[label] = tokens, spec
            print(f"{name} [{label}]: {rate:8.1f} output tok/s", flush=True)
    off = next(iter(engines))
    result = {}
    for label in engines:
        c = counts[label]
        result[label] = dict(
            output_tok_per_s=max(rates[label]),
            passes=rates[label],
            speedup=max(rates[label]) / max(rates[off]),
            acceptance_rate=c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else None,
            mean_accepted_length=1 + c["accepted_tokens"] / c["drafts"] if c["drafts"] else None,
            outputs_equal_to_off=outputs[label] == outputs[off],
            **c,
        )
        r = result[label]
        acceptance = (
            ""
            if r["acceptance_rate"] is None
            else (
                f", acceptance {100 * r['acceptance_rate']:.1f}%, "
                f"mean accepted length {r['mean_accepted_length']:.2f}"
            )
        )
        print(f"{name} [{label}]: {r['speedup']:.2f}x{acceptance}, "
              f"outputs equal: {r['outputs_equal_to_off']}")  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="jengine bench spec_decode", description=__doc__.split("\n\n")[0]
    )
    add_common_args(parser, "spec_decode")
    parser.add_argument("--rounds", type=count, default=2)
    args = parser.parse_args(argv)

    from jengine import LLM, SamplingParams
    from jengine.engine.arg_utils import ALLOW_LONG_MAX_MODEL_LEN
    from jengine.models.checkpoint import installed_smollm2
    from jengine.models.default import BUNDLED_MODEL_PATH

    # The bundled model was trained on 256 positions; its stories here run to 512 (a
    # speed measurement: what the tokens say matters only in that every engine agrees).
    os.environ[ALLOW_LONG_MAX_MODEL_LEN] = "1"

    versions = package_versions()
    print_header("spec_decode", args, versions)
    results = {}

    # Drafts take sampling rows, which max_num_seqs bounds: room for k = 5 beside the request.
    single = dict(dtype="float32", max_model_len=512, max_num_seqs=8)
    story = SamplingParams(temperature=0, max_tokens=256, min_tokens=256)
    engines = {
        "off": LLM(BUNDLED_MODEL_PATH, **single),
        "ngram k=3": LLM(BUNDLED_MODEL_PATH, speculative_config=ngram(3), **single),
        "ngram k=5": LLM(BUNDLED_MODEL_PATH, speculative_config=ngram(5), **single),
        "draft model k=3": LLM(BUNDLED_MODEL_PATH, speculative_config=draft(3), **single),
        "draft model k=5": LLM(BUNDLED_MODEL_PATH, speculative_config=draft(5), **single),
    }
    results["single stream, bundled model"] = compare(
        "single stream", engines, STORY_PROMPTS, story, args.rounds, one_at_a_time=True
    )
    del engines

    batch = dict(dtype="float32", max_model_len=512)
    engines = {
        "off": LLM(BUNDLED_MODEL_PATH, **batch),
        "draft model k=3, disable_by_batch_size=8": LLM(
            BUNDLED_MODEL_PATH, speculative_config=draft(3, disable_by_batch_size=8), **batch
        ),
    }
    stories = SamplingParams(temperature=0, max_tokens=128, min_tokens=128)
    results["batch 64, bundled model"] = compare(
        "batch 64 (bundled)", engines, STORY_PROMPTS * 16, stories, args.rounds, False
    )
    del engines

    path = make_bench_model(args.model_dir)
    prompts, max_tokens = workload_a(num_requests=64)
    engines = {
        "off": LLM(path, **batch),
        "ngram k=3, disable_by_batch_size=8": LLM(
            path, speculative_config=ngram(3, disable_by_batch_size=8), **batch
        ),
    }
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    results["batch 64, benchmark model"] = compare(
        "batch 64", engines, token_prompts, params, args.rounds, one_at_a_time=False
    )
    del engines

    if installed_smollm2() is not None:
        chat_engines = {
            "off": LLM("smollm2", max_model_len=512, max_num_seqs=4),
            "ngram k=3": LLM(
                "smollm2", speculative_config=ngram(3), max_model_len=512, max_num_seqs=4
            ),
        }
        render = chat_engines["off"].llm_engine.input_processor.render_chat
        chats = [
            {"prompt_token_ids": render([{"role": "user", "content": q}])[1]}
            for q in CHAT_QUESTIONS
        ]
        answers = SamplingParams(temperature=0, max_tokens=160)
        results["SmolLM2 chat answers"] = compare(
            "SmolLM2 chat", chat_engines, chats, answers, args.rounds, one_at_a_time=True
        )
    write_result("spec_decode", args, versions, dict(results=results))


if __name__ == "__main__":
    main()
