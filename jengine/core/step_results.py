"""The scheduler's second half: taking in what a step sampled.

Where it sits: `Scheduler` (jengine/core/scheduler.py) plans each step and inherits this;
`EngineCore.step` calls `update_from_output(scheduler_output, runner_output)` after the
runner ran the step. It appends each request's sampled tokens, checks stop conditions
(length, EOS, stop tokens, a complete grammar), takes back the positions of rejected
drafts, frees finished requests, proposes the next drafts and returns the
`EngineCoreOutputs` for the front end, with the `SchedulerStats` of the step.
"""

from __future__ import annotations

import time

from jengine.core.outputs import ModelRunnerOutput
from jengine.core.sched_output import SchedulerOutput
from jengine.core.structured_output import StructuredOutputError
from jengine.protocol import EngineCoreOutput, EngineCoreOutputs, LogprobsLists, SchedulerStats
from jengine.request import Request, RequestStatus


def draft_room(request: Request, max_model_len: int) -> int:
    """How many drafts a request may verify next step: 0 while it prefills, and for
    requests whose exact verification would need the sampler's history (penalties) or
    grammar state past the last real token; else what fits before its length limits."""
    params = request.sampling_params
    if (
        request.num_computed_tokens < request.num_tokens - 1
        or params.uses_history
        or request.structured_output is not None
    ):
        return 0
    room = max_model_len - request.num_tokens - 1
    if params.max_tokens is not None:
        room = min(room, params.max_tokens - request.num_output_tokens - 1)
    return room


def _unsent_prompt_rows(request: Request, rows: LogprobsLists) -> LogprobsLists | None:
    """The prompt-logprob rows of a chunk the front end has not had yet. Requests that
    want prompt logprobs take no prefix hits, so their chunks cover the prompt in order
    from position 0, again after a preemption."""
    computed = request.num_prompt_logprobs_computed
    skip = request.num_prompt_logprobs_sent - computed
    request.num_prompt_logprobs_computed = computed + len(rows.ranks)
    if skip <= 0:
        request.num_prompt_logprobs_sent += len(rows.ranks)
        return rows
    if skip >= len(rows.ranks):
        return None
    request.num_prompt_logprobs_sent += len(rows.ranks) - skip
    return LogprobsLists(rows.token_ids[skip:], rows.logprobs[skip:], rows.ranks[skip:])


