"""The persistent host batch: per-request state the runner keeps across steps, and the
translation of one SchedulerOutput into padded numpy arrays.

Where it sits: `ModelRunner.execute` calls `update` with each SchedulerOutput (drop
finished, add new, extend block tables), then `prepare` to get a `PreparedStep` of numpy
arrays in one of the shapes of `buckets.py`, then `record_sampled_rows` with what came
back. It never touches jax; the runner moves the arrays to the device.

Promises:
- padding tokens write the null page 0; padding requests (q_len 0, kv_len 0) attend to none;
- a request's tokens are prompt + what this runner sampled for it: the scheduler sends
  deltas only (jengine/core/sched_output.py);
- async scheduling: `mark_sampling` counts each sampling request's tokens (a multi-step
  decode's K) as pending until `record_sampled_rows` brings them; a pending token's input
  reads its slot's last sampled token on the device (`from_slot`); output indices count it;
- each running request keeps one slot (row of the on-device sampling history and of
  preallocated per-slot arrays: tokens, block table, counters, sampling parameters), so
  `prepare` gathers a step in a fixed number of vectorized numpy calls (vLLM V1's way);
- the arrays of a `PreparedStep` are read-only: the request-only sampling columns are
  shared by the steps that schedule the same requests in the same order;
- with speculative decoding, a request's drafts sit after its known tokens in its row
  (so they are its next inputs) and each verified position gets its own sampling row
  (laid out by `spec_decode.verification_rows`), at the output index it would have without
  drafts; the rows of a step
  never outnumber its request bucket (the scheduler keeps them within max_num_seqs);
- the sampling rows (logits_indices, sampling arrays) are padded to their own bucket S.

Axis letters: T tokens, R requests, P pages per request.
"""

import zlib
from dataclasses import dataclass, field

import numpy as np

from jengine.core.kv_cache_utils import cdiv
from jengine.core.sched_output import NewRequestData, SchedulerOutput
from jengine.runner.buckets import BucketSpec
from jengine.runner.prepared_step import PreparedStep, neutral_sampling_arrays, padded
from jengine.runner.sampler import fold_seed
from jengine.runner.spec_decode import verification_rows
from jengine.sampling_params import MAX_SUPPRESSED_IDS, SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """What the batch keeps about a request besides its rows of the slot arrays."""

    req_id: str
    num_prompt_tokens: int
    sampling_params: SamplingParams
    slot: int
    seed: int
    suppressed_ids: list[int]  # EOS + stop ids, masked until min_tokens
    lora_id: int = 0  # its LoRA adapter's id (0: the base model)

    @property
    def uses_history(self) -> bool:
        return self.sampling_params.uses_history


# Sampling columns that depend only on the request, kept per slot and gathered each step.
_PARAM_COLUMNS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seeds",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "use_history",
)


