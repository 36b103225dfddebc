"""The draft model of speculative decoding: a small model beside the target, with its own
paged KV cache on the target's block tables, proposing k tokens per request each step.

Where it sits: `ModelRunner` owns one `DraftModel` when the speculative config's method is
`draft_model`. In a step the scheduler marked for drafting
(`SchedulerOutput.num_lookahead_tokens`), the runner dispatches the target step as usual,
then at once `propose(inputs, sampled, layout)` with the step's `ForwardInputs`, its
sampled rows (still on device) and where each request's rows are (`VerifiedLayout`), so
the host reads both results with one wait. The drafts go back to the scheduler in
`ModelRunnerOutput.draft_token_ids`, which sends them to be verified in the next step
like the n-gram proposer's.

What it promises:
- one jitted program per step shape and row count (`VerifiedLayout.row_counts`; all
  compiled at warmup, never while serving) does the whole proposal: the draft model runs
  over the step's own ragged tokens (so its cache holds every position the target
  computed, in the same slots of the same blocks), then
  `num_speculative_tokens` greedy decode steps from the token each drafting request now
  ends with (found on device by the acceptance rule of `spec_decode.accept_drafts`);
- drafts are greedy, so the draft distribution q is one-hot and the runner's acceptance
  rule (`spec_decode.py`) is exact rejection sampling, as for n-gram drafts: what the
  draft proposes changes how many tokens a step yields, never which;
- the decode steps write K/V only into slots the scheduler allocated for them (its
  lookahead), and into the null page past `max_model_len` or the step's block table.
  Positions whose draft K/V is stale (written by a rejected draft, or never written
  because the step ran without drafting) only make drafts worse, never outputs wrong.

Axis letters: T tokens, R requests, P pages per request, k drafts per request.
"""

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jengine.models import AttentionMetadata
from jengine.pallas_kernels.ragged_paged_attention import resolve_impl
from jengine.runner.buckets import next_power_of_two
from jengine.runner.compilation import StaticJit
from jengine.runner.huge_pages import move_to_huge_pages, zeros_in_huge_pages
from jengine.runner.kv_cache_sizing import KVCacheSizing, kv_cache_dtype_of
from jengine.runner.prepared_step import PreparedStep
from jengine.runner.step import ForwardInputs


