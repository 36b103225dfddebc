"""Scheduler: decides, each step, which tokens of which requests run, and records results.

Where it sits: ``EngineCore.step()`` is ``schedule() -> runner.dispatch() / collect() ->
update_from_output()`` (with async scheduling the next ``schedule()`` comes before the
last ``update_from_output()``). ``schedule()`` returns a ``SchedulerOutput``; the runner answers
with a ``ModelRunnerOutput``; ``update_from_output()`` appends the sampled tokens, checks
stop conditions, frees finished requests and returns the ``EngineCoreOutputs`` for the
front end (that half lives in ``step_results.py``, a mixin of ``Scheduler``; preemption in
``preemption.py``, another). It owns the ``KVCacheManager`` and every live ``Request``.

What it promises (vLLM V1 rules):
- No prefill or decode phase. Each step hands out one budget of
  ``max_num_batched_tokens`` tokens so every request's ``num_computed_tokens`` catches up
  with its ``num_tokens``: chunked prefill, prefix hits, resumed requests and decodes are
  the same subtraction. Running requests are served first, then waiting ones.
- At most ``max_num_seqs`` requests run; ``num_computed_tokens`` <= ``max_model_len``. When
  the pool runs dry for a running request, another is preempted by recompute
  (``preemption.py``); no new request is admitted in a step that preempted.
- ``num_computed_tokens`` is advanced when a step is scheduled, so the next ``schedule``
  can run before the previous results arrive (async scheduling): a request that will
  sample counts a placeholder (``num_output_placeholders``) for its token still on the
  way, and decodes it next step from the device. A request whose next step needs that
  token on the host first, or that would run past max_tokens, waits a step instead:
  constrained requests (their grammar advances on the token) and draft-verifying ones.
- A request with structured outputs waits (``WAITING_FOR_GRAMMAR``) until its grammar has
  compiled, holding up nothing else; each step carries the bitmask rows of the
  constrained requests it samples (``core/structured_output.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from jengine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jengine.core.kv_cache_manager import KVCacheManager
from jengine.core.multi_step import MultiStep
from jengine.core.ngram_proposer import NgramProposer
from jengine.core.preemption import Preemption
from jengine.core.request_queue import WaitingQueue
from jengine.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jengine.core.step_results import StepResults
from jengine.core.structured_output import StructuredOutputManager
from jengine.request import Request, RequestStatus


@dataclass(slots=True)
class _StepPlan:
    """What `schedule()` has decided so far in one step."""

    budget: int  # tokens still to hand out
    num_scheduled: dict[str, int] = field(default_factory=dict)
    # Scheduled running requests, in order (their computed counters already advanced).
    cached: dict[str, CachedRequestData] = field(default_factory=dict)
    new: list[Request] = field(default_factory=list)  # requests started this step
    preempted: list[Request] = field(default_factory=list)
    spec: dict[str, list[int]] = field(default_factory=dict)  # drafts scheduled to verify
    num_drafts: int = 0  # draft tokens scheduled (each one a sampling row)
    # Slots allocated past each request's scheduled tokens for the draft model's decode
    # steps after this step (0: no draft model, or speculation off at this batch size).
    lookahead: int = 0
    num_decode_steps: int = 1  # multi-step decoding (`multi_step.py`)


class Scheduler(StepResults, Preemption, MultiStep):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        log_stats: bool = True,
        structured_output_manager: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        max_loras: int = 0,
    ) -> None:
        self.config = scheduler_config
        # LoRA: at most this many distinct adapters among running requests, so in a step
        # (the runner's slots; 0: LoRA off).
        self.max_loras = max_loras
        self.structured_output_manager = structured_output_manager
        self.speculative_config = speculative_config
        self.proposer = None
        if speculative_config is not None and speculative_config.method == "ngram":
            self.proposer = NgramProposer(
                speculative_config.prompt_lookup_min,
                speculative_config.prompt_lookup_max,
                speculative_config.num_speculative_tokens,
            )
        # Speculative decoding counts since the last make_stats().
        self._spec_counts = [0, 0, 0]  # drafts, draft tokens, accepted tokens
        self.cache_config = cache_config
        self.max_model_len = scheduler_config.max_model_len
        self.log_stats = log_stats
        # A request may grow to max_model_len tokens while running alone; if the pool cannot
        # hold that, it would preempt itself forever. Refuse to start instead.
        usable_tokens = (num_blocks - 1) * cache_config.block_size
        if usable_tokens < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {usable_tokens} tokens ({num_blocks - 1} blocks of "
                f"{cache_config.block_size}), fewer than max_model_len={self.max_model_len}; "
                "give it more memory or lower max_model_len"
            )
        self.kv_cache_manager = KVCacheManager(
            block_size=cache_config.block_size,
            num_blocks=num_blocks,
            max_model_len=self.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(scheduler_config.policy)
        self.running: list[Request] = []
        # Constrained requests whose grammar still compiles (they join `waiting` when it
        # is ready), every live constrained request, and those whose grammar failed (to
        # report with the next outputs).
        self.waiting_for_grammar: dict[str, Request] = {}
        self.constrained_ids: set[str] = set()
        self._grammar_failed: list[Request] = []
        # Ids whose runner state must go, reported with the next SchedulerOutput.
        self.removed_req_ids: set[str] = set()
        self._num_preemptions = 0  # since the last make_stats()
        self.num_requests_received = 0  # since start

    # -- requests in and out ----------------------------------------------------------

    def check_request(self, request: Request) -> None:
        """A ValueError if `add_request` would refuse `request`."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not 0 < request.num_prompt_tokens <= self.max_model_len:
            raise ValueError(
                f"prompt of request {request.request_id!r} has {request.num_prompt_tokens} "
                f"tokens; it must have between 1 and max_model_len={self.max_model_len}"
            )
        if request.sampling_params.masks_tokens and self.structured_output_manager is None:
            raise ValueError("this engine does not take structured outputs")

    def add_request(self, request: Request) -> None:
        self.num_requests_received += 1
        self.check_request(request)
        request.arrival_number = self.num_requests_received
        self.requests[request.request_id] = request
        if not request.sampling_params.masks_tokens:
            self.waiting.add(request)
            return
        self.structured_output_manager.add_request(request)
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.waiting_for_grammar[request.request_id] = request
        self.constrained_ids.add(request.request_id)

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> None:
        """End requests from outside (client abort); unknown or finished ids are ignored."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                del self.waiting_for_grammar[req_id]
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.removed_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        if request.structured_output is not None:
            self.constrained_ids.discard(request.request_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_grammar)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or failed ones still to report (by the next update)."""
        return self.get_num_unfinished_requests() > 0 or bool(self._grammar_failed)

    # -- schedule ---------------------------------------------------------------------

    def _num_new_tokens(self, request: Request, budget: int, num_computed: int) -> int:
        n = request.num_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        return max(0, min(n, budget, self.max_model_len - num_computed))

    def _admit_compiled_grammars(self) -> None:
        """Requests whose grammar is ready join the waiting queue; failed ones end."""
        idle = not self.running and not len(self.waiting)
        ready, failed = self.structured_output_manager.take_compiled(self.waiting_for_grammar, idle)
        for request in ready:
            request.status = RequestStatus.WAITING
            self.waiting.add(request)
        for request, error in failed:
            request.fail(error)
            self._free_request(request)
            self._grammar_failed.append(request)

    def schedule(self) -> SchedulerOutput:
        if self.waiting_for_grammar:
            self._admit_compiled_grammars()
        step = _StepPlan(
            budget=self.config.max_num_batched_tokens,
            lookahead=self._num_lookahead_tokens(),
            num_decode_steps=self._num_decode_steps(),
        )
        self._schedule_running(step)
        # Waiting requests start only if memory was not just too tight for running ones.
        if not step.preempted:
            self._schedule_waiting(step)
        return self._make_scheduler_output(step)

    def _num_lookahead_tokens(self) -> int:
        """k when the runner drafts with a draft model after this step, else 0."""
        config = self.speculative_config
        if config is None or config.method != "draft_model" or not self.speculating():
            return 0
        return config.num_speculative_tokens

    def _schedule_running(self, step: _StepPlan) -> None:
        """Running requests, in order, until the budget is spent; preempt when blocks run
        out. Runs once per running request per step, so the common case is kept inline."""
        kv_cache_manager = self.kv_cache_manager
        no_op_limit = kv_cache_manager.no_op_limit
        threshold = self.config.long_prefill_token_threshold
        max_model_len = self.max_model_len
        running, num_scheduled, cached = self.running, step.num_scheduled, step.cached
        budget = step.budget
        # Each draft is one more sampling row; rows never exceed max_num_seqs, and drafts
        # take only rows no waiting request could start in: speculation never holds back
        # admission.
        spec_rows = max(0, self.config.max_num_seqs - len(running) - len(self.waiting))
        # A multi-step decode runs K - 1 tokens past each request's one scheduled token.
        extra = step.num_decode_steps - 1
        lookahead = step.lookahead + extra
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            req_id = request.request_id
            num_computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            if placeholders and not self._may_run_ahead(request):
                i += 1
                continue
            # As _num_new_tokens.
            n = len(request.all_token_ids) + placeholders - num_computed
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            if n > max_model_len - num_computed:
                n = max_model_len - num_computed
            if n <= 0:
                i += 1
                continue
            spec = request.spec_token_ids
            if spec and n == 1:  # decoding: verify the drafts in the same query block
                spec = spec[: min(budget - 1, max_model_len - num_computed - 1, spec_rows)]
                n += len(spec)
            if num_computed + n + lookahead <= no_op_limit.get(req_id, 0):
                new_block_ids = []  # allocate_slots would change nothing
            else:
                blocks = kv_cache_manager.allocate_slots(request, n, num_lookahead_tokens=lookahead)
                if blocks is None:
                    step.budget = budget
                    blocks, i = self._preempt_for(request, n, i, step)
                    budget = step.budget
                    if blocks is None:
                        # The request preempted itself. Under FCFS it was the last one;
                        # under the priority policy the next one (now at index i) may fit.
                        continue
                new_block_ids = [b.block_id for b in blocks]
            num_scheduled[req_id] = n
            cached[req_id] = CachedRequestData(req_id, new_block_ids, num_computed)
            request.num_computed_tokens = num_computed + n + extra
            if num_computed + n >= len(request.all_token_ids) + placeholders:
                request.num_output_placeholders = placeholders + 1 + extra  # it samples
            budget -= n
            if spec and n > 1:
                step.spec[req_id] = spec
                spec_rows -= len(spec)
            i += 1
        step.budget = budget
        step.num_drafts = sum(map(len, step.spec.values()))

    @staticmethod
    def _may_run_ahead(request: Request) -> bool:
        """Whether a request whose last token is still on the way may be scheduled now:
        not if the token must reach the host first (a grammar advances on it, drafts are
        proposed from it) or if the request may not sample any further."""
        max_tokens = request.sampling_params.max_tokens
        return (
            request.structured_output is None
            and not request.spec_token_ids
            and (
                max_tokens is None
                or len(request.output_token_ids) + request.num_output_placeholders < max_tokens
            )
        )

    def _schedule_waiting(self, step: _StepPlan) -> None:
        """Waiting requests from the head of the queue while budget, blocks and
        max_num_seqs allow; a prefix-cache hit starts a request past its cached blocks.
        A request whose LoRA adapter would be one more than `max_loras` among the running
        ones is passed over (it keeps its place) for those behind it."""
        loras = {r.lora_id for r in self.running} - {0} if self.max_loras else set()
        passed_over: list[Request] = []
        while (
            len(self.waiting) > 0
            and step.budget > 0
            and len(self.running) + step.num_drafts < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            lora_id = request.lora_id
            if lora_id and lora_id not in loras and len(loras) >= self.max_loras:
                passed_over.append(self.waiting.pop())
                continue
            hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            n = self._num_new_tokens(request, step.budget, num_hit)
            if n == 0:
                break
            if (
                self.kv_cache_manager.allocate_slots(
                    request, n, hit_blocks, num_hit, num_lookahead_tokens=step.lookahead
                )
                is None
            ):
                break  # head-of-line: later requests wait too, preserving the policy order
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.kv_cache_manager.record_prefix_lookup(request, num_hit)
            step.new.append(request)
            step.num_scheduled[request.request_id] = n
            step.budget -= n
            if lora_id:
                loras.add(lora_id)
        for request in reversed(passed_over):  # back at the front, in their order
            self.waiting.add_preempted(request)

    def _make_scheduler_output(self, step: _StepPlan) -> SchedulerOutput:
        """Describe the step, then advance the new requests' computed counters past it
        (running requests were advanced as they were scheduled)."""
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                output_token_ids=list(r.output_token_ids),
                eos_token_id=r.eos_token_id,
                lora_request=r.lora_request,
                arrival_number=r.arrival_number,
            )
            for r in step.new
        ]
        for r in step.new:
            r.num_computed_tokens += step.num_scheduled[r.request_id]
            if r.num_computed_tokens >= r.num_tokens:
                r.num_output_placeholders = 1  # it samples

        removed = self.removed_req_ids
        removed.update(r.request_id for r in step.preempted)
        self.removed_req_ids = set()
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=list(step.cached.values()),
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.budget,
            removed_req_ids=removed,
            scheduled_spec_decode_tokens=step.spec,
            num_lookahead_tokens=step.lookahead,
            num_decode_steps=step.num_decode_steps,
        )
        if self.constrained_ids:
            self._add_grammar_bitmask(output)
        return output

    def _add_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """The bitmask rows of the constrained requests that sample in this step (their
        scheduled tokens reach their last known token)."""
        constrained = [
            request
            for req_id in output.num_scheduled_tokens
            if req_id in self.constrained_ids
            and (request := self.requests[req_id]).num_computed_tokens >= request.num_tokens
        ]
        if constrained:
            output.structured_output_request_ids = [r.request_id for r in constrained]
            output.grammar_bitmask = self.structured_output_manager.fill_bitmask(constrained)
