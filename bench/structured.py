"""What structured outputs cost: workload A with none of the requests constrained vs half
of them under a JSON schema, in one run; and how long a grammar takes to compile.

Both passes run the same 128 prompts for exactly 128 tokens each (EOS masked); in the
second, every other request carries a JSON schema (an array of at least 64 integers, so
its grammar is never complete before the 128th token): its tokens are masked on device
each step by the bitmask its matcher computes on the host. Passes alternate, 2 rounds;
the prefix cache is reset before each. Compile times: the first constrained request's
tokenizer conversion (once per engine), then each schema's matcher (cached by spec).

    jengine bench structured [--rounds 2] [--out bench/results/structured.json]
"""

import argparse
import json
import statistics
import time

from .common import add_common_args, count, package_versions, print_header, write_result
from .throughput import MAX_MODEL_LEN
from .workloads import make_bench_model, workload_a

SCHEMA = {
    "type": "object",
    "properties": {
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 64,
        }
    },
    "required": ["values"],
}
# Schemas whose compile time is reported (the benchmark's own, an agent's tool call, a
# nested record).
COMPILE_SCHEMAS = {
    "benchmark array": SCHEMA,
    "tool call": {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"enum": ["get_weather"]},
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                            "required": ["city"],
                        },
                    },
                    "required": ["name", "parameters"],
                }
            ]
        },
    },
    "nested record": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"],
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
            "contact": {"anyOf": [{"$ref": "#/$defs/phone"}, {"type": "null"}]},
        },
        "required": ["name", "age"],
        "$defs": {"phone": {"type": "string", "pattern": "^\\+[0-9]{6,12}$"}},
    },
}


def compile_times(llm) -> dict:
    """Seconds: the llguidance tokenizer (once), then each schema's grammar."""
    from llguidance import LLMatcher

    from jengine.core.structured_output import grammar_for
    from jengine.engine.tokenizer import grammar_tokenizer
    from jengine.sampling_params import StructuredOutputsParams

    runner = llm.engine_core.runner
    started = time.perf_counter()
    tokenizer = grammar_tokenizer(llm.engine_core.config, runner.config.vocab_size)
    times = {"tokenizer (once per engine)": time.perf_counter() - started}
    for name, schema in COMPILE_SCHEMAS.items():
        started = time.perf_counter()
        matcher = LLMatcher(tokenizer, grammar_for(StructuredOutputsParams(json=schema)))
        times[name] = time.perf_counter() - started
        assert not matcher.is_error(), matcher.get_error()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="jengine bench structured", description=__doc__.split("\n\n")[0]
    )
    add_common_args(parser, "structured")
    parser.add_argument("--num-requests", type=count, default=128)
    parser.add_argument("--rounds", type=count, default=2)
    parser.add_argument("--kv-cache-gib", type=count, default=1)
    args = parser.parse_args(argv)

    from jengine import LLM, SamplingParams, StructuredOutputsParams

    versions = package_versions("llguidance")
    print_header("structured", args, versions)
    path = make_bench_model(args.model_dir)
    prompts, max_tokens = workload_a(num_requests=args.num_requests)
    llm = LLM(
        path, dtype="float32", max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=args.kv_cache_gib << 30,
    )  # fmt: skip
    free = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    constrained = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        min_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    workloads = {
        "none constrained": [free] * len(prompts),
        "half constrained": [constrained if i % 2 else free for i in range(len(prompts))],
    }
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(token_prompts[:2], [constrained] * 2, use_tqdm=False)  # grammar + tokenizer

    passes = {name: [] for name in workloads}
    constrained_valid_prefix = None
    for _ in range(args.rounds):
        for name, params in workloads.items():
            llm.reset_prefix_cache()
            started = time.perf_counter()
            outputs = llm.generate(token_prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - started
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            if tokens != max_tokens * len(prompts):
                raise RuntimeError(f"{name}: {tokens} tokens, expected {max_tokens * len(prompts)}")
            passes[name].append(tokens / elapsed)
            print(f"{name:>17}: {tokens / elapsed:8.1f} output tok/s ({elapsed:.1f} s)", flush=True)
            if name == "half constrained":
                text = outputs[1].outputs[0].text
                constrained_valid_prefix = text.startswith('{"values": [')
    best = {name: max(rates) for name, rates in passes.items()}
    overhead = 1 - best["half constrained"] / best["none constrained"]
    times = compile_times(llm)
    print(f"overhead of constraining half the requests: {overhead * 100:.1f}%")
    for name, seconds in times.items():
        print(f"compile {name}: {seconds * 1e3:.1f} ms")
    write_result(
        "structured",
        args,
        versions,
        dict(
            workload="A",
            num_requests=len(prompts),
            output_len=max_tokens,
            schema=json.dumps(SCHEMA),
            output_tok_per_s=best,
            median_output_tok_per_s={n: statistics.median(r) for n, r in passes.items()},
            passes=passes,
            overhead=overhead,
            compile_seconds=times,
            constrained_output_starts_as_the_schema_says=constrained_valid_prefix,
            compiles_after_warmup=llm.engine_core.compiles_after_warmup(),
        ),
    )


if __name__ == "__main__":
    main()
