"""Run in a subprocess with 4 forced CPU devices by tests/runner/test_tensor_parallel.py:
the same requests at tensor-parallel sizes 1, 2 and 4, and what the TP=4 engine holds and
compiles. Prints one JSON object.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.runner.tp_check PATH
"""

import json
import re
import sys

import jax
from flax import nnx

from jengine import LLM, SamplingParams
from jengine.models import load_model
from jengine.pallas_kernels.ragged_paged_attention import cpu
from jengine.runner.step import ForwardInputs

SHARED = list(range(10, 42))  # two full 16-token blocks: the second prompt hits them
PROMPTS = [
    [5, 17, 200, 3, 99, 41, 8, 250, 1] * 5,  # 45 tokens: chunked by a 32-token budget
    SHARED + [7, 8, 9],
    [8, 250, 1, 44],
    SHARED + [60, 61],
]
MAX_TOKENS = 16


def run(path: str, tp: int) -> tuple[dict, LLM]:
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=96,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        block_size=16,
        num_gpu_blocks_override=9,  # 8 usable blocks for up to 4 x 4: preemption
        tensor_parallel_size=tp,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
    # The shared prefix the second prompt computes is a cache hit for the fourth.
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    core = llm.engine_core
    completions = [o.outputs[0] for o in outputs]
    return (
        dict(
            tokens=[list(c.token_ids) for c in completions],
            logprobs=[[e[t].logprob for e, t in zip(c.logprobs, c.token_ids)] for c in completions],
            cached_tokens=[o.num_cached_tokens for o in outputs],
            preemptions=core.num_preemptions,
            compiles_after_warmup=core.compiles_after_warmup(),
            attention=core.runner.attention_impl,
        ),
        llm,
    )


def layout(llm: LLM) -> dict:
    """Which params and the cache are split (no device holding all of one), and where the
    attention custom call sits in the lowered step."""
    runner = llm.engine_core.runner
    split, whole = [], []
    for path, leaf in jax.tree_util.tree_leaves_with_path(runner.params):
        name = jax.tree_util.keystr(path)
        shard = leaf.addressable_shards[0].data.shape
        (split if shard != leaf.shape else whole).append(name)
    cache = runner.kv_cache
    prepared = runner._dummy_step(runner.buckets.shape_for(1, 1, 2))
    text = runner._forward_fn.lower(
        runner.params, runner.kv_cache, ForwardInputs.from_prepared(prepared)
    ).as_text()
    manual = text.find("sdy.manual_computation")
    call = re.search(rf"custom_call @{cpu.TARGET_NAME}\((.*)", text)
    return dict(
        split=split,
        whole=whole,
        cache_shard=list(cache.addressable_shards[0].data.shape),
        cache_shape=list(cache.shape),
        num_devices=len(cache.sharding.device_set),
        capacity_report=runner.capacity_report(),
        manual_computation_at=manual,
        custom_call_at=call.start() if call else -1,
    )


def update_weights(llm: LLM, path: str) -> list[list[int]]:
    """The checkpoint's own params (2 KV heads) swapped into the TP=4 engine (4, repeated),
    then the prompts again."""
    llm.update_weights(nnx.state(load_model(path, "float32"), nnx.Param))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    path = sys.argv[1]
    results = {}
    for tp in (1, 2, 4):
        results[tp], llm = run(path, tp)
    results["layout"] = layout(llm)
    results["updated_tokens"] = update_weights(llm, path)
    results["compiles_after_update"] = llm.engine_core.compiles_after_warmup()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
