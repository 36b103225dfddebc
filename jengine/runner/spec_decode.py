"""Speculative decoding in the runner: the sampling rows of the positions a step verifies,
and which drafts it keeps.

Where it sits: `InputBatch.prepare` calls `add_verification_rows` when the scheduler
sent drafts (`SchedulerOutput.scheduled_spec_decode_tokens`); after the step,
`ModelRunner._verified_output` calls `accept_drafts` on what was sampled.

What it promises:
- every verified position (each draft's, and the one after the last draft) is sampled
  exactly as a step without drafts would sample that output index: the same parameters,
  seed and index, so the same random key;
- a request keeps its drafts up to the first that differs from the token sampled at its
  position, plus that token (the correction, or after every draft the bonus token).
  Greedy, this is the argmax rule; sampled, it is exact rejection sampling for drafts
  with q = one-hot (n-gram): a draft d is kept with probability p(d), and otherwise the
  token comes from p without d. Either way the tokens are those of no speculation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jengine.runner.input_batch import _PARAM_COLUMNS, _padded, neutral_sampling_arrays

if TYPE_CHECKING:
    from jengine.runner.input_batch import InputBatch, PreparedStep, _Order


def add_verification_rows(
    batch: InputBatch, prepared: PreparedStep, spec: dict, order: _Order, query_start_loc
) -> None:
    """Replace `prepared`'s sampling rows (one per request) by one per verified position,
    a request's rows in a run."""
    req_ids, slots, n = prepared.req_ids, order.slots, len(order.slots)
    R = prepared.shape.num_reqs
    num_drafts = np.array([len(spec.get(r, ())) for r in req_ids], np.int32)
    rows_per_request = num_drafts + 1
    row_request = np.repeat(np.arange(n), rows_per_request)
    first_row = np.cumsum(rows_per_request) - rows_per_request
    offset = np.arange(len(row_request)) - np.repeat(first_row, rows_per_request)
    last = query_start_loc[1 : n + 1] - 1  # each request's last scheduled token
    logits_indices = last[row_request] - num_drafts[row_request] + offset
    row_slots = slots[row_request]
    arrays = neutral_sampling_arrays(R)
    rows = len(row_request)
    arrays["slots"][:rows] = row_slots
    for name in _PARAM_COLUMNS:
        arrays[name][:rows] = batch.params[name][row_slots]
    output_index = batch.num_tokens[row_slots] - batch.num_prompt_tokens[row_slots] + offset
    arrays["output_index"][:rows] = output_index
    if order.any_min_tokens:
        suppressing = output_index < batch.min_tokens[row_slots]
        arrays["suppressed_ids"][:rows] = np.where(
            suppressing[:, None], batch.params["suppressed_ids"][row_slots], -1
        )
    arrays["sample_mask"][:rows] = prepared.sample_mask[:n][row_request]
    prepared.logits_indices = _padded(logits_indices.astype(np.int32), R)
    prepared.sampling = arrays
    prepared.num_logprobs = [order.num_logprobs[i] for i in row_request.tolist()]
    prepared.spec_drafts = [spec.get(r, []) for r in req_ids]


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
