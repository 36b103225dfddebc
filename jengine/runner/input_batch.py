"""The persistent host batch: per-request state the runner keeps across steps, and the
translation of one SchedulerOutput into padded numpy arrays.

Where it sits: `ModelRunner.execute` calls `update` with each SchedulerOutput (drop
finished, add new, extend block tables), then `prepare` to get a `PreparedStep` of numpy
arrays in one of the shapes of `buckets.py`, then `record_sampled` with what came back.
It never touches jax; the runner moves the arrays to the device.

Promises:
- padding tokens write into the null page 0 and belong to no request; padding requests
  have q_len 0 and kv_len 0, so attention ignores them;
- a request's tokens are prompt + the tokens this runner sampled for it, so the scheduler
  only sends deltas (see jengine/core/sched_output.py);
- every request keeps one slot (row of the on-device sampling history) while it runs.

Axis letters: T tokens, R requests, P pages per request.
"""

import zlib
from dataclasses import dataclass, field

import numpy as np

from jengine.core.kv_cache_utils import cdiv
from jengine.core.sched_output import SchedulerOutput
from jengine.runner.buckets import BucketSpec, StepShape
from jengine.runner.sampler import MAX_SUPPRESSED_IDS
from jengine.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    slot: int
    seed: int
    suppressed_ids: list[int]  # EOS + stop ids, masked until min_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def uses_history(self) -> bool:
        p = self.sampling_params
        return bool(
            p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias
        )


@dataclass(slots=True)
class PreparedStep:
    """One step's padded inputs (numpy) and what the host needs to read its outputs."""

    shape: StepShape
    req_ids: list[str]
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [R + 1]
    kv_lens: np.ndarray  # [R]
    block_tables: np.ndarray  # [R, P]
    logits_indices: np.ndarray  # [R]
    sampling: dict[str, np.ndarray]  # SamplingMetadata fields
    num_logprobs: list[int | None]  # per request
    prompt_logprob_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    prompt_targets: np.ndarray | None = None  # [T] next prompt token per position

    @property
    def sample_mask(self) -> np.ndarray:
        """[R] bool: which requests yield a token this step."""
        return self.sampling["sample_mask"]


def neutral_sampling_arrays(num_reqs: int) -> dict[str, np.ndarray]:
    """SamplingMetadata fields for `num_reqs` rows that ask for nothing: greedy, no
    truncation, penalties or history, no token yielded. Padding rows keep these values."""
    R = num_reqs
    return dict(
        slots=np.zeros(R, np.int32),
        temperature=np.zeros(R, np.float32),
        top_k=np.zeros(R, np.int32),
        top_p=np.ones(R, np.float32),
        min_p=np.zeros(R, np.float32),
        seeds=np.zeros(R, np.uint32),
        output_index=np.zeros(R, np.int32),
        presence_penalty=np.zeros(R, np.float32),
        frequency_penalty=np.zeros(R, np.float32),
        repetition_penalty=np.ones(R, np.float32),
        use_history=np.zeros(R, bool),
        suppressed_ids=np.full((R, MAX_SUPPRESSED_IDS), -1, np.int32),
        sample_mask=np.zeros(R, bool),
    )


