"""Request: the scheduler-side state of one request (host only).

Where it sits: the engine core builds a ``Request`` from an incoming request message and
hands it to ``Scheduler.add_request``; from then on only the scheduler (and the KV cache
manager it owns) mutates it. The model runner never sees a ``Request``: it learns what it
needs from ``SchedulerOutput``.

What it promises: the token bookkeeping vLLM V1 scheduling is built on. ``all_token_ids``
is prompt + output; ``num_computed_tokens`` counts the leading tokens whose K/V are in the
cache (or scheduled to be written this step); the scheduler's only question each step is
``num_tokens - num_computed_tokens``. ``block_hashes`` holds the chained content hashes of
the full blocks of ``all_token_ids`` so far (the KV cache manager extends it).
"""

from __future__ import annotations

import enum
import time

from jengine.lora_request import LoRARequest
from jengine.protocol import FinishReason
from jengine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING_FOR_GRAMMAR = -1  # its structured-output grammar is still compiling
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after PREEMPTED is finished; ``is_finished`` relies on this order.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # `Request.error` says why

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "queued_time",
        "scheduled_time",
        "priority",
        "status",
        "stop_reason",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_prompt_logprobs_sent",
        "num_prompt_logprobs_computed",
        "num_cached_tokens",
        "num_preemptions",
        "arrival_number",
        "output_token_ids",
        "all_token_ids",
        "block_hashes",
        "lora_request",
        "cache_salt",
        "structured_output",
        "spec_token_ids",
        "error",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # The engine core's monotonic clock: when it got the request, and when the request
        # was first scheduled (0: not yet), as vLLM's QUEUED and SCHEDULED events.
        self.queued_time = time.monotonic()
        self.scheduled_time = 0.0
        self.priority = priority  # lower value = scheduled first (vLLM convention)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        # Steps scheduled to sample a token for it whose tokens have not come back yet
        # (async scheduling: the next step is scheduled before this one's results).
        self.num_output_placeholders = 0
        # Prompt-logprob rows sent to the front end, and computed since the request last
        # (re)started: a request preempted mid-prompt computes its prompt again from
        # position 0, and those rows must not be sent twice.
        self.num_prompt_logprobs_sent = 0
        self.num_prompt_logprobs_computed = 0
        # Prefix-cache hit length at the first schedule; -1 means "not scheduled yet".
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Its place among the requests the scheduler received (it numbers them): an
        # unseeded request's random stream is drawn from it, so asking again samples afresh.
        self.arrival_number = 0
        self.output_token_ids: list[int] = []
        # Prompt + output in one list so hashing and recompute-after-preemption need no
        # concatenation on the hot path.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.block_hashes: list[int] = []
        self.lora_request = lora_request  # its adapter (None: the base model)
        self.cache_salt = cache_salt  # shares cached blocks only with the same salt
        # A constrained request's grammar and matcher (core/structured_output.py).
        self.structured_output = None
        # Draft tokens proposed for the next step (speculative decoding), not yet verified.
        self.spec_token_ids: list[int] = []
        self.error: str | None = None  # why it ended with FINISHED_ERROR

    @property
    def lora_id(self) -> int:
        """Its LoRA adapter's id (0: the base model)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    def fail(self, error: str) -> None:
        """End with FINISHED_ERROR: the engine cannot serve it (`error` goes to the client)."""
        self.status = RequestStatus.FINISHED_ERROR
        self.error = error

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_computed_tokens}/{self.num_tokens}, "
            f"outputs={self.num_output_tokens})"
        )
