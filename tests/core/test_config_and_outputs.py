"""Configs validate on construction; engine-core outputs survive the msgpack boundary."""

import dataclasses

import msgspec
import numpy as np
import pytest

from jengine.config import CacheConfig, SchedulerConfig
from jengine.core import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsArrays,
    SchedulerStats,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 12}, "block_size"),
        ({"num_gpu_blocks": 1}, "num_gpu_blocks"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.1}, "gpu_memory_utilization"),
    ],
)
def test_cache_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        CacheConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"policy": "lifo"}, "policy"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ],
)
def test_scheduler_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SchedulerConfig(**kwargs)


def test_configs_are_frozen():
    cfg = CacheConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 32
    assert SchedulerConfig(policy="priority").policy == "priority"


def test_engine_core_outputs_round_trip():
    lp = LogprobsArrays(
        logprob_token_ids=np.array([[5, 6, 7], [8, 9, 10]], np.int32),
        logprobs=np.array([[-0.5, -1.0, -2.0], [-0.25, -3.0, -4.0]], np.float32),
        sampled_token_ranks=np.array([1, 2], np.int32),
    )
    outs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("a", [5, 8], new_logprobs=lp.to_lists(0, 2, 1)),
            EngineCoreOutput("b", [3], finish_reason=FinishReason.STOP, stop_reason=3),
            EngineCoreOutput("c", [], finish_reason=FinishReason.LENGTH, num_cached_tokens=16),
        ],
        timestamp=1.5,
        scheduler_stats=SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25),
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(outs), type=EngineCoreOutputs)
    assert decoded == outs
    assert decoded.outputs[0].new_logprobs.token_ids == [[5, 6], [8, 9]]
    assert decoded.outputs[0].new_logprobs.ranks == [1, 2]
    assert decoded.outputs[1].finish_reason is FinishReason.STOP and decoded.outputs[1].finished
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort"]