class StepResults:
    """Mixin of `Scheduler`: its state (requests, running, the KV cache manager, ...)
    is the scheduler's."""

    # -- results ----------------------------------------------------------------------

    def _check_stop(self, request: Request, last: int) -> bool:
        """Set the finished status if the last appended token (``last``) ends the
        request."""
        params = request.sampling_params
        grammar_complete = False
        if request.structured_output is not None:
            # Every emitted token advances the grammar, first of all (min_tokens or not).
            try:
                grammar_complete = self.structured_output_manager.accept(request, last)
            except StructuredOutputError as e:
                request.fail(str(e))
                return True
        num_output = len(request.output_token_ids)
        max_tokens = params.max_tokens
        if len(request.all_token_ids) >= self.max_model_len or (
            max_tokens is not None and num_output >= max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if grammar_complete:
            # Nothing but EOS may follow, and min_tokens holds EOS back: no token could
            # come next, so the request ends here whatever min_tokens said.
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if num_output < params.min_tokens:
            return False
        if not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
        return False

    def _append_sampled(self, request: Request, sampled: list[int]) -> list[int]:
        """Append sampled tokens up to the first that stops the request; returns those
        appended (``sampled`` itself when all were)."""
        for i, token_id in enumerate(sampled):
            request.output_token_ids.append(token_id)
            request.all_token_ids.append(token_id)
            if self._check_stop(request, token_id):
                return sampled[: i + 1]
        return sampled

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        any_logprobs = runner_output.logprobs is not None or bool(
            runner_output.prompt_logprobs_dict
        )
        row_start = runner_output.logprob_row_starts()
        requests = self.requests
        index = runner_output.req_id_to_index
        sampled_token_ids = runner_output.sampled_token_ids
        outputs: list[EngineCoreOutput] = []
        any_stopped = False
        running = RequestStatus.RUNNING
        spec = scheduler_output.scheduled_spec_decode_tokens
        num_decode_steps = scheduler_output.num_decode_steps
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            # Aborted (or preempted) while the step ran: its results are void.
            if request is None or request.status != running:
                continue
            sampled = sampled_token_ids[index[req_id]]
            if sampled:
                request.num_output_placeholders -= num_decode_steps
            if spec and req_id in spec:
                # The accepted drafts and one more token came back; the rejected drafts'
                # slots are computed again (and overwritten) from the next step on.
                num_drafts = len(spec[req_id])
                request.num_computed_tokens -= num_drafts + 1 - len(sampled)
                counts = self._spec_counts
                counts[0] += 1
                counts[1] += num_drafts
                counts[2] += len(sampled) - 1
            if len(sampled) == 1:  # the common case, inline
                token_id = sampled[0]
                request.output_token_ids.append(token_id)
                request.all_token_ids.append(token_id)
                stopped = self._check_stop(request, token_id)
                new_token_ids = sampled  # no copy: nothing writes to the runner's lists
            elif sampled or any_logprobs:
                new_token_ids = self._append_sampled(request, sampled)
                stopped = request.status != running
            else:
                continue  # a prefill chunk that ended mid-prompt: nothing to report

            new_logprobs = new_prompt_logprobs = None
            if any_logprobs:
                new_logprobs, new_prompt_logprobs = runner_output.logprobs_lists(
                    req_id, len(new_token_ids), row_start, request.sampling_params
                )
                if new_prompt_logprobs is not None:
                    new_prompt_logprobs = _unsent_prompt_rows(request, new_prompt_logprobs)
            pooled = None
            if stopped:
                any_stopped = True
                self._free_request(request)
                # An embedding request ends with its prompt: the vector instead of a token.
                pooled = runner_output.pooler_output.get(req_id)
                if pooled is not None:
                    new_token_ids = []
                    request.status = RequestStatus.FINISHED_STOPPED  # done, not cut short
            if new_token_ids or stopped or new_prompt_logprobs is not None:
                # Its first tokens and its end carry when it arrived and was first scheduled.
                first = stopped or len(request.output_token_ids) == len(new_token_ids)
                outputs.append(
                    EngineCoreOutput(
                        req_id,
                        new_token_ids,
                        new_logprobs,
                        new_prompt_logprobs,
                        request.get_finished_reason() if stopped else None,
                        request.stop_reason,
                        request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
                        request.error,
                        pooled,
                        request.queued_time if first else 0.0,
                        request.scheduled_time if first else 0.0,
                    )
                )
        if any_stopped:
            self.running = [r for r in self.running if not r.is_finished()]
        if self.speculative_config is not None:
            self._set_drafts(runner_output.draft_token_ids, index)
        if self._grammar_failed:
            outputs += [
                EngineCoreOutput(
                    r.request_id, [], finish_reason=r.get_finished_reason(), error=r.error
                )
                for r in self._grammar_failed
            ]
            self._grammar_failed = []
        return EngineCoreOutputs(
            outputs=outputs,
            timestamp=time.monotonic(),
            scheduler_stats=self.make_stats() if self.log_stats else None,
        )

    # -- speculative decoding ---------------------------------------------------------

    def speculating(self) -> bool:
        """Whether requests speculate at the current batch size."""
        limit = self.speculative_config.disable_by_batch_size
        return limit is None or len(self.running) <= limit

    def _set_drafts(self, runner_drafts: list[list[int]] | None, index: dict[str, int]):
        """Set `spec_token_ids` of every running request for the next step: the n-gram
        proposer's, or what the runner's draft model proposed after this step."""
        speculate = self.speculating()
        for request in self.running:
            room = draft_room(request, self.max_model_len) if speculate else 0
            if room <= 0:
                request.spec_token_ids = []
            elif self.proposer is not None:
                request.spec_token_ids = self.proposer.propose(request.all_token_ids, room)
            else:
                i = index.get(request.request_id)
                drafted = runner_drafts is not None and i is not None
                request.spec_token_ids = runner_drafts[i][:room] if drafted else []

    # -- metrics and maintenance ------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        queries, hits = self.kv_cache_manager.take_prefix_cache_stats()
        num_preemptions, self._num_preemptions = self._num_preemptions, 0
        num_drafts, num_draft_tokens, num_accepted = self._spec_counts
        self._spec_counts = [0, 0, 0]
        return SchedulerStats(
            spec_num_drafts=num_drafts,
            spec_num_draft_tokens=num_draft_tokens,
            spec_num_accepted_tokens=num_accepted,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_requests_received=self.num_requests_received,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=num_preemptions,
        )
