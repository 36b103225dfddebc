"""Test helpers for the host-side core: build requests and schedulers, and play the runner.

``StubRunner`` follows the scheduler exactly as a real model runner must: it keeps its own
per-request state, built only from ``SchedulerOutput`` (never from a ``Request``), and
"samples" a token that is a deterministic function of the request's tokens so far. It also
simulates the paged KV cache: every scheduled token is written to its slot, then every
request's whole context is read back through its block table and compared with its
tokens. A wrong block table, a bad prefix hit, a block handed to two requests, or a write
to the null block all show up as a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jengine.config import CacheConfig, SchedulerConfig
from jengine.core import LogprobsArrays, ModelRunnerOutput, Scheduler, SchedulerOutput
from jengine.protocol import EngineCoreOutputs, FinishReason
from jengine.request import Request
from jengine.sampling_params import SamplingParams

VOCAB = 1000
EOS = 2


def next_token(tokens: list[int]) -> int:
    """Deterministic 'model': a function of the whole context, never EOS by accident."""
    acc = 0
    for i, t in enumerate(tokens):
        acc = (acc * 31 + t * (i + 7)) % 1_000_003
    return 10 + acc % (VOCAB - 10)


def make_request(
    req_id: str,
    prompt: list[int] | int,
    *,
    eos_token_id: int | None = EOS,
    priority: int = 0,
    arrival_time: float | None = None,
    **params,
) -> Request:
    if isinstance(prompt, int):  # a length: a prompt unique to this id
        base = sum(map(ord, req_id)) * 7
        prompt = [10 + (base + 13 * i) % (VOCAB - 10) for i in range(prompt)]
    params.setdefault("max_tokens", 8)
    return Request(
        req_id,
        prompt,
        SamplingParams(**params),
        eos_token_id=eos_token_id,
        arrival_time=arrival_time if arrival_time is not None else float(sum(map(ord, req_id))),
        priority=priority,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    long_prefill_token_threshold: int = 0,
    num_scheduler_steps: int = 1,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=policy,
            long_prefill_token_threshold=long_prefill_token_threshold,
            num_scheduler_steps=num_scheduler_steps,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks=num_blocks,
    )


@dataclass
class _RunnerState:
    tokens: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams


class StubRunner:
    def __init__(
        self,
        scheduler: Scheduler,
        sample: Callable[[str, list[int]], int] | None = None,
    ) -> None:
        self.block_size = scheduler.cache_config.block_size
        self.max_model_len = scheduler.max_model_len
        # kv[block, offset] = the token id whose K/V sits in that slot; -1 = never written.
        self.kv = np.full((scheduler.kv_cache_manager.num_blocks, self.block_size), -1, np.int64)
        self.sample = sample or (lambda req_id, tokens: next_token(tokens))
        self.reqs: dict[str, _RunnerState] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for req_id in so.removed_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, "new request the runner still holds"
            self.reqs[new.req_id] = _RunnerState(
                tokens=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                params=new.sampling_params,
            )
        for cached in so.scheduled_cached_reqs:
            st = self.reqs[cached.req_id]
            assert st.num_computed_tokens == cached.num_computed_tokens
            st.block_ids.extend(cached.new_block_ids)
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens

        # Write every scheduled token's K/V first, then read (as attention does per layer).
        spans = {}
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            assert n > 0 and end <= len(st.tokens) and end <= self.max_model_len
            assert len(st.block_ids) * bs >= end, "block table too short"
            assert 0 not in st.block_ids, "null block in a block table"
            assert len(st.block_ids) <= -(-self.max_model_len // bs)
            for p in range(start, end):
                self.kv[st.block_ids[p // bs], p % bs] = st.tokens[p]
            spans[req_id] = (start, end)
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            st = self.reqs[req_id]
            start, end = spans[req_id]
            context = self.kv[st.block_ids].reshape(-1)[:end]
            np.testing.assert_array_equal(context, st.tokens[:end], err_msg=f"KV of {req_id}")
            st.num_computed_tokens = end
            if end == len(st.tokens):
                token = self.sample(req_id, st.tokens)
                st.tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])

        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=self._logprobs(req_ids, sampled),
            prompt_logprobs_dict=self._prompt_logprobs(req_ids, spans),
        )

    def _logprobs(self, req_ids, sampled) -> LogprobsArrays | None:
        ks = [self.reqs[r].params.logprobs for r in req_ids if self.reqs[r].params.logprobs]
        if not ks:
            return None
        k = max(ks)
        tokens = np.array([t for s in sampled for t in s], np.int32)
        cols = np.arange(k + 1, dtype=np.int32)
        return LogprobsArrays(
            logprob_token_ids=(tokens[:, None] + cols[None, :]).astype(np.int32),
            logprobs=np.broadcast_to(-0.5 * cols, (len(tokens), k + 1)).astype(np.float32),
            sampled_token_ranks=np.ones(len(tokens), np.int32),
        )

    def _prompt_logprobs(self, req_ids, spans) -> dict[str, LogprobsArrays | None]:
        out = {}
        for req_id in req_ids:
            st = self.reqs[req_id]
            if st.params.prompt_logprobs is None:
                continue
            start, end = spans[req_id]
            positions = np.arange(start, min(end, st.num_prompt_tokens))
            k = st.params.prompt_logprobs
            ids = np.array([st.tokens[p] for p in positions], np.int32)
            out[req_id] = LogprobsArrays(
                logprob_token_ids=np.repeat(ids[:, None], k + 1, axis=1),
                logprobs=np.zeros((len(ids), k + 1), np.float32),
                sampled_token_ranks=positions.astype(np.int32),
            )
        return out


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


def check_step_invariants(scheduler: Scheduler, so: SchedulerOutput) -> None:
    cfg = scheduler.config
    assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
    assert len(scheduler.running) <= cfg.max_num_seqs
    if scheduler.running or len(scheduler.waiting):  # (not: grammars still compiling)
        assert so.total_num_scheduled_tokens > 0, "no progress with requests pending"
    for r in scheduler.running:
        assert r.num_computed_tokens <= min(r.num_tokens, cfg.max_model_len)


def collect(outputs: EngineCoreOutputs, results: dict[str, Result]) -> None:
    for out in outputs.outputs:
        res = results.setdefault(out.request_id, Result())
        assert res.finish_reason is None, "output after finish"
        res.token_ids.extend(out.new_token_ids)
        res.finish_reason = out.finish_reason
        res.stop_reason = out.stop_reason
        res.num_cached_tokens = out.num_cached_tokens


def step(scheduler: Scheduler, runner: StubRunner, results: dict[str, Result]) -> SchedulerOutput:
    so = scheduler.schedule()
    check_step_invariants(scheduler, so)
    collect(scheduler.update_from_output(so, runner.execute(so)), results)
    return so


def run_to_completion(
    scheduler: Scheduler,
    runner: StubRunner,
    results: dict[str, Result] | None = None,
    max_steps: int = 10_000,
) -> dict[str, Result]:
    results = {} if results is None else results
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return results
        step(scheduler, runner, results)
    raise AssertionError("requests did not finish")


def reference_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """What an unbatched, unpreempted run of the stub model generates (no stop tokens)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def assert_no_leak(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert not scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert not kv.req_to_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
