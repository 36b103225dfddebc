"""The GPU check: what a machine with a CUDA GPU proves that the CPU machines cannot.

The development and CI machines have no accelerator, so there the GPU path is proven by
the Pallas interpreter and by lowering alone. On a GPU machine this runs, section by
section, each timed and its failure recorded rather than raised, the results written to
`OUT/gpu_check.json` after every section (a run cut short keeps what it finished):

- env: jax's devices, versions and memory;
- kernel: the Pallas GPU kernel compiled by Triton and run for real over the kernel
  tests' grid (tests/kernels/test_pallas_interpret.py), float32 and bfloat16, against the
  float64 oracle (tests/kernels/conftest.naive_attention), the XLA reference beside it;
- engine: a random Llama through `LLM` on the GPU with chunked prefill, a prefix hit and
  preemption, against transformers (torch on the CPU, float32): greedy tokens, logprobs,
  compiles after warmup, in jax's default matmul precision and in "highest", and with
  the XLA reference attention;
- speed: a ~1.1B-parameter bfloat16 random Llama: single-stream decode (workload C)
  against the HBM roofline, prefill MFU of one 2048-token step, workload A throughput;
  with the Pallas kernel and with the XLA reference attention, in one run;
- quant: that model's weights as bf16, int8 and fp8 (weight-only) through XLA's
  dequantizing matmuls on the GPU: resident bytes, single-stream decode, TTFT, greedy
  agreement with bf16;
- overhead: that model's decode step in the engine (async and sync) beside its programs
  run alone, at 1 and 16 running requests.

It needs the repository on PYTHONPATH (the tests' fixtures) and jengine installed, run
from outside the repository so the installed package is the one imported:

    cd /tmp && PYTHONPATH=$SITE:$REPO python3 -m jengine.bench.gpu_check --out DIR
"""

import argparse
import gc
import json
import os
import tempfile
import time
import traceback

import numpy as np

from .common import package_versions, token_match
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


def _error(exc: BaseException) -> str:
    """The exception and the last frames that raised it, short enough for a report."""
    lines = traceback.format_exception(exc)
    return "".join(lines[-6:])[-3000:]


def _precision(name: str) -> str | None:
    """jax's matmul precision setting for a row: "default" leaves it unset."""
    return None if name == "default" else name


# -- env ------------------------------------------------------------------------------------


def section_env(args) -> dict:
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return dict(
        backend=jax.default_backend(),
        devices=[str(d) for d in jax.devices()],
        device_kind=device.device_kind,
        versions=package_versions("flax", "transformers", "torch", "jax-cuda13-plugin"),
        memory_bytes_limit=stats.get("bytes_limit"),
    )


# -- kernel ---------------------------------------------------------------------------------


def section_kernel(args) -> dict:
    import jax
    import jax.numpy as jnp

    from jengine.pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
    from jengine.pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
    from tests.kernels.conftest import naive_attention
    from tests.kernels.test_pallas_interpret import CASES, case_batch

    rows = []
    for dtype in (np.float32, jnp.bfloat16):
        for case in CASES:
            batch, kwargs = case_batch(*case, dtype=dtype)
            window = kwargs["sliding_window"]
            oracle = naive_attention(batch, kwargs["sm_scale"], window)
            num_real = int(batch.query_start_loc[-1])
            row = dict(case="-".join(map(str, case)), dtype=np.dtype(dtype).name)
            try:
                started = time.perf_counter()
                out = np.asarray(ragged_paged_attention_gpu(*batch.args, **kwargs), np.float64)
                row["first_call_s"] = round(time.perf_counter() - started, 2)
                row["kernel_max_err"] = float(np.abs(out[:num_real] - oracle[:num_real]).max())
                row["finite"] = bool(np.isfinite(out).all())
                row["padding_zero"] = not out[num_real:].any()
            except Exception as exc:  # an API break between jax versions lands here
                row["kernel_error"] = _error(exc)
            for precision in ("default", "highest"):
                jax.config.update("jax_default_matmul_precision", _precision(precision))
                try:
                    ref = ragged_paged_attention_reference(*batch.args, **kwargs)
                finally:
                    jax.config.update("jax_default_matmul_precision", None)
                ref = np.asarray(ref, np.float64)
                row[f"reference_{precision}_max_err"] = float(
                    np.abs(ref[:num_real] - oracle[:num_real]).max()
                )
            tolerance = 1e-5 if dtype == np.float32 else 2e-2
            row["ok"] = (
                row.get("kernel_max_err", np.inf) <= tolerance
                and row.get("finite", False)
                and row.get("padding_zero", False)
            )
            print(json.dumps(row))
            rows.append(row)
    return dict(rows=rows, passed=sum(r["ok"] for r in rows), total=len(rows))


