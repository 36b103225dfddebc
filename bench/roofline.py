"""What this machine can do at best: measured matmul GFLOP/s and memory bandwidth, and the
model arithmetic that turns them into rooflines for a workload.

Where it sits: the throughput benchmark divides the workload's model FLOPs by the measured
matmul rate (the compute roofline of a batched workload); the latency benchmark divides
the weight bytes one decode step reads by the measured read bandwidth (the roofline of a
single stream). Both measure with jax on the CPU the engine uses, with all its threads.
"""

import time

from .workloads import BENCH_MODEL


def _best_of(fn, repeats: int) -> float:
    fn()  # compile / warm
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """float32 [size, size] @ [size, size] through XLA, the best of `repeats`."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((size, size), jnp.float32)
    b = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    seconds = _best_of(lambda: matmul(a, b).block_until_ready(), repeats)
    return 2 * size**3 / seconds / 1e9


def read_bandwidth_gbs(num_bytes: int, repeats: int = 5) -> float:
    """Bytes per second a float32 sum over `num_bytes` reads through XLA, all threads: what
    a decode step's weight reads can get at best. Measure it at the size of the weights:
    on this VM a 1 GiB read came out at 38 GB/s and a 256 MiB one at 27.5 (a two-thread
    AVX2 loop over 256 MiB: 29-31 GB/s)."""
    import jax
    import jax.numpy as jnp

    from jengine.runner.huge_pages import back_with_huge_pages

    data = jnp.ones(num_bytes // 4, jnp.float32)
    back_with_huge_pages(data)  # in the pages the engine's weights get
    total = jax.jit(jnp.sum)
    seconds = _best_of(lambda: total(data).block_until_ready(), repeats)
    return data.nbytes / seconds / 1e9


def layer_params(config: dict = BENCH_MODEL) -> int:
    """Weights of the layers' projections, which every token multiplies."""
    hidden, mlp = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    return config["num_hidden_layers"] * (hidden * hidden * 2 + hidden * kv * 2 + 3 * hidden * mlp)


def weight_bytes(config: dict = BENCH_MODEL, itemsize: int = 4) -> int:
    """Bytes one decode step must read at least: every matmul weight once (the layers and
    the LM head)."""
    return (layer_params(config) + config["hidden_size"] * config["vocab_size"]) * itemsize


def workload_flops(prompt_lens: list[int], output_len: int, config: dict = BENCH_MODEL) -> float:
    """Model FLOPs of running every prompt and generating `output_len` tokens each: the
    layers' matmuls (2 x params per token), attention (QK^T and PV over the causal
    context) and the LM head for the tokens that are sampled."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    params = layer_params(config)
    lm_head = hidden * config["vocab_size"]
    total = 0.0
    for prompt_len in prompt_lens:
        tokens = prompt_len + output_len
        attended = tokens * (tokens + 1) / 2  # token i attends to i + 1 positions
        total += 2 * params * tokens + 4 * layers * hidden * attended + 2 * lm_head * output_len
    return total
