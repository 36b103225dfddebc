"""SchedulerOutput: what the model runner must compute in one step.

Where it sits: ``Scheduler.schedule()`` returns one per step; ``ModelRunner.execute()``
consumes it and returns a ``ModelRunnerOutput`` for ``Scheduler.update_from_output``.

What it promises: a runner that keeps persistent per-request state can follow the
scheduler with these deltas alone, and never needs a ``Request``:

1. Drop the state of every id in ``removed_req_ids`` (finished, aborted or *preempted*
   since the previous step; ids the runner never saw may appear and are to be ignored).
2. Add every ``NewRequestData``: it carries everything, including, for a request resumed
   after preemption, the output tokens generated so far and its complete new block table.
3. Update every ``CachedRequestData`` (a request the runner already holds): append
   ``new_block_ids`` to its block table. The runner already knows its tokens: it appended
   the tokens it sampled itself (the scheduler accepts every sampled token, and a request
   that stops shows up in ``removed_req_ids`` next step).

For every scheduled request, the tokens to run are positions
``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens[req_id])`` of
prompt + outputs, and the request is sampled only when that range reaches its last known
token (a chunk that ends mid-prompt yields an empty sample list).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jengine.lora_request import LoRARequest
from jengine.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner does not hold yet (new, or resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # tokens already in the cache (prefix hit), not to be run
    # Tokens generated before a preemption: the sequence continues as
    # prompt_token_ids + output_token_ids, and penalties / seeded sampling pick up where
    # they stopped. Empty for a fresh request.
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None  # the sampler masks it (and stop ids) before min_tokens
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    arrival_number: int = 0  # Request.arrival_number: an unseeded request's random stream


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds and that ran in an earlier step."""

    req_id: str
    new_block_ids: list[int]  # append to the block table (often empty)
    num_computed_tokens: int  # tokens in the cache before this step


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> tokens to run this step; running requests first, then new ones.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    removed_req_ids: set[str] = field(default_factory=set)
    # Constrained requests that sample this step, and their rows of the packed int32
    # token bitmask [rows, ceil(V / 32)] (None when there are none).
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: the draft tokens each request verifies this step (they follow
    # its last known token in its scheduled tokens; the runner samples every position).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Draft-model speculation: after this step the runner drafts this many tokens for
    # each request that samples (0: it does not); their slots are allocated.
    num_lookahead_tokens: int = 0
    # Multi-step decoding (`SchedulerConfig.num_scheduler_steps`): every scheduled request
    # runs one token and then this many - 1 more decode steps in the same program, each on
    # the token the one before sampled; it samples this many tokens (their slots are
    # allocated). 1: an ordinary step.
    num_decode_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
