"""Tensor and data parallelism on workload A: TP=1, TP=2 and DP=2 in one run, and what the
TP step sends between devices.

This machine has no accelerators: its 2 "devices" are forced host devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=2`) that share the same 2 cores, and
the two DP replicas are processes on those cores too. The figures show what splitting
costs here, not a speed-up. What a GPU host would gain is estimated on paper from the
collectives XLA put in the compiled TP=2 step (read back with `step_collectives`): bytes
all-reduced and gathered per token, turned into time with an interconnect's bandwidth and
per-collective latency and set against the time to read each device's share of the
weights. Engines run the same prompts (prefix cache reset before every pass), their
passes alternating; greedy outputs are compared between every pair.

    jengine bench parallel [--rounds 2] [--out bench/results/parallel.json]
"""

import argparse
import os
import sys

from .common import (
    add_common_args,
    add_scheduler_steps_arg,
    compare_outputs,
    count,
    model_config,
    package_versions,
    print_header,
    write_result,
)
from .throughput import JengineOffline, engine_results, run_passes
from .workloads import make_bench_model, workload_a

NUM_DEVICES = 2
DECODE_BATCH = 64  # the decode step whose collectives are read back

# A GPU host for the estimate (H100 SXM): HBM and NVLink bandwidth in bytes/s, and a
# small-message collective's latency (NCCL within one node).
GPU = dict(name="H100 SXM, NVLink", hbm_bytes_per_s=3.35e12, link_bytes_per_s=450e9,
           collective_latency_s=10e-6)  # fmt: skip


def force_host_devices() -> None:
    if "jax" in sys.modules:
        raise RuntimeError("jax was imported before the device count could be set")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={NUM_DEVICES}"


def tp_step_collectives(llm) -> dict:
    """The compiled TP decode step at DECODE_BATCH requests: each collective, and the bytes
    one step moves (all-reduces and gathers of results this size, per device)."""

    from jengine.runner.prepared_step import PreparedStep
    from jengine.runner.sharding import step_collectives

    runner = llm.engine_core.runner
    shape = runner.buckets.shape_for(DECODE_BATCH, DECODE_BATCH, 1)
    prepared = PreparedStep.padding(shape)
    collectives = [
        c
        for lowered in runner.lower_step(prepared)
        for c in step_collectives(lowered.compile().as_text())
    ]
    per_step = {}
    for c in collectives:
        per_step[c["kind"]] = per_step.get(c["kind"], 0) + c["bytes"] * c["times_per_step"]
    return dict(
        decode_batch=shape.num_reqs,
        collectives=collectives,
        num_collectives_per_step=sum(c["times_per_step"] for c in collectives),
        bytes_per_step=per_step,
        bytes_per_token={kind: b / shape.num_reqs for kind, b in per_step.items()},
    )


def gpu_estimate(config: dict, tp_step: dict, tp: int, bytes_per_param: int) -> dict:
    """Decode step time at the traced batch, TP=1 vs TP=`tp`, on GPU: weights read from HBM
    (split `tp` ways) plus the collectives (ring all-reduce moves 2 (N-1)/N of the bytes
    over each link, all-gather (N-1)/N), each with a fixed latency."""
    params = model_params(config)
    read_one = params * bytes_per_param / GPU["hbm_bytes_per_s"]
    share = (tp - 1) / tp
    moved = sum(
        (2 * share if kind == "all-reduce" else share) * b
        for kind, b in tp_step["bytes_per_step"].items()
    )
    comm = (
        moved / GPU["link_bytes_per_s"]
        + tp_step["num_collectives_per_step"] * GPU["collective_latency_s"]
    )
    split = read_one / tp + comm
    return dict(
        gpu=GPU["name"],
        parameters=params,
        tp1_step_s=read_one,
        tp_step_s=split,
        collectives_s=comm,
        estimated_speedup=read_one / split,
    )


def model_params(config: dict) -> int:
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config["intermediate_size"]
    heads = 1 if config.get("tie_word_embeddings") else 2
    return layers * per_layer + heads * hidden * config["vocab_size"]


