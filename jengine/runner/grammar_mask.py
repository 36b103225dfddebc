"""The structured-output token mask of a step, on the host and on the device.

Where it sits: the scheduler sends the packed int32 bitmask rows of the constrained
requests that sample (jengine/core/structured_output.py); `place_grammar_rows` puts them
at those requests' sampling rows of an `[S, ceil(V / 32)]` mask (every token allowed
elsewhere), `DeviceBitmasks` puts it on the device (or the all-ones mask a step without
constraints passes unused), and `sample_step` applies it with `apply_token_bitmask` before
any sampling rule (under `branches.branch`: steps without constraints skip it, except on
GPUs).
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


class DeviceBitmasks:
    """A step's bitmask on the device and whether to apply it."""

    def __init__(self, vocab_size: int, placement):
        self.width = (vocab_size + 31) // 32
        self.placement = placement  # the sampling rows' sharding (or device)
        self._allow_all: dict[int, jax.Array] = {}  # one all-ones mask per S bucket

    def allow_all(self, num_rows: int) -> jax.Array:
        mask = self._allow_all.get(num_rows)
        if mask is None:
            mask = jax.device_put(np.full((num_rows, self.width), -1, np.int32), self.placement)
            self._allow_all[num_rows] = mask
        return mask

    def for_step(self, prepared: PreparedStep) -> tuple[jax.Array, np.bool_]:
        if prepared.grammar_bitmask is None:
            # No constrained request: the all-ones mask already on the device, unused.
            return self.allow_all(prepared.num_sample_rows), np.False_
        # Placed like the all-ones masks: the same jit cache key.
        return jax.device_put(prepared.grammar_bitmask, self.placement), np.True_


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """[R, V] logits with every token a row's bitmask forbids at -inf.

    `bitmask` is [R, ceil(V / 32)] int32: bit t % 32 of word t // 32 set means token t is
    allowed (llguidance's and xgrammar's packing; an unconstrained row is all ones).
    """
    rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)