# -- engine ---------------------------------------------------------------------------------


def section_engine(args) -> dict:
    import jax

    from jengine import LLM, SamplingParams
    from tests.engine.engine_helpers import hf_teacher_forced, random_prompts
    from tests.models.checkpoints import make_checkpoint
    from tests.models.test_families_in_the_engine import MAX_TOKENS, TIGHT

    path = os.path.join(args.workdir, "llama-f32")
    hf_model = make_checkpoint("llama3", path)
    head = random_prompts(1, seed=7, low=20, high=21)[0]
    prompts = [head + tail for tail in random_prompts(6, seed=8, low=3, high=40)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    results = {}
    # The kernel in jax's default precision and in "highest"; the XLA reference beside it,
    # so a kernel failure still leaves the rest of the step checked on the GPU.
    for precision, impl in (("default", None), ("highest", None), ("highest", "reference")):
        row = f"{precision}-{impl or 'kernel'}"
        jax.config.update("jax_default_matmul_precision", _precision(precision))
        try:
            llm = LLM(path, **TIGHT, attention_impl=impl)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            same_tokens, worst = 0, 0.0
            for prompt, output in zip(prompts, outputs, strict=True):
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                logprobs = [entry[t].logprob for entry, t in zip(completion.logprobs, tokens)]
                hf_tokens, hf_logprobs = hf_teacher_forced(hf_model, prompt, tokens)
                same_tokens += tokens == hf_tokens
                worst = max(worst, float(np.abs(np.subtract(logprobs, hf_logprobs)).max()))
            results[row] = dict(
                attention_impl=llm.engine_core.runner.attention_impl,
                identical_sequences=same_tokens,
                sequences=len(prompts),
                max_logprob_diff=worst,
                preemptions=llm.engine_core.num_preemptions,
                prefix_hit=any(o.num_cached_tokens > 0 for o in outputs),
                compiles_after_warmup=llm.engine_core.runner.compiles_after_warmup,
            )
            del llm
        except Exception as exc:
            results[row] = dict(error=_error(exc))
        finally:
            jax.config.update("jax_default_matmul_precision", None)
            gc.collect()
        print(row, json.dumps(results[row]))
    return results


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
            results[impl] = dict(error=_error(exc))
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
            row = dict(error=_error(exc))
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
    at 1 and 16 running requests, with async scheduling and without, beside the time of
    the same step's programs run alone and waited for (`jengine bench overhead`'s device
    part). The step minus that time is the host's share; that time minus the weights' read
    time (the roofline) is the device programs' own overhead (launches, small kernels)."""
    from .overhead import device_step_times

    path = _build_speed_model(os.path.join(args.workdir, "llama-1b"))
    rows = device_step_times(path, [1, 16], steps=64, dtype="bfloat16")
    for row in rows:
        print("overhead", json.dumps(row), flush=True)
    return dict(model=SPEED_MODEL, rows=rows)


SECTIONS = dict(
    env=section_env,
    kernel=section_kernel,
    engine=section_engine,
    speed=section_speed,
    quant=section_quant,
    overhead=section_overhead,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jengine.bench.gpu_check")
    parser.add_argument("--out", default=".", help="folder for gpu_check.json")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantizations", default="none,int8,fp8", help="the quant section's")
    parser.add_argument("--workdir", default=None, help="checkpoints (default: a temp folder)")
    args = parser.parse_args(argv)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="gpu-check-")
    report = {}
    for name in args.sections.split(","):
        started = time.perf_counter()
        print(f"== {name} ==", flush=True)
        try:
            report[name] = SECTIONS[name](args)
        except Exception as exc:
            report[name] = dict(error=_error(exc))
            print(report[name]["error"])
        report[name + "_seconds"] = round(time.perf_counter() - started, 1)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
    summary = {k: v for k, v in report.items() if k.endswith("_seconds")}
    print("== done ==", json.dumps(summary))


if __name__ == "__main__":
    main()
