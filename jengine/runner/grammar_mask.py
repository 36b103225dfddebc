"""The structured-output token mask of a step, on the host and on the device.

Where it sits: the scheduler sends the packed int32 bitmask rows of the constrained
requests that sample (jengine/core/structured_output.py); `place_grammar_rows` puts them
at those requests' sampling rows of an `[S, ceil(V / 32)]` mask (every token allowed
elsewhere), and `sample_step` applies it with `apply_token_bitmask` before any sampling
rule (under a `lax.cond`: steps without constraints skip it).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jengine.core.sched_output import SchedulerOutput
from jengine.runner.prepared_step import PreparedStep


def place_grammar_rows(prepared: PreparedStep, scheduler_output: SchedulerOutput) -> np.ndarray:
    """The step's [S, W] bitmask. A constrained request has one sampling row (it does not
    speculate); other requests' drafts may put more rows before it."""
    rows = scheduler_output.grammar_bitmask
    full = np.full((prepared.num_sample_rows, rows.shape[1]), -1, np.int32)
    drafts = prepared.spec_drafts or [()] * len(prepared.req_ids)
    first_row, row = {}, 0
    for req_id, request_drafts in zip(prepared.req_ids, drafts, strict=True):
        first_row[req_id] = row
        row += len(request_drafts) + 1
    for i, req_id in enumerate(scheduler_output.structured_output_request_ids):
        full[first_row[req_id]] = rows[i]
    return full


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """[R, V] logits with every token a row's bitmask forbids at -inf.

    `bitmask` is [R, ceil(V / 32)] int32: bit t % 32 of word t // 32 set means token t is
    allowed (llguidance's and xgrammar's packing; an unconstrained row is all ones).
    """
    rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)
