"""Preemption by recompute: which running request gives its blocks back, and how.

Where it sits: a mixin of `Scheduler` (jengine/core/scheduler.py), whose state it uses
(running, waiting, the KV cache manager). `_schedule_running` calls `_preempt_for` when
the pool cannot hold a running request's next tokens.

What it promises (vLLM V1's rules): the victim is the latest running request (FCFS) or
the lowest-priority, latest-arriving one (priority policy); a preempted request frees
every block, forgets its computed tokens, drafts and any token still on the way, and
re-enters the front of the waiting queue, so its eventual output is what it would have
been without preemption.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jengine.request import Request, RequestStatus

if TYPE_CHECKING:
    from jengine.core.scheduler import _StepPlan


class Preemption:
    """Mixin of `Scheduler`: its state is the scheduler's."""

    def _pop_victim(self) -> tuple[Request, int]:
        """Remove the request to preempt from ``running``; return it and its old index."""
        if self.config.policy == "priority":
            idx = max(
                range(len(self.running)),
                key=lambda i: (self.running[i].priority, self.running[i].arrival_time),
            )
        else:
            idx = len(self.running) - 1
        return self.running.pop(idx), idx

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token still on the way is dropped
        request.num_prompt_logprobs_computed = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.add_preempted(request)

    def _preempt_for(self, request: Request, n: int, i: int, step: _StepPlan):
        """Preempt running requests until ``request`` (at index i) gets room for n tokens.
        Returns its new blocks (None if it preempted itself) and its index afterwards."""
        blocks = None
        while blocks is None:
            victim, idx = self._pop_victim()
            if idx < i:
                i -= 1
            if step.cached.pop(victim.request_id, None) is not None:
                # Priority policy may pick a request already scheduled this step: undo.
                step.budget += step.num_scheduled.pop(victim.request_id)
                step.spec.pop(victim.request_id, None)
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                break
            blocks = self.kv_cache_manager.allocate_slots(
                request, n, num_lookahead_tokens=step.lookahead
            )
        return blocks, i