class InputBatch:
    """Per-slot numpy rows (tokens, block table, counters, sampling parameters) that live
    as long as their request runs, so a step gathers its inputs with a few vectorized ops
    instead of rebuilding them per request."""

    def __init__(self, buckets: BucketSpec, block_size: int, seed: int = 0):
        self.buckets = buckets
        self.block_size = block_size
        self.seed = seed
        self.requests: dict[str, CachedRequestState] = {}
        S = buckets.max_num_seqs
        self.free_slots = list(range(S - 1, -1, -1))
        # +1: a request whose prompt fills max_model_len still samples one last token.
        # np.zeros maps pages lazily, so rows cost memory only as far as they are written.
        self.token_ids = np.zeros((S, buckets.max_pages * block_size + 1), np.int32)
        self.num_tokens = np.zeros(S, np.int32)  # prompt + sampled tokens known per slot
        # Tokens sampled on the device but not yet recorded here (async scheduling).
        self.num_pending = np.zeros(S, np.int32)
        self.num_removals = 0  # requests dropped so far: a step's rows may have gone
        self.num_prompt_tokens = np.zeros(S, np.int32)
        self.num_computed_tokens = np.zeros(S, np.int32)
        self.block_table = np.zeros((S, buckets.max_pages), np.int32)  # zero past the end
        self.num_blocks = np.zeros(S, np.int32)
        self.params = neutral_sampling_arrays(S)  # the _PARAM_COLUMNS and suppressed_ids
        self.min_tokens = np.zeros(S, np.int32)
        self.num_logprobs = np.full(S, -1, np.int32)  # -1: no logprobs
        self.wants_prompt_logprobs = np.zeros(S, bool)
        # What the last step's request order allowed to precompute: steady decoding
        # repeats the order. Reset whenever membership changes.
        self._order: _Order | None = None
        self._arange = np.arange(S + 1, dtype=np.int32)
        self._no_device_inputs: dict[int, np.ndarray] = {}  # T -> [T] of -1, read-only

    # -- following the scheduler ---------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput) -> list[CachedRequestState]:
        """Apply the scheduler's deltas; returns the requests that just entered the batch."""
        for req_id in scheduler_output.removed_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.free_slots.append(state.slot)
                self.num_removals += 1
                self._order = None
        added = [self._add(new) for new in scheduler_output.scheduled_new_reqs]
        if added:
            self._order = None
        requests, computed = self.requests, self.num_computed_tokens
        for cached in scheduler_output.scheduled_cached_reqs:
            slot = requests[cached.req_id].slot
            if cached.new_block_ids:
                self._append_blocks(slot, cached.new_block_ids)
            computed[slot] = cached.num_computed_tokens
        return added

    def _add(self, new: NewRequestData) -> CachedRequestState:
        params = new.sampling_params
        state = CachedRequestState(
            req_id=new.req_id,
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=params,
            slot=self.free_slots.pop(),
            seed=self._seed_for(new.req_id, params.seed, new.arrival_number),
            suppressed_ids=params.min_tokens_suppressed_ids(new.eos_token_id),
            lora_id=0 if new.lora_request is None else new.lora_request.lora_int_id,
        )
        self.requests[new.req_id] = state
        slot = state.slot
        tokens = [*new.prompt_token_ids, *new.output_token_ids]
        self.token_ids[slot, : len(tokens)] = tokens
        self.num_tokens[slot] = len(tokens)
        self.num_pending[slot] = 0
        self.num_prompt_tokens[slot] = state.num_prompt_tokens
        self.num_computed_tokens[slot] = new.num_computed_tokens
        self.block_table[slot] = 0
        self.num_blocks[slot] = 0
        self._append_blocks(slot, new.block_ids)
        columns = self.params
        for name in ("temperature", "top_p", "min_p"):
            columns[name][slot] = getattr(params, name)
        columns["top_k"][slot] = max(params.top_k, 0)
        columns["seeds"][slot] = state.seed
        columns["presence_penalty"][slot] = params.presence_penalty
        columns["frequency_penalty"][slot] = params.frequency_penalty
        columns["repetition_penalty"][slot] = params.repetition_penalty
        columns["use_history"][slot] = state.uses_history
        columns["suppressed_ids"][slot] = -1
        columns["suppressed_ids"][slot, : len(state.suppressed_ids)] = state.suppressed_ids
        self.min_tokens[slot] = params.min_tokens
        self.num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self.wants_prompt_logprobs[slot] = params.prompt_logprobs is not None
        return state

    def _append_blocks(self, slot: int, block_ids: list[int]) -> None:
        begin = int(self.num_blocks[slot])
        self.block_table[slot, begin : begin + len(block_ids)] = block_ids
        self.num_blocks[slot] = begin + len(block_ids)

    def _seed_for(self, req_id: str, seed: int | None, arrival_number: int) -> int:
        # Unseeded requests get a seed derived from the engine seed, the request id and its
        # arrival, so a run is reproducible, a request sent again (under the same id too)
        # samples afresh, and a preempted request resumes the same random stream.
        if seed is None:
            seed = (self.seed * 1_000_003 + zlib.crc32(req_id.encode())) * 1_000_033
            seed += arrival_number
        return fold_seed(seed)

    def all_token_ids(self, req_id: str) -> np.ndarray:
        """Prompt + the tokens sampled so far of a request in the batch (a view)."""
        slot = self.requests[req_id].slot
        return self.token_ids[slot, : self.num_tokens[slot]]

    def record_sampled(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        for req_id, tokens in zip(req_ids, sampled, strict=True):
            if tokens:
                slot = self.requests[req_id].slot
                end = int(self.num_tokens[slot])
                self.token_ids[slot, end : end + len(tokens)] = tokens
                self.num_tokens[slot] = end + len(tokens)

    def mark_sampling(self, prepared: PreparedStep) -> None:
        """The requests of `prepared` that sample have its tokens pending."""
        num = len(prepared.req_ids)
        slots = prepared.sampling["slots"][:num]
        self.num_pending[slots[prepared.sample_mask[:num]]] += prepared.num_steps

    def record_sampled_rows(
        self, prepared: PreparedStep, sampled: np.ndarray, num_removals: int
    ) -> None:
        """Append `sampled[i]` to request i of `prepared` wherever its sample mask is set,
        in place of its pending token (a multi-step decode's `sampled` is [rows, K]).
        `num_removals`: `self.num_removals` when the step was prepared; requests dropped
        since (their slots may be someone else's now) are skipped."""
        num = len(prepared.req_ids)
        slots = prepared.sampling["slots"][:num]
        mask = prepared.sample_mask[:num]
        if num_removals != self.num_removals:
            requests = self.requests
            mask = mask & np.fromiter(
                (
                    (state := requests.get(req_id)) is not None and state.slot == slot
                    for req_id, slot in zip(prepared.req_ids, slots.tolist())
                ),
                bool,
                num,
            )
        sampled = sampled[:num]
        if not mask.all():
            slots, sampled = slots[mask], sampled[mask]
        num_steps = prepared.num_steps
        columns = self.num_tokens[slots][:, None] + np.arange(num_steps)
        self.token_ids[slots[:, None], columns] = sampled.reshape(-1, num_steps)
        self.num_tokens[slots] += num_steps
        self.num_pending[slots] -= num_steps

    # -- building the padded step --------------------------------------------------------

    def _order_of(self, req_ids: list[str]) -> "_Order":
        order = self._order
        if order is None or req_ids != order.req_ids:
            slots = np.array([self.requests[r].slot for r in req_ids], np.int32)
            order = self._order = _Order(
                req_ids=req_ids,
                slots=slots,
                num_logprobs=[None if k < 0 else k for k in self.num_logprobs[slots].tolist()],
                any_prompt_logprobs=bool(self.wants_prompt_logprobs[slots].any()),
                any_min_tokens=bool((self.min_tokens[slots] > 0).any()),
            )
        return order

    def prepare(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        num_scheduled = scheduler_output.num_scheduled_tokens
        req_ids = list(num_scheduled)
        order = self._order_of(req_ids)
        slots, n = order.slots, len(req_ids)
        counts = np.fromiter(num_scheduled.values(), np.int32, n)
        starts = self.num_computed_tokens[slots]
        kv_lens = starts + counts
        total = int(counts.sum())
        spec = scheduler_output.scheduled_spec_decode_tokens
        num_rows = n
        if spec:  # drafts follow the last known token: their slots of the buffer hold them
            for req_id, drafts in spec.items():
                slot = self.requests[req_id].slot
                end = int(self.num_tokens[slot])
                self.token_ids[slot, end : end + len(drafts)] = drafts
            num_rows += sum(map(len, spec.values()))
        # Draft-model steps reach num_lookahead_tokens further, multi-step decodes K - 1.
        num_steps = scheduler_output.num_decode_steps
        reach = int(kv_lens.max()) + scheduler_output.num_lookahead_tokens + num_steps - 1
        num_pages = min(cdiv(reach, self.block_size), self.buckets.max_pages)
        shape = self.buckets.shape_for(total, num_rows, num_pages)
        T, R, P = shape.num_tokens, shape.num_reqs, shape.num_pages
        S = self.buckets.sample_rows(shape, num_rows)
        if total == n:  # one token per request: the common decode step
            token_slots, positions = slots, starts
            query_start_loc = np.minimum(self._arange[: R + 1], n)
        else:
            query_start_loc = np.empty(R + 1, np.int32)
            query_start_loc[0] = 0
            query_start_loc[1 : n + 1] = np.cumsum(counts, dtype=np.int32)
            query_start_loc[n + 1 :] = total
            token_slots = np.repeat(slots, counts)
            offsets = np.repeat(query_start_loc[:n] - starts, counts)
            positions = np.arange(total, dtype=np.int32) - offsets
        pages, in_page = np.divmod(positions, self.block_size)
        slot_mapping = self.block_table[token_slots, pages] * self.block_size + in_page
        pending = self.num_pending[slots]
        num_tokens = self.num_tokens[slots] + pending
        # A chunk that reaches the last token yields the next one.
        sample_mask = kv_lens >= num_tokens
        if pending.any():
            # A position past the tokens known here holds a pending token: the device has
            # it as its slot's last sampled token.
            beyond = positions >= self.num_tokens[token_slots]
            from_slot = padded(np.where(beyond, token_slots, -1).astype(np.int32), T, -1)
        else:
            from_slot = self._no_device_inputs.get(T)
            if from_slot is None:
                from_slot = self._no_device_inputs[T] = np.full(T, -1, np.int32)
        prompt_logprob_rows, prompt_targets = {}, None
        if order.any_prompt_logprobs:
            prompt_targets = np.zeros(T, np.int32)
            prompt_logprob_rows = self._prompt_targets(
                req_ids, slots, starts, kv_lens, query_start_loc, prompt_targets
            )
        prepared = PreparedStep(
            shape=shape,
            req_ids=req_ids,
            input_ids=padded(self.token_ids[token_slots, positions], T),
            from_slot=from_slot,
            positions=padded(positions, T),
            slot_mapping=padded(slot_mapping, T),  # padding -> the null page
            query_start_loc=query_start_loc,
            kv_lens=padded(kv_lens, R),
            block_tables=padded(self.block_table[slots, :P], R),
            logits_indices=np.maximum(query_start_loc[1 : S + 1] - 1, 0).astype(np.int32),
            sampling=self._sampling_arrays(order, S, padded(sample_mask, S), num_tokens),
            num_logprobs=order.num_logprobs.copy(),
            prompt_logprob_rows=prompt_logprob_rows,
            prompt_targets=prompt_targets,
            num_steps=num_steps,
        )
        if spec:
            self._add_verification_rows(prepared, spec, order, query_start_loc)
        return prepared

    def _add_verification_rows(
        self, prepared: PreparedStep, spec: dict, order: "_Order", query_start_loc
    ) -> None:
        """Replace `prepared`'s sampling rows (one per request) by one per verified
        position, each sampled as a step without drafts would sample that output index."""
        req_ids, slots, n = prepared.req_ids, order.slots, len(order.slots)
        R = prepared.num_sample_rows
        num_drafts = np.array([len(spec.get(r, ())) for r in req_ids], np.int32)
        layout = verification_rows(num_drafts, query_start_loc[1 : n + 1] - 1)
        row_slots = slots[layout.row_request]
        arrays = neutral_sampling_arrays(R)
        rows = len(row_slots)
        arrays["slots"][:rows] = row_slots
        for name in _PARAM_COLUMNS:
            arrays[name][:rows] = self.params[name][row_slots]
        output_index = self.num_tokens[row_slots] - self.num_prompt_tokens[row_slots]
        output_index = output_index + layout.offset
        arrays["output_index"][:rows] = output_index
        if order.any_min_tokens:
            arrays["suppressed_ids"] = self._suppressed_ids(row_slots, output_index, R)
        arrays["sample_mask"][:rows] = prepared.sample_mask[:n][layout.row_request]
        prepared.logits_indices = padded(layout.logits_indices, R)
        prepared.sampling = arrays
        prepared.num_logprobs = [order.num_logprobs[i] for i in layout.row_request.tolist()]
        prepared.spec_drafts = [spec.get(r, []) for r in req_ids]

    def _prompt_targets(self, req_ids, slots, starts, kv_lens, query_start_loc, targets):
        """Fill `targets` for requests that want prompt logprobs; returns their rows."""
        rows = {}
        for i in np.flatnonzero(self.wants_prompt_logprobs[slots]).tolist():
            slot, start, begin = int(slots[i]), int(starts[i]), int(query_start_loc[i])
            # Position p predicts token p + 1, for prompt positions only.
            last = min(int(kv_lens[i]), int(self.num_prompt_tokens[slot]) - 1)
            num = max(last - start, 0)
            targets[begin : begin + num] = self.token_ids[slot, start + 1 : start + 1 + num]
            rows[req_ids[i]] = (begin, begin + num)
        return rows

    def _sampling_arrays(
        self, order: "_Order", R: int, sample_mask, num_tokens
    ) -> dict[str, np.ndarray]:
        slots, n = order.slots, len(order.slots)
        static = order.columns.get(R)
        if static is None:
            static = order.columns[R] = neutral_sampling_arrays(R)
            static["slots"][:n] = slots
            for name in _PARAM_COLUMNS:
                static[name][:n] = self.params[name][slots]
        arrays = dict(static)  # the request-only columns are shared, never written
        output_index = num_tokens - self.num_prompt_tokens[slots]
        arrays["output_index"] = padded(output_index, R)
        if order.any_min_tokens:
            arrays["suppressed_ids"] = self._suppressed_ids(slots, output_index, R)
        arrays["sample_mask"] = sample_mask
        return arrays

    def _suppressed_ids(self, slots: np.ndarray, output_index: np.ndarray, R: int) -> np.ndarray:
        """[R, MAX_SUPPRESSED_IDS] for rows sampling for `slots` at `output_index`: EOS and
        stop ids stay masked while the request is short of min_tokens."""
        suppressing = output_index < self.min_tokens[slots]
        suppressed = np.full((R, MAX_SUPPRESSED_IDS), -1, np.int32)
        suppressed[: len(slots)] = np.where(
            suppressing[:, None], self.params["suppressed_ids"][slots], -1
        )
        return suppressed


@dataclass(slots=True)
class _Order:
    """What steps that schedule the same requests in the same order share."""

    req_ids: list[str]
    slots: np.ndarray  # [n] slot of each request
    num_logprobs: list[int | None]
    any_prompt_logprobs: bool
    any_min_tokens: bool
    # R -> padded sampling columns; only the request-only ones are read from these.
    columns: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
