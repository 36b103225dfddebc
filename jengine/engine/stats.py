"""Front-end statistics: what one batch of engine-core outputs meant for latency and
throughput, and the periodic log line built from it.

Where it sits: AsyncLLM's output handler calls `StatsTracker.observe` around
`OutputProcessor.process_outputs` and hands the resulting `IterationStats` (plus the
engine's `SchedulerStats`) to every stat logger: `LoggingStatLogger` here, and the
Prometheus logger of the API server (jengine/entrypoints/openai/metrics.py).
Jax-free, like the rest of the front end.
"""

import logging
import time
from dataclasses import dataclass, field

from jengine.protocol import EngineCoreOutputs, SchedulerStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    # Request parameters (vLLM's request_params_*): the user request's n, on the sequence
    # that ended it only (None on its others: one observation a request), and max_tokens
    # (None: to the limit).
    n: int | None = 1
    max_tokens: int | None = None
    # Phases on the engine core's clock (vLLM's): waiting until first scheduled, then to the
    # first token, then to the last; None where the engine never reported them (an abort).
    queue_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None


@dataclass(slots=True)
class IterationStats:
    """One engine-core step, seen from the front end. Latencies in seconds."""

    num_prompt_tokens: int = 0  # prompts whose first token arrived now
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # vLLM's LoRA gauges: sequences in flight per adapter name, waiting for their first
    # token or running (after this step's outputs).
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    running_lora_adapters: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _TokenTimes:
    """When a sequence's tokens arrived: here (wall clock, for the inter-token latency)
    and on the engine core's clock (the batch timestamps, for the phase times), and when
    the engine core got it and first scheduled it (sent with its first tokens)."""

    last_seen: float
    first_engine_time: float
    last_engine_time: float
    queued_time: float
    scheduled_time: float


class StatsTracker:
    """Turns engine-core outputs into IterationStats (per engine-core sequence);
    `count_lora`: with the sequences in flight per LoRA adapter (an engine serving them)."""

    def __init__(self, count_lora: bool = False):
        self._token_times: dict[str, _TokenTimes] = {}
        self.count_lora = count_lora

    def observe(self, outputs: EngineCoreOutputs, output_processor) -> "_Observation":
        """Call before `process_outputs`; finish with `.finish()` after it."""
        now = time.time()
        engine_time = outputs.timestamp
        stats = IterationStats()
        states = []
        for output in outputs.outputs:
            state = output_processor.request_states.get(output.request_id)
            if state is None:
                continue
            states.append((state, output))
            num_new = len(output.new_token_ids)
            if output.pooled is not None:  # an embedding: its prompt, and no token
                stats.num_prompt_tokens += len(state.parent.prompt_token_ids)
            if not num_new:
                continue
            stats.num_generation_tokens += num_new
            times = self._token_times.get(state.request_id)
            if times is None:
                arrival = state.parent.metrics.arrival_time if state.parent.metrics else now
                stats.time_to_first_tokens.append(now - arrival)
                stats.num_prompt_tokens += len(state.parent.prompt_token_ids)
                self._token_times[state.request_id] = _TokenTimes(
                    now, engine_time, engine_time, output.queued_time, output.scheduled_time
                )
            else:
                stats.inter_token_latencies.append((now - times.last_seen) / num_new)
                times.last_seen, times.last_engine_time = now, engine_time
        return _Observation(self, output_processor, stats, states, now, engine_time)

    def aborted(self, request_ids: list[str], output_processor) -> IterationStats:
        """Stats of user requests about to be aborted (call before aborting them)."""
        now = time.time()
        stats = IterationStats()
        for request_id in request_ids:
            parent = output_processor.parents.get(request_id)
            n = len(parent.children) if parent else None  # the request ends here
            for state in parent.children.values() if parent else ():
                if state.request_id not in output_processor.request_states:
                    continue  # this sequence already finished
                arrival = parent.metrics.arrival_time if parent.metrics else now
                stats.finished_requests.append(
                    FinishedRequestStats(
                        "abort",
                        now - arrival,
                        len(parent.prompt_token_ids),
                        len(state.output_token_ids),
                        n=n,
                        max_tokens=state.detokenizer.params.max_tokens,
                    )
                )
                n = None
        return stats

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._token_times.pop(request_id, None)

    def has_first_token(self, request_id: str) -> bool:
        return request_id in self._token_times

    def take_times(self, request_id: str) -> _TokenTimes | None:
        """A finished sequence's token times, forgotten here."""
        return self._token_times.pop(request_id, None)


