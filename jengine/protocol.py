"""Every message that crosses the process boundary between the front end and the engine
core, in one jax-free module.

Where it sits: the input processor builds an `EngineCoreRequest`; the clients
(jengine/engine/client.py) encode it with msgspec and the engine core
(jengine/engine/core.py) decodes it; the scheduler (jengine/core/scheduler.py) makes one
`EngineCoreOutputs` per step, which goes back the same way; `UtilityRequest` /
`UtilityOutput` carry the few engine-core calls the front end may make
(`UTILITY_METHODS`); `EngineCoreReady` is the engine process's hand-shake. It sits beside
`sampling_params.py` and `request.py` at the top of the package because both sides of the
boundary use it: the scheduler (`jengine.core`, which imports nothing from
`jengine.engine`) and the front end.

What it promises: every message is a `msgspec.Struct` (array_like, omit_defaults, gc=False)
of plain types, so msgspec's msgpack encoder carries it with no custom hooks; request kinds
and finish reasons are small IntEnums, one byte on the wire.
"""

from __future__ import annotations

import enum
import signal
from typing import Any

import msgspec

from jengine.lora_request import LoRARequest
from jengine.pooling import PoolingParams
from jengine.sampling_params import SamplingParams

# -- front end -> engine core ---------------------------------------------------------------


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
    lora_request: LoRARequest | None = None
    # An embedding request (the engine runs `--runner pooling`): its sampling_params are
    # the engine's own one greedy token, never shown.
    pooling_params: PoolingParams | None = None
    # vLLM's cache_salt (its sha256, hex): only requests with the same salt share
    # prefix-cache blocks.
    cache_salt: str | None = None


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


# Engine-core methods the front end may call by name (over ZMQ or in-process).
# `update_weights` is not among them: it takes in-memory jax arrays, so `LLM` calls it on
# its in-process engine core directly.
UTILITY_METHODS = frozenset(
    {
        "num_free_blocks",
        "compiles_after_warmup",
        "has_unfinished_requests",
        "get_stats",
        "reset_prefix_cache",
        "add_lora",
        "remove_lora",
    }
)


class EngineCoreReady(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The engine process's first message: warmup is done and these are its numbers, or
    (`error`) it could not start because of its configuration."""

    pid: int
    vocab_size: int
    num_blocks: int
    capacity_report: str = ""
    startup_seconds: float = 0.0
    error: str = ""


# The front end stops an engine-core process with this signal once its requests are
# drained; the engine ignores SIGTERM while its parent lives (a process group's SIGTERM
# reaches both at once, and the front end must drain first).
ENGINE_STOP_SIGNAL = signal.SIGUSR1

# -- engine core -> front end ---------------------------------------------------------------


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # cancelled by the client
    ERROR = 3  # the engine could not serve it (`EngineCoreOutput.error` says why)

    def __str__(self) -> str:
        return self.name.lower()


class LogprobsLists(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Wire form of ``LogprobsArrays``: nested lists, one row per token."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Scheduler state for metrics. The first four are gauges (now); the rest are counts
    accumulated since the previous ``SchedulerStats`` was made."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    # Requests the scheduler was handed since start (accepted or not): the DP balancer
    # counts those routed to the replica but not in this report as load too.
    num_requests_received: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0
    spec_num_drafts: int = 0  # speculative decoding: requests that verified drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens (and maybe the end) of one request after one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # with FinishReason.ERROR: what went wrong, for the client
    pooled: bytes | None = None  # an embedding engine's pooled float32 vector, at the end
    # With its first tokens and at its end (engine-core monotonic clock): when the request
    # reached the engine core and when it was first scheduled, for the phase metrics.
    queued_time: float = 0.0
    scheduled_time: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine-core step sends to the front end."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None
    engine_index: int = 0  # which data-parallel replica sent it
