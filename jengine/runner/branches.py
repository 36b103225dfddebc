"""Work a step may skip: `lax.cond` where the device picks the branch, both branches and a
select where a conditional would make the host wait.

Where it sits: `sampler.py`, `truncation.py` and `step.py` skip what a batch does not ask
for (penalties, top-k / top-p, random draws, top logprobs, grammar masking) with `branch`,
inside the jitted decode and sampling programs. `ModelRunner` binds `selects(platform)`
of its devices as a static argument of those programs, and they hand it down.

Why two ways: XLA:CPU and XLA:TPU pick a conditional's branch where the program runs, so
skipping saves the work. XLA:GPU copies the predicate to the host and waits for it: the
host then waits for every kernel queued before it, and a step's dispatch returns only when
its device work is nearly done, so async scheduling overlaps nothing. On an H100 (a 1.1B
bf16 Llama, one request) a decode step's dispatch took 4.2 ms of the step's 4.0 ms of
device work with conditionals, 1.9 ms of 2.8 ms with selects, and single-stream decode
went from 204 to 361 tokens/s; computing both branches cost ~0.4 ms a step at 64 rows
(bench/README.md, "On a GPU").

Why the way is chosen when traced, not by `lax.platform_dependent` when lowered: that
traces every platform's way at every branch, and the sampler's branches nest four deep
above its searches, so each sampling program traced `truncate` 8 times and each of its two
searches 16 times, looped and unrolled; a small model's warmup spent ~3 s of its ~5 s
(with every program in the compilation cache) tracing ways it never ran.
"""

import jax
import jax.numpy as jnp

# Where a conditional waits on the host: a GPU device's `.platform` is "gpu" (CUDA and
# ROCm alike); "cuda" and "rocm" are the names programs are lowered for.
SELECTING_PLATFORMS = ("gpu", "cuda", "rocm")


def selects(platform: str) -> bool:
    """Whether programs for `platform` (a jax device's `.platform`, or a lowering platform)
    compute both branches and select, rather than run a conditional."""
    return platform in SELECTING_PLATFORMS


def branch(pred, true_fun, false_fun, *operands, select: bool):
    """`lax.cond(pred, true_fun, false_fun, *operands)`; with `select` (GPUs: `selects`)
    both branches run and `pred` selects (no conditional: the host never waits on the
    device)."""
    if not select:
        return jax.lax.cond(pred, true_fun, false_fun, *operands)
    taken, other = true_fun(*operands), false_fun(*operands)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), taken, other)
