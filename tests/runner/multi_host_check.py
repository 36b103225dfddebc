"""Run in a subprocess by tests/runner/test_multi_host.py: greedy generation with logprobs
at TP=4 on the tiny serving model, either in one process with 4 devices or as host 0 of a
two-host `jax.distributed` run. Prints one JSON object.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.runner.multi_host_check PATH
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.runner.multi_host_check \
        PATH 127.0.0.1:PORT   # host 0; host 1 runs `jengine serve PATH ... --host-rank 1`
"""

import json
import sys

from jengine import LLM, SamplingParams
from tests.entrypoints.tiny_model import ENGINE_ARGS

PROMPTS = [
    "A long prompt, longer than one step's token budget, so that its prefill is chunked "
    "over several steps of the engine, while the others decode beside it.",
    "The quick brown fox",
    "Hello, world!",
]
MAX_TOKENS = 16
# Fewer step shapes than the serving tests' engines: host 1 compiles its programs anew at
# every start (jax writes cache entries from process 0 only, and on CPU host 1's keys
# differ: they hash its devices' topology).
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=32)
ENGINE = {**ENGINE_ARGS, **LIMITS}


def main(path: str, coordinator_address: str | None = None) -> None:
    hosts = {}
    if coordinator_address:
        hosts = dict(num_hosts=2, host_rank=0, coordinator_address=coordinator_address)
    llm = LLM(path, tensor_parallel_size=4, **ENGINE, **hosts)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    # Again: the prompts are now prefix-cache hits.
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    completions = [o.outputs[0] for o in outputs]
    result = dict(
        texts=[c.text for c in completions],
        tokens=[list(c.token_ids) for c in completions],
        logprobs=[[e[t].logprob for e, t in zip(c.logprobs, c.token_ids)] for c in completions],
        again_tokens=[list(o.outputs[0].token_ids) for o in again],
        cached_tokens=[o.num_cached_tokens for o in again],
        devices=llm.engine_core.runner.tensor_parallel.mesh.devices.size,
        compiles_after_warmup=llm.engine_core.compiles_after_warmup(),
    )
    llm.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
