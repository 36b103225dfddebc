"""The step as pure functions over pytrees, and the pytrees they hand each other.

Where it sits: `ModelRunner` jits these functions once (binding the graphdef, the
attention implementation, the tensor-parallel mesh and, for those that sample, whether
its platform's branches select (`branches.selects`) and the top-logprob count k
(`--max-logprobs`) as static arguments) and calls them
every step: `ForwardInputs.from_prepared`
turns the numpy `PreparedStep` of `input_batch.py` into the model's inputs and
`sampling_args` into the sampling program's, `forward_step`
runs the model and picks the hidden row of each sampling row, `first_rows` keeps the S
sampling rows of those R (steps whose rows are fewer than their requests' bucket),
`sample_step` computes their logits and samples one token per row, and
`prompt_logprobs_step` (only for requests that asked for prompt logprobs) scores every
scheduled position. Nothing here holds state or touches the host.

Promises:
- `forward_step` is `(params, kv_cache, inputs, last_token) -> (kv_cache, hidden, rows)`
  (graphdef, attention implementation and tensor-parallel mesh bound); the runner donates
  the KV cache, so it is updated in place; an input whose `from_slot` is set is that
  slot's `last_token` (the previous step's sampled token, never seen by the host);
- `sample_step` is `(sampling_state, params, rows, meta, want_logprobs, grammar_bitmask,
  use_grammar) -> (sampling_state, SampleOutputs)` (graphdef, mesh, select, k bound): the LM head
  runs over the S sampling rows only, not over every request row of the step's shape;
  the runner donates the sampling state; the top-logprob work runs only when
  `want_logprobs` is true and the structured-output masking only when `use_grammar` is
  (`branches.branch`: on GPUs both run, and a select keeps what was asked for);
- `decode_step` is `forward_step` then `sample_step` on its rows, `(params, kv_cache,
  inputs, sampling_state, meta, want_logprobs, grammar_bitmask, use_grammar) ->
  (kv_cache, sampling_state, hidden, SampleOutputs)`, cache and state donated;
- logprobs are [S, k + 1] (the sampled or target token first), whatever a request asked
  for: the host slices what it wants.

Why the head is in the sampling program, not a program of its own: one dispatch less per
step (~0.2 ms of host time on a small CPU), and XLA:CPU runs a program as small as a gather
and a matmul inline on the calling thread when its inputs are ready, so the host would
wait there for the whole LM head. For the same reason a decode step (every request one
token, every request a sampling row: S = R) runs `decode_step`, the forward and the
sampling as one program: one dispatch, and one program launch, a step (bench/README.md,
"One program per decode step"); the other shapes keep the two programs, so that the
sampling program compiles per S rather than per forward shape.

Axis letters: T tokens, R requests, S sampling rows (S <= R), D hidden, k top logprobs.
"""

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jengine.models import AttentionMetadata
from jengine.runner.branches import branch
from jengine.runner.grammar_mask import DeviceBitmasks, apply_token_bitmask
from jengine.runner.prepared_step import PreparedStep, padded
from jengine.runner.sampler import SamplingMetadata, sample, top_logprobs


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ForwardInputs:
    input_ids: jax.Array  # [T]
    from_slot: jax.Array  # [T] take the input from this slot's last sampled token (-1: no)
    positions: jax.Array  # [T]
    attention: AttentionMetadata
    logits_indices: jax.Array  # [R] the token each sampling row reads, padded to R
    lora_slots: jax.Array | None  # [T] each token's LoRA slot (None: no LoRA)

    @classmethod
    def from_prepared(cls, prepared: PreparedStep) -> "ForwardInputs":
        return cls(
            input_ids=prepared.input_ids,
            from_slot=prepared.from_slot,
            positions=prepared.positions,
            attention=AttentionMetadata(
                slot_mapping=prepared.slot_mapping,
                kv_lens=prepared.kv_lens,
                block_tables=prepared.block_tables,
                query_start_loc=prepared.query_start_loc,
                q_block_size=prepared.shape.q_block_size,
            ),
            logits_indices=padded(prepared.logits_indices, prepared.shape.num_reqs),
            lora_slots=prepared.lora_slots,
        )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SampleOutputs:
    sampled: jax.Array  # [S]
    logprob_ids: jax.Array  # [S, k+1]
    logprobs: jax.Array  # [S, k+1]
    ranks: jax.Array  # [S]


