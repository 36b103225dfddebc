"""Hand-off objects on the way back: runner -> scheduler -> front end.

Where it sits: the model runner returns one ``ModelRunnerOutput`` per step (host numpy /
Python lists, never jax arrays); ``Scheduler.update_from_output`` turns it into one
``EngineCoreOutputs``, which the engine-core process sends over ZMQ to the front end.

What it promises:
- ``ModelRunnerOutput`` is an in-process slotted dataclass; logprobs stay numpy.
- ``EngineCoreOutput(s)``, ``SchedulerStats`` and ``LogprobsLists`` are ``msgspec.Struct``
  (array_like, omit_defaults, gc=False) of plain types, so they cross the process boundary
  with msgspec's msgpack encoder and no custom hooks.
- ``FinishReason`` is a small IntEnum on the wire and prints as the OpenAI string.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec
import numpy as np


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # cancelled by the client or the engine

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(slots=True)
class LogprobsArrays:
    """Logprobs of a run of tokens, as numpy arrays (runner side).

    Row r describes one token: column 0 is that token (the sampled token, or for prompt
    logprobs the actual next prompt token), columns 1..k the top-k alternatives.
    """

    logprob_token_ids: np.ndarray  # [rows, k+1] int32
    logprobs: np.ndarray  # [rows, k+1] float32
    sampled_token_ranks: np.ndarray  # [rows] int32, rank of column 0 in the full vocabulary

    def __len__(self) -> int:
        return int(self.logprob_token_ids.shape[0])

    def to_lists(self, start: int, end: int, num_logprobs: int) -> LogprobsLists:
        """Rows [start, end) with the token itself plus its top ``num_logprobs``."""
        cols = num_logprobs + 1
        return LogprobsLists(
            token_ids=self.logprob_token_ids[start:end, :cols].tolist(),
            logprobs=self.logprobs[start:end, :cols].tolist(),
            ranks=self.sampled_token_ranks[start:end].tolist(),
        )


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step of the runner produced, indexed like ``req_ids``.

    sampled_token_ids[i] is empty for a request whose scheduled chunk ended mid-prompt (the
    runner discards that sample). logprobs, when any request asked for them, has one row per
    sampled token, in order: all rows of req_ids[0], then req_ids[1], ...
    prompt_logprobs_dict maps a request to the prompt logprobs of the chunk it ran.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsArrays | None = None
    prompt_logprobs_dict: dict[str, LogprobsArrays | None] = field(default_factory=dict)


class LogprobsLists(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Wire form of ``LogprobsArrays``: nested lists, one row per token."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Scheduler state for metrics. The first three are gauges (now); the rest are counts
    accumulated since the previous ``SchedulerStats`` was made."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens (and maybe the end) of one request after one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine-core step sends to the front end."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None
