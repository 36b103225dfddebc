"""The GPU check's speed sections: a ~1.1B-parameter bfloat16 random Llama on the GPU.

Where it sits: `gpu_check.py` runs these beside its correctness sections (env, kernel,
engine), each timed and its failure recorded; the model is built there once with
transformers under `--workdir`. `speed`: single-stream decode against the HBM roofline,
prefill MFU of one 2048-token step, workload A, with the Pallas kernel and the XLA
reference attention; `quant`: the weights as bf16, int8 and fp8; `overhead`: where a decode
step's time goes (the engine's step beside its programs run alone).
"""

import gc
import json
import os
import time

import numpy as np

from .common import error_text, token_match
from .latency import single_stream
from .roofline import weight_bytes, workload_flops
from .tokenizer import write_bench_tokenizer
from .workloads import BENCH_MODEL, workload_a, workload_c

# About Llama-3.2-1B's shape with the benchmark model's vocabulary and tokenizer: 1.10B
# parameters.
SPEED_MODEL = dict(
    BENCH_MODEL,
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    max_position_embeddings=4096,
)
PREFILL_TOKENS = 2048
KV_CACHE_BYTES = 16 << 30

# -- speed ----------------------------------------------------------------------------------


def _device_ceilings() -> dict:
    """The two measured ceilings: a bf16 8192^3 matrix product on random data and a
    device-to-device copy of 4 GiB (bytes read plus written), best of 10 each."""
    import jax
    import jax.numpy as jnp

    def best_of(fn, *operands, repeats=10):
        jax.block_until_ready(fn(*operands))
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            jax.block_until_ready(fn(*operands))
            best = min(best, time.perf_counter() - started)
        return best

    key_a, key_b = jax.random.split(jax.random.key(0))
    size = 8192
    a = jax.random.normal(key_a, (size, size), jnp.bfloat16)
    b = jax.random.normal(key_b, (size, size), jnp.bfloat16)
    matmul_s = best_of(jax.jit(jnp.matmul), a, b)
    data = jax.random.normal(key_a, (1 << 30,), jnp.float32)
    copy_s = best_of(jax.jit(lambda x: x * 1.0000001), data)
    del a, b, data
    return dict(
        bf16_matmul_tflops=2 * size**3 / matmul_s / 1e12,
        copy_gb_per_s=2 * (4 << 30) / copy_s / 1e9,
    )