# The step is several jitted pure functions rather than one so that each compiles per the
# bucket axes it depends on: the model per (T, R, P, Bq), head and sampling per S, the row
# selection per (R, S), prompt logprobs per T. Warmup then compiles far fewer programs; a
# step pays a few extra dispatches.


def sampling_args(prepared: PreparedStep, bitmasks: DeviceBitmasks) -> tuple:
    """The sampling program's arguments after the rows: (meta, want_logprobs, grammar
    bitmask, use_grammar). A decode step samples every request row (S = R)."""
    assert not prepared.shape.is_decode or prepared.num_sample_rows == prepared.shape.num_reqs
    want_logprobs = np.bool_(any(n is not None for n in prepared.num_logprobs))
    bitmask, use_grammar = bitmasks.for_step(prepared)
    return SamplingMetadata(**prepared.sampling), want_logprobs, bitmask, use_grammar


def forward_step(
    graphdef, attention_impl, mesh, params, kv_cache, inputs: ForwardInputs, last_token
):
    """Run the model over the step's tokens: (kv_cache, [T, D] hidden, [R, D] the hidden
    rows of the sampling rows)."""
    model = nnx.merge(graphdef, params)
    from_device = last_token[jnp.maximum(inputs.from_slot, 0)]
    lora = {} if inputs.lora_slots is None else {"lora_slots": inputs.lora_slots}
    hidden, kv_cache = model(
        jnp.where(inputs.from_slot >= 0, from_device, inputs.input_ids),
        inputs.positions,
        kv_cache,
        inputs.attention,
        attention_impl=attention_impl,
        mesh=mesh,
        **lora,
    )
    return kv_cache, hidden, hidden[inputs.logits_indices]


def first_rows(rows, num_rows: int):
    """[S, D]: the first S of [R, D] rows (S static)."""
    return rows[:num_rows]


def _logits(model, rows, mesh):
    """[S, V] logits of hidden rows. With a tensor-parallel `mesh`, the vocab-parallel
    logits are gathered for sampling."""
    logits = model.compute_logits(rows, mesh=mesh)
    if mesh is not None:
        # Each device computes its vocab shard's logits, then the [R, V] logits are
        # gathered. Asked for replicated logits outright, XLA gathers the [D, V] head
        # instead: far more bytes than R rows of logits.
        (axis,) = mesh.axis_names
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(None, axis)))
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
    return logits


def sample_step(
    graphdef,
    mesh,
    select: bool,
    num_logprobs: int,
    sampling_state,
    params,
    rows,
    meta: SamplingMetadata,
    want_logprobs,
    grammar_bitmask,
    use_grammar,
):
    """Sample one token per sampling row from its [D] hidden row, with its top
    `num_logprobs` logprobs when `want_logprobs`.

    With `use_grammar`, tokens `grammar_bitmask` forbids are masked first, so every
    sampling rule and the logprobs see the masked logits (as vLLM's do); without it the
    masking costs nothing.
    """
    logits = _logits(nnx.merge(graphdef, params), rows, mesh)
    logits = branch(
        use_grammar,
        apply_token_bitmask,
        lambda x, _: x,
        logits,
        grammar_bitmask,
        select=select,
    )
    sampled, sampling_state = sample(logits, meta, sampling_state, select=select)

    def compute(_):
        return top_logprobs(logits, sampled, num_logprobs)

    def skip(_):  # the branch not taken costs nothing
        rows = logits.shape[0]
        return (
            jnp.zeros((rows, num_logprobs + 1), jnp.int32),
            jnp.zeros((rows, num_logprobs + 1), jnp.float32),
            jnp.zeros((rows,), jnp.int32),
        )

    logprobs = branch(want_logprobs, compute, skip, None, select=select)
    return sampling_state, SampleOutputs(sampled, *logprobs)


