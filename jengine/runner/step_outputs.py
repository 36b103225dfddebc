"""What a step's sampled tokens become for the scheduler: the `ModelRunnerOutput`.

Where it sits: `ModelRunner._to_runner_output` (one token per sampled request) and
`ModelRunner._verified_output` (speculative decoding: the kept drafts) hand their tokens
and logprob rows here; the scheduler's `update_from_output` reads the result.
"""

import numpy as np

from jengine.core.outputs import LogprobsArrays, ModelRunnerOutput
from jengine.runner.prepared_step import PreparedStep
from jengine.runner.step import SampleOutputs


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
