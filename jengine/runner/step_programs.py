"""StepPrograms: the jitted programs a step runs, each with its static arguments bound.

Where it sits: `ModelRunner` builds one at start-up from its model's graph, the resolved
attention and mesh; warmup compiles every one of them at every shape, and each step
dispatches one (a decode step: `decode` or `multi_decode`) or two (`forward`, then
`sample`) of them, with `first_rows`, `prompt_logprobs` and `write_history` where the step
needs them. The functions themselves live in `step.py` and `sampler.py`.

Promises: the donated arguments are the KV cache (`forward`, `decode`, `multi_decode`) and
the sampling state (`decode`, `multi_decode`, `sample`, `write_history`), updated in
place; the static arguments (graph, attention, mesh, how the sampling programs skip work,
how many top logprobs they compute, block size, decode steps per launch) are fixed here,
so equal engines share traces.
"""

from collections.abc import Callable
from dataclasses import dataclass

import jax

from jengine.runner.branches import selects
from jengine.runner.compilation import StaticJit
from jengine.runner.sampler import write_slot_history
from jengine.runner.step import (
    decode_step,
    first_rows,
    forward_step,
    multi_decode_step,
    prompt_logprobs_step,
    sample_step,
)


@dataclass(frozen=True)
class StepPrograms:
    forward: StaticJit  # (params, kv_cache, inputs, last_token) -> (kv_cache, hidden, rows)
    decode: StaticJit  # one decode step, sampling included
    multi_decode: StaticJit  # num_decode_steps decode steps in one launch
    first_rows: Callable  # (rows, num_rows) -> the first num_rows rows
    sample: StaticJit  # (state, params, rows, *sampling) -> (state, sampled)
    prompt_logprobs: StaticJit  # (params, hidden, targets) -> prompt logprob rows
    write_history: Callable  # a slot's token history into the sampling state

    @classmethod
    def create(
        cls,
        graphdef,
        attention_impl: str,
        mesh,
        *,
        platform: str,
        num_logprobs: int,
        block_size: int,
        num_decode_steps: int,
    ) -> "StepPrograms":
        """`num_logprobs`: the top logprobs the sampling programs compute (a request
        slices what it asked for)."""
        bound = (graphdef, attention_impl, mesh)  # the model steps' static arguments
        sampling = (selects(platform), num_logprobs)
        multi = (*bound, *sampling, block_size, num_decode_steps)
        return cls(
            forward=StaticJit(forward_step, *bound, donate_argnums=(1,)),
            decode=StaticJit(decode_step, *bound, *sampling, donate_argnums=(1, 3)),
            multi_decode=StaticJit(multi_decode_step, *multi, donate_argnums=(1, 3)),
            first_rows=jax.jit(first_rows, static_argnums=1),
            sample=StaticJit(sample_step, graphdef, mesh, *sampling, donate_argnums=(0,)),
            prompt_logprobs=StaticJit(prompt_logprobs_step, graphdef, mesh, num_logprobs),
            write_history=jax.jit(write_slot_history, donate_argnums=0),
        )
