"""Messages that cross the process boundary between the front end and the engine core.

Where it sits: the input processor builds an `EngineCoreRequest`; the clients
(jengine/engine/client.py) encode it with msgspec and the engine core decodes it; the
engine core answers with `EngineCoreOutputs` (defined beside the scheduler that makes
them, in jengine/core/outputs.py, and re-exported here).

Every message is a `msgspec.Struct` (array_like, omit_defaults, gc=False); request kinds
are a small IntEnum so the wire carries one byte for them.
"""

import enum

import msgspec

from jengine.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsLists,
    SchedulerStats,
)
from jengine.sampling_params import SamplingParams


class EngineCoreRequestType(enum.IntEnum):
    ADD = 0
    ABORT = 1
    UTILITY = 2


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0


__all__ = [
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineCoreRequestType",
    "FinishReason",
    "LogprobsLists",
    "SchedulerStats",
]
