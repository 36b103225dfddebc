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
- speed, quant, overhead (gpu_speed.py): a ~1.1B-parameter bfloat16 random Llama:
  single-stream decode (workload C) against the HBM roofline, prefill MFU of one
  2048-token step, workload A throughput;
  with the Pallas kernel and with the XLA reference attention, in one run;
- quant: that model's weights as bf16, int8 and fp8 (weight-only) through XLA's
  dequantizing matmuls on the GPU: resident bytes, single-stream decode, TTFT, greedy
  agreement with bf16;
- overhead: that model's decode step in the engine (async and sync) beside its programs
  run alone, at 1, 64 and 256 running requests (`--num-running`).

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

import numpy as np

from .common import count, error_text, package_versions
from .gpu_speed import section_overhead, section_quant, section_speed


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
                row["kernel_error"] = error_text(exc)
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
            results[row] = dict(error=error_text(exc))
        finally:
            jax.config.update("jax_default_matmul_precision", None)
            gc.collect()
        print(row, json.dumps(results[row]))
    return results


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
    parser.add_argument("--repeats", type=count, default=3)
    parser.add_argument("--quantizations", default="none,int8,fp8", help="the quant section's")
    parser.add_argument(
        "--num-running", default="1,64,256", help="the overhead section's running requests"
    )
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
            report[name] = dict(error=error_text(exc))
            print(report[name]["error"])
        report[name + "_seconds"] = round(time.perf_counter() - started, 1)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
    summary = {k: v for k, v in report.items() if k.endswith("_seconds")}
    print("== done ==", json.dumps(summary))


if __name__ == "__main__":
    main()