def _build_speed_model(path: str) -> str:
    import torch
    import transformers

    if not os.path.isfile(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        try:
            config = transformers.LlamaConfig(**SPEED_MODEL)
            transformers.LlamaForCausalLM(config).save_pretrained(path)
        finally:
            torch.set_default_dtype(torch.float32)
        write_bench_tokenizer(path)
    return path


def _speed_of(path: str, impl: str, ceilings: dict, repeats: int) -> dict:
    from jengine import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        path,
        dtype="bfloat16",
        max_model_len=PREFILL_TOKENS + 256,
        max_num_seqs=128,
        max_num_batched_tokens=PREFILL_TOKENS,
        attention_impl=impl,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )
    result = dict(start_s=round(time.perf_counter() - started, 1))
    result["attention_impl"] = llm.engine_core.runner.attention_impl

    # Single stream (workload C) against the roofline: every weight read once a step.
    prompts, max_tokens = workload_c()
    latency = single_stream(llm, prompts[0], max_tokens, repeats)
    roofline = ceilings["copy_gb_per_s"] / 2 * 1e9 / weight_bytes(SPEED_MODEL, itemsize=2)
    result.update(
        ttft_ms=latency["ttft_s"] * 1e3,
        decode_tok_per_s=latency["decode_tok_per_s"],
        decode_roofline_tok_per_s=roofline,
        decode_of_roofline=latency["decode_tok_per_s"] / roofline,
    )

    # One 2048-token prefill step: its model FLOPs over its time, against the matmul rate.
    prompt = np.random.default_rng(1).integers(100, 31000, size=PREFILL_TOKENS).tolist()
    one_token = SamplingParams(temperature=0, max_tokens=1)
    prefill_s = float("inf")
    for _ in range(repeats + 1):
        llm.reset_prefix_cache()
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], one_token, use_tqdm=False)
        prefill_s = min(prefill_s, time.perf_counter() - started)
    flops = workload_flops([PREFILL_TOKENS], 0, SPEED_MODEL)
    result.update(
        prefill_2048_ms=prefill_s * 1e3,
        prefill_tflops=flops / prefill_s / 1e12,
        prefill_mfu_of_measured=flops / prefill_s / 1e12 / ceilings["bf16_matmul_tflops"],
        prefill_mfu_of_989=flops / prefill_s / 1e12 / 989,
    )

    # Workload A: 128 requests at once, best of two passes.
    prompts, max_tokens = workload_a()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    best = float("inf")
    for _ in range(2):
        llm.reset_prefix_cache()
        started = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        best = min(best, time.perf_counter() - started)
    result["workload_a_tok_per_s"] = len(prompts) * max_tokens / best
    result["compiles_after_warmup"] = llm.engine_core.runner.compiles_after_warmup
    result["workload_a_tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
    del llm
    gc.collect()
    return result


def section_speed(args) -> dict:
    ceilings = _device_ceilings()
    print("ceilings", json.dumps(ceilings))
    path = _build_speed_model(os.path.join(args.workdir, "llama-1b"))
    results = dict(ceilings=ceilings, model=SPEED_MODEL)
    for impl in ("gpu", "reference"):
        try:
            results[impl] = _speed_of(path, impl, ceilings, args.repeats)
        except Exception as exc:
            results[impl] = dict(error=error_text(exc))
        gc.collect()  # a failed engine's cache, held by its traceback's frames
        printable = {k: v for k, v in results[impl].items() if k != "workload_a_tokens"}
        print(impl, json.dumps(printable))
    tokens = [results[impl].pop("workload_a_tokens", None) for impl in ("gpu", "reference")]
    if None not in tokens:
        results["workload_a_kernel_vs_reference"] = token_match(*tokens)
    return results


# -- quant ----------------------------------------------------------------------------------


def section_quant(args) -> dict:
    """The 1.1B model's weights as bf16, int8 and fp8 (weight-only, per output channel),
    their matmuls through XLA's dequantization on the GPU: resident bytes, single-stream
    decode and TTFT, and greedy agreement with bf16, in one run. A small batch shape keeps
    each engine's warmup short; the attention is the Pallas kernel in all three."""
    from flax import nnx

    from jengine import LLM, SamplingParams
    from jengine.runner.kv_cache_sizing import weight_bytes as resident_bytes

    path = _build_speed_model(os.path.join(args.workdir, "llama-1b"))
    prompts, max_tokens = workload_c()
    results = dict(model=SPEED_MODEL)
    tokens = {}
    for method in args.quantizations.split(","):
        try:
            started = time.perf_counter()
            llm = LLM(
                path,
                dtype="bfloat16",
                quantization=method,
                max_model_len=1024,
                max_num_seqs=4,
                max_num_batched_tokens=256,
                kv_cache_memory_bytes=1 << 30,
            )
            runner = llm.engine_core.runner
            row = dict(start_s=round(time.perf_counter() - started, 1))
            params = nnx.to_pure_dict(runner.params)
            row["weight_bytes"] = resident_bytes(params, runner.dtype)[0]
            latency = single_stream(llm, prompts[0], max_tokens, args.repeats)
            row.update(
                ttft_ms=latency["ttft_s"] * 1e3,
                decode_tok_per_s=latency["decode_tok_per_s"],
                compiles_after_warmup=runner.compiles_after_warmup,
            )
            greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            requests = [{"prompt_token_ids": p} for p in prompts[:1]]
            outputs = llm.generate(requests, greedy, use_tqdm=False)
            tokens[method] = [list(o.outputs[0].token_ids) for o in outputs]
            del llm
        except Exception as exc:
            row = dict(error=error_text(exc))
        gc.collect()
        results[method] = row
        print(method, json.dumps(row), flush=True)
    for method in ("int8", "fp8"):
        if "none" in tokens and method in tokens:
            results[method]["greedy_vs_bf16"] = token_match(tokens["none"], tokens[method])
    return results


# -- overhead -------------------------------------------------------------------------------


def section_overhead(args) -> dict:
    """Where a decode step of the 1.1B bf16 model goes on the GPU: the engine's median step
    at each `--num-running` count of requests, with async scheduling and without (and its
    dispatch and collect parts), beside the time of the same step's programs run alone and
    waited for (`jengine bench overhead`'s device part). The step minus that time is the
    host's share; that time minus the weights' read time (the roofline) is the device
    programs' own overhead (launches, small kernels)."""
    from .overhead import device_step_times

    path = _build_speed_model(os.path.join(args.workdir, "llama-1b"))
    num_running = [int(n) for n in args.num_running.split(",")]
    rows = device_step_times(path, num_running, steps=64, rounds=1, dtype="bfloat16")
    for row in rows:
        print("overhead", json.dumps(row), flush=True)
    return dict(model=SPEED_MODEL, rows=rows)
