"""Hand-off objects from the runner to the scheduler, in the engine-core process.

Where it sits: the model runner returns one ``ModelRunnerOutput`` per step (host numpy /
Python lists, never jax arrays); ``Scheduler.update_from_output`` turns it into one
``EngineCoreOutputs`` (jengine/protocol.py), which goes to the front end.

What it promises: in-process slotted dataclasses; logprobs stay numpy until
``LogprobsArrays.to_lists`` makes the wire form of the rows a request asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jengine.protocol import LogprobsLists
from jengine.sampling_params import SamplingParams


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
    # Draft-model speculation: each request's drafts for its next step (None: not drafted).
    draft_token_ids: list[list[int]] | None = None
    # An embedding engine: the pooled float32 vector of each request the step finished.
    pooler_output: dict[str, bytes] = field(default_factory=dict)

    def logprob_row_starts(self) -> dict[str, int]:
        """Each request's first row in ``logprobs`` (empty when there are none)."""
        row_start: dict[str, int] = {}
        if self.logprobs is not None:
            row = 0
            for req_id, sampled in zip(self.req_ids, self.sampled_token_ids, strict=True):
                row_start[req_id] = row
                row += len(sampled)
        return row_start

    def logprobs_lists(
        self, req_id: str, num_tokens: int, row_start: dict[str, int], params: SamplingParams
    ) -> tuple[LogprobsLists | None, LogprobsLists | None]:
        """(logprobs of the request's first ``num_tokens`` sampled tokens, prompt logprobs
        of its chunk), in wire form, as far as ``params`` asked for them."""
        new_logprobs = new_prompt_logprobs = None
        if self.logprobs is not None and params.logprobs is not None and num_tokens:
            start = row_start[req_id]
            new_logprobs = self.logprobs.to_lists(start, start + num_tokens, params.logprobs)
        prompt_lp = self.prompt_logprobs_dict.get(req_id)
        if prompt_lp is not None and params.prompt_logprobs is not None:
            new_prompt_logprobs = prompt_lp.to_lists(0, len(prompt_lp), params.prompt_logprobs)
        return new_logprobs, new_prompt_logprobs
