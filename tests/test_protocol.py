"""Every cross-process message survives the msgpack boundary unchanged."""

import msgspec
import numpy as np

from jengine.core import LogprobsArrays
from jengine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
)
from jengine.sampling_params import SamplingParams


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
            EngineCoreOutput("d", [], finish_reason=FinishReason.ERROR, error="cannot be met"),
        ],
        timestamp=1.5,
        scheduler_stats=SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25),
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(outs), type=EngineCoreOutputs)
    assert decoded == outs
    assert decoded.outputs[0].new_logprobs.token_ids == [[5, 6], [8, 9]]
    assert decoded.outputs[0].new_logprobs.ranks == [1, 2]
    assert decoded.outputs[1].finish_reason is FinishReason.STOP and decoded.outputs[1].finished
    assert decoded.outputs[3].error == "cannot be met" and decoded.outputs[3].finished
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error"]


def test_requests_and_utility_calls_round_trip():
    params = SamplingParams(temperature=0.5, stop=["\n"], logit_bias={7: -2.0}, seed=3)
    request = EngineCoreRequest("r", [1, 2, 3], params, eos_token_id=2, priority=-1)
    for message in (
        request,
        UtilityRequest(4, "get_stats"),
        UtilityOutput(4, result={"num_running_reqs": 0}),
        EngineCoreReady(pid=1, vocab_size=384, num_blocks=256, capacity_report="KV"),
    ):
        encoded = msgspec.msgpack.encode(message)
        assert msgspec.msgpack.decode(encoded, type=type(message)) == message