def decode_step(
    graphdef,
    attention_impl,
    mesh,
    select: bool,
    num_logprobs: int,
    params,
    kv_cache,
    inputs: ForwardInputs,
    sampling_state,
    meta: SamplingMetadata,
    want_logprobs,
    grammar_bitmask,
    use_grammar,
):
    """A decode step in one program: `forward_step`, then `sample_step` on its R rows."""
    kv_cache, hidden, rows = forward_step(
        graphdef, attention_impl, mesh, params, kv_cache, inputs, sampling_state.last_token
    )
    sampling_state, sampled = sample_step(
        graphdef,
        mesh,
        select,
        num_logprobs,
        sampling_state,
        params,
        rows,
        meta,
        want_logprobs,
        grammar_bitmask,
        use_grammar,
    )
    return kv_cache, sampling_state, hidden, sampled


def multi_decode_step(
    graphdef,
    attention_impl,
    mesh,
    select: bool,
    num_logprobs: int,
    block_size: int,
    num_steps: int,
    params,
    kv_cache,
    inputs: ForwardInputs,
    sampling_state,
    meta: SamplingMetadata,
    want_logprobs,
    grammar_bitmask,
    use_grammar,
):
    """`num_steps` decode steps in one program (multi-step decoding): `decode_step`, then
    again on the tokens it sampled, one position further. `(..., the arguments of
    decode_step) -> (kv_cache, sampling_state, SampleOutputs [num_steps, S, ...])`.

    Step j > 0 of a request reads its slot's `last_token` (what step j - 1 sampled), at
    output index + j, and writes its K/V where its block table (which the scheduler grew
    for all the steps) has position + j; padding rows keep writing the null page and
    attending to nothing. Every row samples in every step, with the same grammar and
    suppressed ids (the scheduler runs multi-step decodes only where these do not change
    within the tokens a request may emit: no grammar, min_tokens not crossed).
    """
    sampling_rows = meta.sample_mask  # [R]: T = R = S rows, one token each

    def one_step(carry, _):
        kv_cache, sampling_state, inputs, meta = carry
        kv_cache, sampling_state, _, sampled = decode_step(
            graphdef,
            attention_impl,
            mesh,
            select,
            num_logprobs,
            params,
            kv_cache,
            inputs,
            sampling_state,
            meta,
            want_logprobs,
            grammar_bitmask,
            use_grammar,
        )
        positions = inputs.positions + 1
        pages = jnp.take_along_axis(
            inputs.attention.block_tables, (positions // block_size)[:, None], axis=1
        )[:, 0]
        attention = replace(
            inputs.attention,
            slot_mapping=jnp.where(sampling_rows, pages * block_size + positions % block_size, 0),
            kv_lens=jnp.where(sampling_rows, inputs.attention.kv_lens + 1, 0),
        )
        inputs = replace(
            inputs,
            positions=positions,
            from_slot=jnp.where(sampling_rows, meta.slots, -1),
            attention=attention,
        )
        meta = replace(meta, output_index=meta.output_index + 1)
        return (kv_cache, sampling_state, inputs, meta), sampled

    carry = (kv_cache, sampling_state, inputs, meta)
    (kv_cache, sampling_state, _, _), sampled = jax.lax.scan(one_step, carry, length=num_steps)
    return kv_cache, sampling_state, sampled


def prompt_logprobs_step(graphdef, mesh, num_logprobs, params, hidden, targets):
    """Logprobs of each position's next prompt token: logits for all T rows, [T, k+1]."""
    logits = _logits(nnx.merge(graphdef, params), hidden, mesh)
    return top_logprobs(logits, targets, num_logprobs)
