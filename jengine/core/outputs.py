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
