"""Messages that cross the process boundary between the front end and the engine core.

Where it sits: the input processor builds an `EngineCoreRequest`; the clients
(jengine/engine/client.py) encode it with msgspec and the engine core decodes it; the
engine core answers with `EngineCoreOutputs` (defined beside the scheduler that makes
them, in jengine/core/outputs.py, and re-exported here).

Every message is a `msgspec.Struct` (array_like, omit_defaults, gc=False); request kinds
are a small IntEnum so the wire carries one byte for them.
"""

import enum
from typing import Any

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


class EngineCoreOutputType(enum.IntEnum):
    """First frame of every message on the output socket: what the second frame holds."""

    OUTPUTS = 0  # EngineCoreOutputs
    UTILITY = 1  # UtilityOutput


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Call `method(*args)` on the engine core; answered by a `UtilityOutput`."""

    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    result: Any = None
    failure_message: str | None = None


class EngineCoreReady(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The engine process's first message: warmup is done and these are its numbers."""

    pid: int
    vocab_size: int
    num_blocks: int
    max_model_len: int
    capacity_report: str = ""
    startup_seconds: float = 0.0


__all__ = [
    "EngineCoreOutput",
    "EngineCoreOutputType",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineCoreReady",
    "EngineCoreRequestType",
    "FinishReason",
    "LogprobsLists",
    "SchedulerStats",
    "UtilityOutput",
    "UtilityRequest",
]
