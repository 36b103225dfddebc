"""Speculative decoding in the runner: the sampling rows of the positions a step verifies,
and which drafts it keeps.

Where it sits: `InputBatch.prepare` lays out its sampling rows by `verification_rows` when
the scheduler sent drafts (`SchedulerOutput.scheduled_spec_decode_tokens`); after the step,
`step_outputs.collected_output` calls `accept_drafts` on what was sampled. Nothing here
imports the rest of the runner: the persistent batch depends on this module, not back.

What it promises:
- every verified position (each draft's, and the one after the last draft) gets a
  sampling row of its own, reading the logits of the token before it; `InputBatch`
  samples each such row exactly as a step without drafts would sample that output index
  (the same parameters, seed and index, so the same random key);
- a request keeps its drafts up to the first that differs from the token sampled at its
  position, plus that token (the correction, or after every draft the bonus token).
  Greedy, this is the argmax rule; sampled, it is exact rejection sampling for drafts
  with q = one-hot (n-gram): a draft d is kept with probability p(d), and otherwise the
  token comes from p without d. Either way the tokens are those of no speculation.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VerificationRows:
    """The sampling rows of a step with drafts: one per verified position (each draft's,
    and the one after the last draft), a request's rows in a run."""

    row_request: np.ndarray  # [rows] which request (index in the step) each row samples for
    offset: np.ndarray  # [rows] the row's place in its request's run, 0 first
    logits_indices: np.ndarray  # [rows] the token whose logits the row samples from


def verification_rows(num_drafts: np.ndarray, last_token: np.ndarray) -> VerificationRows:
    """Rows for requests with `num_drafts` drafts each, whose last scheduled token (the
    last draft, or the last known token without drafts) is at `last_token` in the step."""
    rows_per_request = num_drafts + 1
    row_request = np.repeat(np.arange(len(num_drafts)), rows_per_request)
    first_row = np.cumsum(rows_per_request) - rows_per_request
    offset = np.arange(len(row_request)) - np.repeat(first_row, rows_per_request)
    logits_indices = last_token[row_request] - num_drafts[row_request] + offset
    return VerificationRows(row_request, offset, logits_indices.astype(np.int32))


def accept_drafts(
    sampled: np.ndarray, sample_mask: np.ndarray, drafts: list[list[int]]
) -> tuple[list[list[int]], list[int]]:
    """(each request's kept tokens, the sampling rows they came from)."""
    num_rows = sum(len(d) + 1 for d in drafts)
    sampled = sampled[:num_rows].tolist()
    mask = sample_mask[:num_rows].tolist()
    tokens_per_request, kept_rows, row = [], [], 0
    for request_drafts in drafts:
        tokens = []
        if mask[row]:  # (not mid-prefill)
            tokens.append(sampled[row])
            for j, draft in enumerate(request_drafts):
                if tokens[-1] != draft:
                    break
                tokens.append(sampled[row + j + 1])
        tokens_per_request.append(tokens)
        kept_rows.extend(range(row, row + len(tokens)))
        row += len(request_drafts) + 1
    return tokens_per_request, kept_rows