class InputBatch:
    def __init__(self, buckets: BucketSpec, block_size: int, seed: int = 0):
        self.buckets = buckets
        self.block_size = block_size
        self.seed = seed
        self.requests: dict[str, CachedRequestState] = {}
        self.free_slots = list(range(buckets.max_num_seqs - 1, -1, -1))

    # -- following the scheduler ---------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput) -> list[CachedRequestState]:
        """Apply the scheduler's deltas; returns the requests that just entered the batch."""
        for req_id in scheduler_output.removed_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.free_slots.append(state.slot)
        added = []
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            suppressed = [] if params.min_tokens == 0 else list(params.stop_token_ids or [])
            if params.min_tokens and new.eos_token_id is not None and not params.ignore_eos:
                suppressed.append(new.eos_token_id)
            state = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                slot=self.free_slots.pop(),
                seed=self._seed_for(new.req_id, params.seed),
                suppressed_ids=suppressed[:MAX_SUPPRESSED_IDS],
            )
            self.requests[new.req_id] = state
            added.append(state)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        return added

    def _seed_for(self, req_id: str, seed: int | None) -> int:
        # Unseeded requests get a seed derived from the engine seed and the request id, so
        # a run is reproducible and a preempted request resumes the same random stream.
        if seed is not None:
            return seed & 0xFFFFFFFF
        return (self.seed * 1_000_003 + zlib.crc32(req_id.encode())) & 0xFFFFFFFF

    def record_sampled(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        for req_id, tokens in zip(req_ids, sampled, strict=True):
            self.requests[req_id].token_ids.extend(tokens)

    # -- building the padded step --------------------------------------------------------

    def prepare(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        counts = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids], np.int32)
        starts = np.array([s.num_computed_tokens for s in states], np.int32)
        kv_lens = starts + counts
        max_pages = cdiv(int(kv_lens.max()), self.block_size)
        shape = self.buckets.shape_for(int(counts.sum()), len(req_ids), max_pages)
        T, R, P = shape.num_tokens, shape.num_reqs, shape.num_pages

        input_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slot_mapping = np.zeros(T, np.int32)  # padding -> the null page
        block_tables = np.zeros((R, P), np.int32)
        query_start_loc = np.zeros(R + 1, np.int32)
        query_start_loc[1 : len(req_ids) + 1] = np.cumsum(counts)
        query_start_loc[len(req_ids) + 1 :] = query_start_loc[len(req_ids)]
        padded_kv_lens = np.zeros(R, np.int32)
        padded_kv_lens[: len(req_ids)] = kv_lens
        sample_mask = np.zeros(R, bool)
        prompt_logprob_rows = {}
        want_prompt_logprobs = any(s.sampling_params.prompt_logprobs is not None for s in states)
        prompt_targets = np.zeros(T, np.int32) if want_prompt_logprobs else None

        for i, state in enumerate(states):
            begin, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
            pos = np.arange(starts[i], kv_lens[i], dtype=np.int32)
            tokens = state.token_ids
            input_ids[begin:end] = tokens[starts[i] : kv_lens[i]]
            positions[begin:end] = pos
            blocks = np.asarray(state.block_ids, np.int32)
            slot_mapping[begin:end] = blocks[pos // self.block_size] * self.block_size + (
                pos % self.block_size
            )
            block_tables[i, : min(len(blocks), P)] = blocks[:P]
            # A chunk that reaches the last known token yields the next one.
            sample_mask[i] = kv_lens[i] >= len(tokens)
            if prompt_targets is not None and state.sampling_params.prompt_logprobs is not None:
                # Position p predicts token p + 1, for prompt positions only.
                last = min(int(kv_lens[i]), state.num_prompt_tokens - 1)
                if last > starts[i]:
                    n = last - int(starts[i])
                    prompt_targets[begin : begin + n] = tokens[starts[i] + 1 : last + 1]
                    prompt_logprob_rows[state.req_id] = (begin, begin + n)
                else:
                    prompt_logprob_rows[state.req_id] = (begin, begin)

        logits_indices = np.maximum(query_start_loc[1:] - 1, 0).astype(np.int32)
        return PreparedStep(
            shape=shape,
            req_ids=req_ids,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            kv_lens=padded_kv_lens,
            block_tables=block_tables,
            logits_indices=logits_indices,
            sampling=self._sampling_arrays(states, R, sample_mask),
            num_logprobs=[s.sampling_params.logprobs for s in states],
            prompt_logprob_rows=prompt_logprob_rows,
            prompt_targets=prompt_targets,
        )

    def _sampling_arrays(self, states, R, sample_mask) -> dict[str, np.ndarray]:
        arrays = neutral_sampling_arrays(R)
        n = len(states)
        params = [s.sampling_params for s in states]
        columns = dict(
            slots=[s.slot for s in states],
            temperature=[p.temperature for p in params],
            top_k=[max(p.top_k, 0) for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            seeds=[s.seed for s in states],
            output_index=[s.num_output_tokens for s in states],
            presence_penalty=[p.presence_penalty for p in params],
            frequency_penalty=[p.frequency_penalty for p in params],
            repetition_penalty=[p.repetition_penalty for p in params],
            use_history=[s.uses_history for s in states],
        )
        for name, values in columns.items():
            arrays[name][:n] = values
        for i, s in enumerate(states):
            if s.suppressed_ids and s.num_output_tokens < s.sampling_params.min_tokens:
                arrays["suppressed_ids"][i, : len(s.suppressed_ids)] = s.suppressed_ids
        arrays["sample_mask"] = sample_mask
        return arrays