# The same formula for a 7B model: per layer 2 all-reduces of [T, D], 1 for the embedding,
# the [R, V] logits gathered; bf16 activations, f32 logits.
LLAMA_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, intermediate_size=11008, vocab_size=32000)  # fmt: skip


def paper_step(config: dict, batch: int, activation_bytes: int) -> dict:
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    return dict(
        num_collectives_per_step=2 * layers + 2,
        bytes_per_step={
            "all-reduce": (2 * layers + 1) * batch * hidden * activation_bytes,
            "all-gather": batch * config["vocab_size"] * 4,
        },
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="jengine bench parallel", description=__doc__.split("\n\n")[0]
    )
    add_common_args(parser, "parallel")
    add_scheduler_steps_arg(parser)
    parser.add_argument("--num-requests", type=count, default=128)
    parser.add_argument("--rounds", type=count, default=2, help="passes of each engine")
    parser.add_argument("--max-num-seqs", type=count, default=None)
    parser.add_argument("--max-num-batched-tokens", type=count, default=None)
    parser.add_argument("--kv-cache-gib", type=count, default=1)
    args = parser.parse_args(argv)
    force_host_devices()

    versions = package_versions("jax")
    print_header("parallel", args, versions)
    path = make_bench_model(args.model_dir)
    prompts, max_tokens = workload_a(num_requests=args.num_requests)
    engines = [
        JengineOffline(path, args, name="jengine TP=1"),
        JengineOffline(path, args, name="jengine TP=2", tensor_parallel_size=2),
        JengineOffline(path, args, name="jengine DP=2", data_parallel_size=2),
    ]
    try:
        tp_step = tp_step_collectives(engines[1].llm)
        passes, outputs = run_passes(engines, prompts, max_tokens)
        results = engine_results(engines, passes)  # engines still up
    finally:
        for engine in engines:
            engine.close()
    rates = {r["engine"]: r["output_tok_per_s"] for r in results}
    ratios = {
        name: rates[name] / rates["jengine TP=1"] for name in ("jengine TP=2", "jengine DP=2")
    }
    config = model_config(path)
    # The paper formula, checked against what XLA compiled for the bench model.
    formula = paper_step(config, tp_step["decode_batch"], activation_bytes=4)
    formula_matches = formula["bytes_per_step"] == tp_step["bytes_per_step"] and (
        formula["num_collectives_per_step"] == tp_step["num_collectives_per_step"]
    )
    estimate = dict(
        bench_model=gpu_estimate(config, tp_step, NUM_DEVICES, bytes_per_param=4),
        llama_7b_bf16=gpu_estimate(
            LLAMA_7B, paper_step(LLAMA_7B, tp_step["decode_batch"], 2), NUM_DEVICES, 2
        ),
    )
    print(f"paper formula = compiled step's collectives: {formula_matches}")
    print(f"TP=2 step at batch {tp_step['decode_batch']}: "
          f"{tp_step['num_collectives_per_step']} collectives, " + ", ".join(
              f"{kind} {b / 1024:.1f} KiB/token" for kind, b in tp_step["bytes_per_token"].items()
          ))  # fmt: skip
    for name, ratio in ratios.items():
        print(f"{name} / jengine TP=1 = {ratio:.2f}x (shared cores: overhead, not speed-up)")
    for name, e in estimate.items():
        tp2_us, tp1_us = e["tp_step_s"] * 1e6, e["tp1_step_s"] * 1e6
        print(f"on paper, {e['gpu']}, {name}: TP=2 decode step {tp2_us:.0f} us "
              f"vs TP=1 {tp1_us:.0f} us -> {e['estimated_speedup']:.2f}x")  # fmt: skip
    write_result(
        "parallel",
        args,
        versions,
        dict(
            workload="A",
            num_requests=len(prompts),
            output_len=max_tokens,
            forced_host_devices=NUM_DEVICES,
            results=results,
            ratios=ratios,
            tp2_step=tp_step,
            formula_matches_compiled_step=formula_matches,
            gpu_estimate=estimate,
            output_match=compare_outputs(outputs),
        ),
    )


if __name__ == "__main__":
    main()
