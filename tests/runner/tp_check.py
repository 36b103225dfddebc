"""Run in a subprocess with 4 forced CPU devices by tests/runner/test_tensor_parallel.py:
the same requests at tensor-parallel sizes 1, 2 and 4, and what the TP=4 engine holds and
compiles. Prints one JSON object.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.runner.tp_check PATH
    ... PATH.gguf gguf | PATH int8: the same with quantized weights (sizes 1, 2, 4 only)
    ... PATH experts: a mixture-of-experts model at size 1 and at 4, each expert split and
        whole experts spread (expert parallelism)
    (and TP=2 with multi-step decoding, --num-scheduler-steps 4)
    ... PATH lora A B: LoRA adapters A and B (PEFT folders) and the base model mixed, at
        sizes 1, 2 and 4 (4: each KV head repeated, and the adapters' k/v with it)
"""

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jengine import LLM, SamplingParams
from jengine.lora_request import LoRARequest
from jengine.models import load_model
from jengine.pallas_kernels.ragged_paged_attention import cpu
from jengine.runner.prepared_step import PreparedStep
from jengine.runner.sharding import step_collectives
from tests.engine.step_kinds import count_step_kinds

SHARED = list(range(10, 42))  # two full 16-token blocks: the second prompt hits them
PROMPTS = [
    [5, 17, 200, 3, 99, 41, 8, 250, 1] * 5,  # 45 tokens: chunked by a 32-token budget
    SHARED + [7, 8, 9],
    [8, 250, 1, 44],
    SHARED + [60, 61],
]
MAX_TOKENS = 16


ENGINE = dict(
    dtype="float32",
    max_model_len=96,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    block_size=16,
    num_gpu_blocks_override=9,  # 8 usable blocks for up to 4 x 4: preemption
)


