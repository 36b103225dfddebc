"""The step programs as a GPU gets them, checked on this CPU-only machine: nothing outside
the attention kernel makes the host wait for the device or launch a loop's turns.

XLA:GPU runs a conditional by copying its predicate to the host and waiting for it, and a
loop by launching each turn from the host. A conditional in the decode program made each
step's dispatch return only when the step's device work was done (async scheduling then
overlapped nothing), and a binary search in the attention's metadata launched 8 turns in
every layer at 256 requests (~5 ms of host time a step): both measured on an H100
(bench/README.md, "On a GPU"). Here the programs are traced with the GPU kernel and the
branches a GPU's runner binds (`branches.selects`), and their control flow read off the
jaxpr (a platform-dependent conditional resolved for the platform).
"""

import functools

import jax
import pytest
from jax.extend import core as jax_core

from jengine.runner.branches import selects
from jengine.runner.prepared_step import PreparedStep
from jengine.runner.step import (
    ForwardInputs,
    decode_step,
    forward_step,
    multi_decode_step,
    sample_step,
    sampling_args,
)
from jengine.sampling_params import MAX_LOGPROBS


def _subjaxprs(params: dict):
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jax_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax_core.Jaxpr):
                yield item


def control_flow(jaxpr, platform: str) -> list[str]:
    """The conditionals and loops of `jaxpr` as lowered for `platform`, outside Pallas
    kernels (whose loops run inside the kernel); a platform-dependent conditional is the
    branch `platform` gets."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            continue
        platforms = eqn.params.get("branches_platforms") if name == "cond" else None
        if platforms is not None:
            index = next(
                (i for i, names in enumerate(platforms) if names and platform in names),
                platforms.index(None),
            )
            found += control_flow(eqn.params["branches"][index].jaxpr, platform)
            continue
        if name in ("cond", "while", "scan"):
            found.append(name)
        for sub in _subjaxprs(eqn.params):
            found += control_flow(sub, platform)
    return found


def _programs(runner, select: bool) -> dict:
    """name -> (function, arguments) of the step programs, with the GPU attention kernel,
    over the runner's largest decode shape and its largest mixed (prefill) shape; their
    branches selecting (as on GPUs) or not (`branches.branch`)."""
    shapes = runner.buckets.all_shapes()
    decode = max((s for s in shapes if s.is_decode), key=lambda s: s.num_reqs)
    mixed = max((s for s in shapes if not s.is_decode), key=lambda s: s.num_tokens)
    decode, mixed = PreparedStep.padding(decode), PreparedStep.padding(mixed)
    bound = (runner.graphdef, "gpu", None)
    state, params, kv = runner.sampling_state, runner.params, runner.kv_cache
    rows = jax.ShapeDtypeStruct((mixed.num_sample_rows, runner.config.hidden_size), runner.dtype)

    def inputs(step):
        return ForwardInputs.from_prepared(step)

    return {
        "decode": (
            functools.partial(decode_step, *bound, select, MAX_LOGPROBS),
            (params, kv, inputs(decode), state, *sampling_args(decode, runner.bitmasks)),
        ),
        "multi-step decode": (
            functools.partial(
                multi_decode_step, *bound, select, MAX_LOGPROBS, runner.block_size, 4
            ),
            (params, kv, inputs(decode), state, *sampling_args(decode, runner.bitmasks)),
        ),
        "forward": (
            functools.partial(forward_step, *bound),
            (params, kv, inputs(mixed), state.last_token),
        ),
        "sampling": (
            functools.partial(sample_step, runner.graphdef, None, select, MAX_LOGPROBS),
            (state, params, rows, *sampling_args(mixed, runner.bitmasks)),
        ),
    }


# The loops each program may keep: the scan over layers, and multi-step decoding's scan
# over its steps.
EXPECTED_LOOPS = {"decode": 1, "multi-step decode": 2, "forward": 1, "sampling": 0}


@pytest.mark.parametrize("attention_setup", ["default-bs16"], indirect=True)
def test_no_program_makes_a_gpu_host_wait(llm):
    runner = llm.engine_core.runner
    # A GPU device's `.platform` is "gpu"; programs are lowered for "cuda" or "rocm".
    assert all(map(selects, ("gpu", "cuda", "rocm"))) and not selects("cpu") and not selects("tpu")
    on_cpu = _programs(runner, select=False)
    for name, (function, args) in _programs(runner, select=True).items():
        on_gpu = control_flow(jax.make_jaxpr(function)(*args).jaxpr, "cuda")
        assert "cond" not in on_gpu and "while" not in on_gpu, (name, on_gpu)
        assert on_gpu.count("scan") == EXPECTED_LOOPS[name], (name, on_gpu)
        if name != "forward":
            # Where the device picks a branch, the sampler still skips what nobody asked for.
            function, args = on_cpu[name]
            assert control_flow(jax.make_jaxpr(function)(*args).jaxpr, "cpu").count("cond") >= 4