@dataclass(slots=True)
class _Observation:
    tracker: StatsTracker
    output_processor: object
    stats: IterationStats
    states: list[tuple]  # (RequestState, its EngineCoreOutput) pairs
    now: float
    engine_time: float

    def finish(self) -> IterationStats:
        ended = set()  # user requests whose n is counted (two children may end in one step)
        for state, output in self.states:
            if state.finish_reason is None:
                continue
            times = self.tracker.take_times(state.request_id)
            parent = state.parent
            arrival = parent.metrics.arrival_time if parent.metrics else self.now
            ends_parent = parent.finished() and id(parent) not in ended
            if ends_parent:
                ended.add(id(parent))
            finished = FinishedRequestStats(
                finish_reason=state.finish_reason,
                e2e_latency=self.now - arrival,
                num_prompt_tokens=len(parent.prompt_token_ids),
                num_generation_tokens=len(state.output_token_ids),
                n=len(parent.children) if ends_parent else None,
                max_tokens=state.detokenizer.params.max_tokens,
            )
            if times is None:  # no token (an embedding): its first and last at its end
                engine_time = self.engine_time
                times = _TokenTimes(
                    0.0, engine_time, engine_time, output.queued_time, output.scheduled_time
                )
            if times.scheduled_time:  # the engine core said when it ran it
                finished.queue_time = times.scheduled_time - times.queued_time
                finished.prefill_time = times.first_engine_time - times.scheduled_time
                finished.decode_time = times.last_engine_time - times.first_engine_time
                finished.inference_time = times.last_engine_time - times.scheduled_time
            self.stats.finished_requests.append(finished)
        if self.tracker.count_lora:
            self._count_adapters()
        return self.stats

    def _count_adapters(self) -> None:
        """Sequences in flight per LoRA adapter: running once their first token came."""
        for state in self.output_processor.request_states.values():
            name = state.parent.lora_name
            if name is not None and state.finish_reason is None:
                counts = (
                    self.stats.running_lora_adapters
                    if self.tracker.has_first_token(state.request_id)
                    else self.stats.waiting_lora_adapters
                )
                counts[name] = counts.get(name, 0) + 1


class StatLoggerBase:
    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats):
        raise NotImplementedError

    def log(self) -> None:  # called periodically
        pass

    def record_engine_dead(self, num_failed: int) -> None:
        """The engine core died, failing `num_failed` sequences it held."""


class LoggingStatLogger(StatLoggerBase):
    """Logs throughput, queue sizes, KV usage and prefix-cache hit rate every interval
    (only while there is something to report)."""

    def __init__(self):
        self._reset(time.monotonic())
        self.scheduler_stats = SchedulerStats()
        self._last_logged_idle = False

    def _reset(self, now: float) -> None:
        self.last_log_time = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        if scheduler_stats is not None:
            self.scheduler_stats = scheduler_stats
            self.prefix_queries += scheduler_stats.prefix_cache_queries
            self.prefix_hits += scheduler_stats.prefix_cache_hits
            self.spec_drafts += scheduler_stats.spec_num_drafts
            self.spec_draft_tokens += scheduler_stats.spec_num_draft_tokens
            self.spec_accepted += scheduler_stats.spec_num_accepted_tokens
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self.last_log_time, 1e-9)
        s = self.scheduler_stats
        idle = not (
            self.num_prompt_tokens
            or self.num_generation_tokens
            or s.num_running_reqs
            or s.num_waiting_reqs
        )
        if idle and self._last_logged_idle:
            self._reset(now)
            return  # one idle line after activity, then silence
        self._last_logged_idle = idle
        hit_rate = self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            self.num_prompt_tokens / elapsed,
            self.num_generation_tokens / elapsed,
            s.num_running_reqs,
            s.num_waiting_reqs,
            100.0 * s.kv_cache_usage,
            100.0 * hit_rate,
        )
        if self.spec_drafts:
            logger.info(
                "Speculative decoding: acceptance rate %.1f%%, mean accepted length %.2f, "
                "%d drafts of %d tokens",
                100.0 * self.spec_accepted / max(self.spec_draft_tokens, 1),
                1 + self.spec_accepted / self.spec_drafts,
                self.spec_drafts,
                self.spec_draft_tokens,
            )
        self._reset(now)