def generate(llm: LLM, logprobs: int | None = None, lora_request=None):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=logprobs)
    return llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        params,
        use_tqdm=False,
        lora_request=lora_request,
    )


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def run(path: str, tp: int, lora_request=None, **kwargs) -> tuple[dict, LLM]:
    llm = LLM(path, tensor_parallel_size=tp, **ENGINE, **kwargs)
    step_kinds = count_step_kinds(llm)
    # The shared prefix the second prompt computes is a cache hit for the fourth.
    outputs = generate(llm, logprobs=2, lora_request=lora_request)
    core = llm.engine_core
    completions = [o.outputs[0] for o in outputs]
    return (
        dict(
            tokens=[list(c.token_ids) for c in completions],
            logprobs=[[e[t].logprob for e, t in zip(c.logprobs, c.token_ids)] for c in completions],
            cached_tokens=[o.num_cached_tokens for o in outputs],
            # Every id the logprobs name (a padded vocabulary's extra ids must never show).
            largest_logprob_id=max(i for c in completions for entry in c.logprobs for i in entry),
            preemptions=core.num_preemptions,
            compiles_after_warmup=core.compiles_after_warmup(),
            attention=core.runner.attention_impl,
            multi_step_decodes=sum(n for k, n in step_kinds.items() if k > 1),
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
    prepared = PreparedStep.padding(runner.buckets.shape_for(1, 1, 2))
    programs = runner.lower_step(prepared)  # a decode step: one program
    text = programs[0].as_text()
    manual = text.find("sdy.manual_computation")
    call = re.search(rf"custom_call @{cpu.TARGET_NAME}\((.*)", text)
    return dict(
        split=split,
        whole=whole,
        cache_shard=list(cache.addressable_shards[0].data.shape),
        cache_shape=list(cache.shape),
        embedding_rows=runner.params["embed_tokens"].value.shape[0],
        num_devices=len(cache.sharding.device_set),
        capacity_report=runner.capacity_report(),
        manual_computation_at=manual,
        # The step's forward, head and sampler.
        collectives=[c for p in programs for c in step_collectives(p.compile().as_text())],
        step_shape=[prepared.shape.num_tokens, prepared.shape.num_reqs],
        custom_call_at=call.start() if call else -1,
    )


def update_weights(llm: LLM, path: str) -> tuple[list[list[int]], dict]:
    """The checkpoint's own params (2 KV heads) swapped into the TP=4 engine (4, repeated),
    then the prompts again; and what trees of other shapes are told ({weight: [its
    checkpoint shape, the error]})."""
    params = nnx.to_pure_dict(nnx.state(load_model(path, "float32"), nnx.Param))
    refused = {}
    for name, weight in (("layers.k_proj", params["layers"]["k_proj"]),
                         ("embed_tokens", params["embed_tokens"])):  # fmt: skip
        narrow = weight[:, :-1] if name.startswith("layers") else weight[:-1]
        layers = {**params["layers"], "k_proj": narrow} if name.startswith("layers") else None
        tree = {**params, "layers": layers} if layers else {**params, "embed_tokens": narrow}
        try:
            llm.update_weights(tree)
        except ValueError as e:
            refused[name] = [str(tuple(weight.shape)), str(e)]
    llm.update_weights(params)
    return token_ids(generate(llm)), refused


def on_a_training_mesh(path: str) -> dict:
    """Params laid out on a 2 x 2 ("data", "model") mesh, as a training step leaves them:
    `LLM(params=, mesh=)` runs TP=4 on that mesh's devices; `update_weights` with other
    weights on the mesh reshards them with no host transfer (a transfer guard would raise)
    and compiles nothing; weights already in the engine's layout are copied on the
    devices (the engine never shares the caller's buffers, which a train step may donate)."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))

    def training_layout(x) -> NamedSharding:
        axes = [None] * x.ndim
        if x.ndim >= 1 and x.shape[-1] % 2 == 0:
            axes[-1] = "model"
        if x.ndim >= 2 and x.shape[-2] % 2 == 0:
            axes[-2] = "data"
        return NamedSharding(mesh, P(*axes))

    def on_mesh(tree):
        return jax.tree.map(lambda x: jax.device_put(x, training_layout(x)), tree)

    weights = nnx.to_pure_dict(nnx.state(load_model(path, "float32"), nnx.Param))
    weights = jax.tree.map(np.asarray, weights)
    rng = np.random.default_rng(0)
    other = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape, x.dtype), weights)
    reference = LLM(path, **ENGINE)
    reference.update_weights(other)
    other_tokens = token_ids(generate(reference))

    llm = LLM(path, params=on_mesh(weights), mesh=mesh, **ENGINE)
    runner = llm.engine_core.runner
    first = token_ids(generate(llm))
    other_on_mesh = on_mesh(other)
    no_host = (
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    )
    with no_host[0], no_host[1]:
        llm.update_weights(other_on_mesh)
    second = token_ids(generate(llm))
    engine_layout = jax.tree.map(jnp.copy, nnx.to_pure_dict(runner.params))
    with no_host[0], no_host[1]:
        llm.update_weights(engine_layout)

    def buffers(tree):
        return [
            shard.data.unsafe_buffer_pointer()
            for leaf in jax.tree.leaves(tree)
            for shard in leaf.addressable_shards
        ]

    return dict(
        tp=runner.tensor_parallel.size,
        same_devices=set(runner.tensor_parallel.mesh.devices.flat) == set(mesh.devices.flat),
        first=first,
        second=second,
        other_reference=other_tokens,
        shares_no_buffer=not set(buffers(runner.params)) & set(buffers(engine_layout)),
        compiles_after_warmup=llm.engine_core.compiles_after_warmup(),
    )


def quantized(path: str, quantization: str | None) -> dict:
    """Sizes 1, 2 and 4 with quantized weights (a GGUF's, or int8), and which of their
    arrays TP=4 splits."""
    results = {}
    for tp in (1, 2, 4):
        results[tp], llm = run(path, tp, quantization=quantization)
        report = llm.engine_core.runner.weights_report()
        results[tp]["saving_holds"] = int(re.search(r"hold (\d+) KV-cache tokens", report)[1])
    params = llm.engine_core.runner.params
    results["split"] = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if leaf.addressable_shards[0].data.shape != leaf.shape
    ]
    return results


def experts(path: str) -> dict:
    """An MoE model at size 1, and at 4 with its experts split (TP) and spread whole (EP,
    one a device); the shape of each device's expert array."""
    results = {"1": run(path, 1)[0]}
    for tp, expert_parallel in ((4, False), (4, True)):
        key = f"{'ep' if expert_parallel else 'tp'}{tp}"
        results[key], llm = run(path, tp, enable_expert_parallel=expert_parallel)
        layers = llm.engine_core.runner.params["layers"]
        results[key]["expert_gate_shard"] = list(
            layers["expert_gate"].value.addressable_shards[0].data.shape
        )
    return results


def lora(path: str, adapters: list[str]) -> dict:
    """Two adapters and the base model mixed, at sizes 1, 2 and 4."""
    loras = [LoRARequest(f"adapter{i}", i, p) for i, p in enumerate(adapters, start=1)]
    # The 2nd and 4th prompts share a prefix: under one adapter, a cache hit.
    per_prompt = [loras[0], loras[1], None, loras[1]]
    options = dict(enable_lora=True, max_loras=2, max_lora_rank=16)
    return {tp: run(path, tp, per_prompt, **options)[0] for tp in (1, 2, 4)}


def main() -> None:
    path = sys.argv[1]
    if len(sys.argv) > 2 and sys.argv[2] == "lora":
        print(json.dumps(lora(path, sys.argv[3:])))
        return
    if len(sys.argv) > 2 and sys.argv[2] == "experts":
        print(json.dumps(experts(path)))
        return
    if len(sys.argv) > 2:  # quantized weights: a GGUF kept quantized, or "int8"
        quantization = None if sys.argv[2] == "gguf" else sys.argv[2]
        print(json.dumps(quantized(path, quantization)))
        return
    results = {}
    results["2, multi-step"], _ = run(path, 2, num_scheduler_steps=4)
    for tp in (1, 2, 4):
        results[tp], llm = run(path, tp)
    results["layout"] = layout(llm)
    results["updated_tokens"], results["refused"] = update_weights(llm, path)
    results["compiles_after_update"] = llm.engine_core.compiles_after_warmup()
    results["mesh"] = on_a_training_mesh(path)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
