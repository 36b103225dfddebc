"""Work a step may skip: `lax.cond` where the device picks the branch, both branches and a
select where a conditional would make the host wait.

Where it sits: `sampler.py`, `truncation.py` and `step.py` skip what a batch does not ask
for (penalties, top-k / top-p, random draws, top logprobs, grammar masking) with `branch`,
inside the jitted decode and sampling programs.

Why two ways: XLA:CPU and XLA:TPU pick a conditional's branch where the program runs, so
skipping saves the work. XLA:GPU copies the predicate to the host and waits for it: the
host then waits for every kernel queued before it, and a step's dispatch returns only when
its device work is nearly done, so async scheduling overlaps nothing. On an H100 (a 1.1B
bf16 Llama, one request) a decode step's dispatch took 4.2 ms of the step's 4.0 ms of
device work with conditionals, 1.9 ms of 2.8 ms with selects, and single-stream decode
went from 204 to 361 tokens/s; computing both branches cost ~0.4 ms a step at 64 rows
(bench/README.md, "On a GPU").
"""

import jax
import jax.numpy as jnp

# Where a conditional waits on the host (tests add "cpu" to run the GPU's way here).
SELECTING_PLATFORMS = ("cuda", "rocm")


def branch(pred, true_fun, false_fun, *operands):
    """`lax.cond(pred, true_fun, false_fun, *operands)` on CPU and TPU; on GPUs both
    branches run and `pred` selects (no conditional: the host never waits on the device)."""

    def conditional(*args):
        return jax.lax.cond(pred, true_fun, false_fun, *args)

    def select(*args):
        taken, other = true_fun(*args), false_fun(*args)
        return jax.tree.map(lambda a, b: jnp.where(pred, a, b), taken, other)

    # Resolved when the program is lowered: only the target platform's way is emitted.
    selecting = dict.fromkeys(SELECTING_PLATFORMS, select)
    return jax.lax.platform_dependent(*operands, **selecting, default=conditional)