def check_draft_model(draft: nnx.Module, target: nnx.Module, tensor_parallel_size: int):
    """A draft must speak the target's vocabulary (same ids, same size), on one device."""
    if tensor_parallel_size > 1:
        raise ValueError("a draft model does not run with tensor parallelism yet")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft model's vocabulary ({draft.config.vocab_size}"
            f" tokens) differs from the target's ({target.config.vocab_size}); a draft model "
            "needs the target's tokenizer"
        )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class VerifiedLayout:
    """Where each request's tokens sit in a step's sampling rows (host arrays): what the
    proposal needs to find, on device, the token each request now ends with."""

    # One row per request, padded to `rows_for` the step: the draft decodes that many rows.
    first_row: np.ndarray  # [r] the request's first sampling row
    num_drafts: np.ndarray  # [r] drafts it verified this step (0: a plain row)
    draft_tokens: np.ndarray  # [r, k] those drafts, zero padded
    drafting: np.ndarray  # [r] bool: it got a token this step (not mid-prefill, not padding)

    @staticmethod
    def row_counts(num_reqs: int, k: int) -> list[int]:
        """The row counts a step of R request rows may draft with: R, and (smaller,
        what a step full of k-draft requests has) R / (k + 1) rounded up to a power of
        two. Decoding the draft costs per row, and a speculating step's R counts its
        drafts' sampling rows."""
        compact = next_power_of_two(-(-num_reqs // (k + 1)))
        return sorted({compact, num_reqs})

    @classmethod
    def of(cls, prepared: PreparedStep, k: int) -> "VerifiedLayout":
        n = len(prepared.req_ids)
        rows = next(r for r in cls.row_counts(prepared.num_sample_rows, k) if r >= n)
        layout = cls.empty(rows, k)
        drafts = prepared.spec_drafts or [()] * n
        counts = np.fromiter(map(len, drafts), np.int32, n)
        layout.num_drafts[:n] = counts
        layout.first_row[:n] = np.cumsum(counts + 1) - (counts + 1)
        for i in np.flatnonzero(counts).tolist():
            layout.draft_tokens[i, : counts[i]] = drafts[i]
        layout.drafting[:n] = prepared.sample_mask[layout.first_row[:n]]
        return layout

    @classmethod
    def empty(cls, num_reqs: int, k: int) -> "VerifiedLayout":
        zeros = np.zeros(num_reqs, np.int32)
        return cls(zeros, zeros.copy(), np.zeros((num_reqs, k), np.int32), zeros.astype(bool))


def last_accepted(sampled, layout: VerifiedLayout, kv_lens):
    """Each request's token after this step's acceptance, and its position: the rule of
    `spec_decode.accept_drafts` (drafts kept while each equals the token sampled before
    it), on device."""
    num_reqs, k = layout.draft_tokens.shape
    offsets = jnp.arange(k + 1)
    rows = jnp.minimum(layout.first_row[:, None] + offsets, sampled.shape[0] - 1)
    tokens = sampled[rows]  # [R, k + 1]
    matches = (tokens[:, :k] == layout.draft_tokens) & (offsets[:k] < layout.num_drafts[:, None])
    num_accepted = jnp.cumprod(matches, axis=1).sum(axis=1)
    last = tokens[jnp.arange(num_reqs), num_accepted]
    # kv_lens counts every verified position; the rejected ones are not the request's.
    return last, kv_lens - layout.num_drafts + num_accepted


def propose_step(
    graphdef,
    attention_impl,
    num_steps: int,
    max_model_len: int,
    params,
    kv_cache,
    inputs: ForwardInputs,
    sampled,
    layout: VerifiedLayout,
):
    """Fill the draft cache with the step's tokens, then decode `num_steps` greedy drafts
    per request from the token it now ends with: (kv_cache, [R, k] drafts). Rows that do
    not draft are padding."""
    model = nnx.merge(graphdef, params)
    _, kv_cache = model(
        inputs.input_ids,
        inputs.positions,
        kv_cache,
        inputs.attention,
        attention_impl=attention_impl,
    )
    num_reqs = layout.first_row.shape[0]  # the rows that decode (the step's first ones)
    tokens, starts = last_accepted(sampled, layout, inputs.attention.kv_lens[:num_reqs])
    block_tables = inputs.attention.block_tables[:num_reqs]
    num_pages = block_tables.shape[1]
    block_size = kv_cache.shape[4]
    rows = jnp.arange(num_reqs)
    # Unrolled (k is small and static): a loop would carry the whole cache from iteration
    # to iteration, and XLA on CPU copies it each time.
    drafts = []
    for j in range(num_steps):
        positions = starts + j
        page = positions // block_size
        writes = layout.drafting & (positions < max_model_len) & (page < num_pages)
        block = block_tables[rows, jnp.minimum(page, num_pages - 1)]
        metadata = AttentionMetadata(
            # Rows that do not draft write the null page and attend to one slot of it.
            slot_mapping=jnp.where(writes, block * block_size + positions % block_size, 0),
            kv_lens=jnp.where(writes, positions + 1, 1),
            block_tables=block_tables,
            query_start_loc=jnp.arange(num_reqs + 1, dtype=jnp.int32),
            q_block_size=1,
        )
        hidden, kv_cache = model(
            tokens,
            jnp.where(writes, positions, 0),
            kv_cache,
            metadata,
            attention_impl=attention_impl,
        )
        tokens = jnp.argmax(model.compute_logits(hidden), axis=-1).astype(jnp.int32)
        drafts.append(tokens)
    return kv_cache, jnp.stack(drafts, axis=1)


class DraftModel:
    """The draft's weights, KV cache and proposal program (see the module promises)."""

    def __init__(
        self,
        model: nnx.Module,
        *,
        num_speculative_tokens: int,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        device: jax.Device,
        attention_impl: str | None = None,
        kv_cache_dtype: str = "auto",
    ):
        """`kv_cache_dtype`: its cache's `--kv-cache-dtype` name ("auto": the draft's dtype)."""
        self.config = model.config
        self.num_speculative_tokens = num_speculative_tokens
        graphdef, params = nnx.split(model)
        self.params = jax.device_put(params, device)
        move_to_huge_pages(self.params)  # its decode streams its weights too
        cache_shape = model.kv_cache_shape(num_blocks, block_size)
        cache_dtype = kv_cache_dtype_of(kv_cache_dtype, model.dtype)
        self.kv_cache = jax.device_put(jnp.zeros(cache_shape, cache_dtype), device)
        zeros_in_huge_pages(self.kv_cache)
        q = jax.ShapeDtypeStruct(
            (1, self.config.num_attention_heads, self.config.head_dim), model.dtype
        )
        self.attention_impl = resolve_impl(attention_impl, q, self.kv_cache, device.platform)
        self._propose_fn = StaticJit(
            propose_step,
            graphdef,
            self.attention_impl,
            num_speculative_tokens,
            max_model_len,
            donate_argnums=(1,),
        )

    @staticmethod
    def sharing_blocks(
        sizing: KVCacheSizing, model: nnx.Module, kv_cache_dtype: str
    ) -> KVCacheSizing:
        """The target's cache sizing with each block holding the draft's K/V as well."""
        shape = model.kv_cache_shape(1, sizing.block_size)
        draft_bytes = int(np.prod(shape)) * kv_cache_dtype_of(kv_cache_dtype, model.dtype).itemsize
        return dataclasses.replace(sizing, bytes_per_block=sizing.bytes_per_block + draft_bytes)

    def programs(self, dummy_steps, sharding) -> list[tuple]:
        """`(jitted_fn, *args)` of every proposal that can follow these (dummy) steps, for
        warmup: one per row count of `VerifiedLayout.row_counts`; their sampled rows are
        placed with `sharding`, as a step's are."""
        k = self.num_speculative_tokens
        programs = []
        for prepared in dummy_steps:
            num_reqs = prepared.shape.num_reqs
            sampled = jax.device_put(np.zeros(num_reqs, np.int32), sharding)
            inputs = ForwardInputs.from_prepared(prepared)
            for rows in VerifiedLayout.row_counts(num_reqs, k):
                layout = VerifiedLayout.empty(rows, k)
                programs.append(
                    (self._propose_fn, self.params, self.kv_cache, inputs, sampled, layout)
                )
        return programs

    def propose_after(self, prepared: PreparedStep, sampled) -> "Drafts":
        """Dispatch the proposal after the step `prepared`, whose sampled rows are still
        on device."""
        layout = VerifiedLayout.of(prepared, self.num_speculative_tokens)
        drafts = self.propose(ForwardInputs.from_prepared(prepared), sampled, layout)
        return Drafts(drafts, layout.drafting[: len(prepared.req_ids)])

    def propose(self, inputs: ForwardInputs, sampled, layout: VerifiedLayout) -> jax.Array:
        """Dispatch the proposal after a step (the draft cache is donated and replaced);
        `sampled`: the step's sampled rows, still on device. [R, k] drafts on device."""
        self.kv_cache, drafts = self._propose_fn(
            self.params, self.kv_cache, inputs, sampled, layout
        )
        return drafts


@dataclass(frozen=True)
class Drafts:
    """A dispatched proposal: [r, k] drafts on device, and which requests drafted."""

    tokens: jax.Array
    drafting: np.ndarray  # [n] bool, one per request of the step

    def lists(self) -> list[list[int]]:
        """Each request's drafts (empty where it did not draft); waits for the device."""
        drafting = self.drafting.tolist()
        tokens = np.asarray(self.tokens)[: len(drafting)].tolist()
        return [d if ok else [] for d, ok in zip(tokens, drafting)]
