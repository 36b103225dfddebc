"""What the persistent batch hands the step: one step's padded numpy inputs
(`PreparedStep`), and the sampling arrays of rows that ask for nothing.

Where it sits: `InputBatch.prepare` builds a `PreparedStep`; `step.ForwardInputs`,
`grammar_mask`, the draft model and `step_outputs` read it. It holds numpy arrays only and
imports nothing of the runner but the bucket shape.

Axis letters: T tokens, R requests, P pages per request, S sampling rows (S <= R, their
own bucket: `BucketSpec.sample_rows`).
"""

from dataclasses import dataclass, field

import numpy as np

from jengine.runner.buckets import StepShape
from jengine.sampling_params import MAX_SUPPRESSED_IDS


@dataclass(slots=True)
class PreparedStep:
    """One step's padded inputs (numpy) and what the host needs to read its outputs."""

    shape: StepShape
    req_ids: list[str]
    input_ids: np.ndarray  # [T]
    # [T] slot whose last sampled token (on the device) is the input instead, -1: none
    # (async scheduling: the token sampled by the step before has not reached the host).
    from_slot: np.ndarray
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [R + 1]
    kv_lens: np.ndarray  # [R]
    block_tables: np.ndarray  # [R, P]
    logits_indices: np.ndarray  # [S] the token each sampling row reads
    sampling: dict[str, np.ndarray]  # SamplingMetadata fields, [S] rows
    num_logprobs: list[int | None]  # per request
    prompt_logprob_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    prompt_targets: np.ndarray | None = None  # [T] next prompt token per position
    # [S, ceil(V / 32)] packed allowed-token bits, every bit set on unconstrained rows
    # (None: no request in the step is constrained).
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: each request's drafts; then the sampling rows (logits_indices,
    # sampling, num_logprobs) are one per verified position, a request's rows in a run.
    spec_drafts: list[list[int]] | None = None
    # [T] each token's LoRA slot (0: the base model); None in an engine without LoRA.
    lora_slots: np.ndarray | None = None
    # Multi-step decoding: decode steps the one program runs, each request sampling one
    # token per step (`SchedulerOutput.num_decode_steps`; its block tables reach them all).
    num_steps: int = 1

    @property
    def sample_mask(self) -> np.ndarray:
        """[S] bool: which sampling rows yield a token this step."""
        return self.sampling["sample_mask"]

    @property
    def num_sample_rows(self) -> int:
        """S, the padded number of sampling rows."""
        return len(self.logits_indices)

    @classmethod
    def padding(cls, shape: StepShape, lora: bool = False, num_steps: int = 1) -> "PreparedStep":
        """A step of `shape` with no request in it (warmup runs these): every token writes
        the null page, every row samples nothing. `lora`: as an engine serving LoRA runs
        it (every token on slot 0); `num_steps`: as a multi-step decode."""
        T, R, P = shape.num_tokens, shape.num_reqs, shape.num_pages
        zeros_t = np.zeros(T, np.int32)
        return cls(
            shape=shape,
            req_ids=[],
            input_ids=zeros_t,
            from_slot=np.full(T, -1, np.int32),
            positions=zeros_t,
            slot_mapping=zeros_t,
            query_start_loc=np.zeros(R + 1, np.int32),
            kv_lens=np.zeros(R, np.int32),
            block_tables=np.zeros((R, P), np.int32),
            logits_indices=np.zeros(R, np.int32),
            sampling=neutral_sampling_arrays(R),
            num_logprobs=[],
            lora_slots=np.zeros(T, np.int32) if lora else None,
            num_steps=num_steps,
        )

    @classmethod
    def warmup_steps(cls, shapes, lora: bool, num_decode_steps: int) -> list["PreparedStep"]:
        """The padding steps warmup runs: one per shape, and with `num_decode_steps` > 1
        one multi-step decode per decode shape too."""
        steps = [cls.padding(shape, lora) for shape in shapes]
        if num_decode_steps > 1:
            steps += [cls.padding(s, lora, num_decode_steps) for s in shapes if s.is_decode]
        return steps


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


def padded(values: np.ndarray, rows: int, fill: int = 0) -> np.ndarray:
    """`values` with `fill` rows appended up to `rows` (itself when it has them already:
    the arrays of a step are never written once built)."""
    if len(values) == rows:
        return values
    out = np.full((rows, *values.shape[1:]), fill, values.dtype)
    out[: len(values)] = values
    return out
