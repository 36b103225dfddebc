"""Parallel sampling: one user request with n > 1 becomes n engine-core sequences.

Where it sits: `OutputProcessor.add_request` fans a processed request out with `fan_out`
and gathers the sequences' outputs back under the user's request id; the engine core only
ever sees n = 1 sequences.

What it promises: sequence `index` is an independent request `{index}_{request_id}` with
n = 1 and, when the user gave a seed, the seed `seed + index`, so the n completions differ
from each other yet a rerun with the same seed gives the same n completions.
"""

from jengine.protocol import EngineCoreRequest
from jengine.sampling_params import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index` of an n > 1 request: n = 1, and a distinct seed if one was given."""
    child = params.clone()
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    return child


def fan_out(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """The engine-core sequences of one user request: itself for n == 1, else n children
    with ids `{index}_{request_id}` (sequence `index` is element `index`)."""
    params = request.sampling_params
    if params.n == 1:
        return [request]
    children = []
    for index in range(params.n):
        child = request.__copy__()
        child.request_id = f"{index}_{request.request_id}"
        child.sampling_params = child_params(params, index)
        children.append(child)
    return children
