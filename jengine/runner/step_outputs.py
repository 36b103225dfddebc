"""What a step's sampled tokens become for the scheduler: the `ModelRunnerOutput`.

Where it sits: `ModelRunner.dispatch` returns an `InFlightStep` (its results still on the
device); `ModelRunner.collect` hands it to `collected_output`, which waits for the sampled
tokens, records them in the persistent batch (one token per sampled request, or for
speculative decoding the drafts `spec_decode.accept_drafts` keeps) and builds the
`ModelRunnerOutput` the scheduler's `update_from_output` reads.
"""

from dataclasses import dataclass

import numpy as np

from jengine.core.outputs import LogprobsArrays, ModelRunnerOutput
from jengine.runner.draft_model import Drafts
from jengine.runner.input_batch import InputBatch
from jengine.runner.prepared_step import PreparedStep
from jengine.runner.spec_decode import accept_drafts
from jengine.runner.step import SampleOutputs


@dataclass(frozen=True, slots=True)
class InFlightStep:
    """A dispatched step: what `collect` needs to read its results (prepared is None when
    it scheduled no tokens)."""

    prepared: PreparedStep | None
    outputs: SampleOutputs | None  # on device
    prompt_logprobs: tuple | None  # on device
    drafts: Drafts | None
    num_removals: int  # InputBatch.num_removals when it was dispatched
    hidden: object = None  # [T, D] final hidden states on device (kept for pooling only)


def collected_output(step: InFlightStep, batch: InputBatch) -> ModelRunnerOutput:
    """Wait for the step's sampled tokens, record them in `batch`, and describe them."""
    prepared, outputs, prompt_logprobs = step.prepared, step.outputs, step.prompt_logprobs
    if prepared.spec_drafts is not None:
        sampled_token_ids, kept_rows = accept_drafts(
            np.asarray(outputs.sampled), prepared.sample_mask, prepared.spec_drafts
        )
        batch.record_sampled(prepared.req_ids, sampled_token_ids)
        wants_logprobs = any(n is not None for n in prepared.num_logprobs)
        rows = kept_rows if wants_logprobs else None
        return runner_output(prepared, outputs, prompt_logprobs, sampled_token_ids, rows)
    if prepared.num_steps > 1:
        return _multi_step_output(step, batch)
    num = len(prepared.req_ids)
    sampled = np.asarray(outputs.sampled)[:num]
    mask = prepared.sample_mask[:num]
    batch.record_sampled_rows(prepared, sampled, step.num_removals)
    # tolist() gives Python ints in one call; a decode step samples every request.
    tokens = sampled.tolist()
    if mask.all():
        sampled_token_ids = [[t] for t in tokens]
    else:
        sampled_token_ids = [[t] if m else [] for t, m in zip(tokens, mask.tolist())]
    wants_logprobs = prepared.num_logprobs.count(None) != num
    rows = np.nonzero(mask)[0] if wants_logprobs else None
    return runner_output(prepared, outputs, prompt_logprobs, sampled_token_ids, rows)


def _multi_step_output(step: InFlightStep, batch: InputBatch) -> ModelRunnerOutput:
    """`collected_output` of a multi-step decode: outputs are [K, S, ...], every request
    sampled K tokens; the logprob rows are laid out request by request, as the
    ModelRunnerOutput lists them."""
    prepared, outputs = step.prepared, step.outputs
    num, num_steps = len(prepared.req_ids), prepared.num_steps
    sampled = np.asarray(outputs.sampled)[:, :num].T  # [requests, K]
    batch.record_sampled_rows(prepared, sampled, step.num_removals)
    rows = None
    if prepared.num_logprobs.count(None) != num:

        def request_major(x):  # [K, S, ...] -> [S * K, ...]
            x = np.asarray(x)
            return np.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])

        logprobs = (outputs.logprob_ids, outputs.logprobs, outputs.ranks)
        outputs = SampleOutputs(None, *map(request_major, logprobs))
        rows = np.arange(num * num_steps)
    return runner_output(prepared, outputs, None, sampled.tolist(), rows)


def runner_output(
    prepared: PreparedStep, outputs: SampleOutputs, prompt_logprobs, sampled, rows
) -> ModelRunnerOutput:
    """The step's ModelRunnerOutput: `sampled` tokens per request, and the logprobs of
    sampling `rows` (one per sampled token, in order; None when nobody asked)."""
    logprobs = None
    if rows is not None:
        logprobs = LogprobsArrays(
            np.asarray(outputs.logprob_ids)[rows],
            np.asarray(outputs.logprobs)[rows],
            np.asarray(outputs.ranks)[rows],
        )
    return ModelRunnerOutput(
        req_ids=prepared.req_ids,
        req_id_to_index=dict(zip(prepared.req_ids, range(len(prepared.req_ids)))),
        sampled_token_ids=sampled,
        logprobs=logprobs,
        prompt_logprobs_dict=prompt_logprobs_dict(prepared, prompt_logprobs),
    )


def prompt_logprobs_dict(prepared: PreparedStep, prompt_logprobs) -> dict:
    """Each request's rows of the step's prompt logprobs."""
    rows = {}
    if prompt_logprobs is not None:
        ids, values, ranks = (np.asarray(x) for x in prompt_logprobs)
        for req_id, (begin, end) in prepared.prompt_logprob_rows.items():
            rows[req_id] = LogprobsArrays(ids[begin:end], values[begin:end], ranks[begin:end])
    return rows
