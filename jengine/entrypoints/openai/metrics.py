"""Prometheus metrics of the API server (`GET /metrics`), with vLLM's metric names under
the `jengine:` prefix.

Where it sits: `PrometheusStatLogger` is one of AsyncLLM's stat loggers: the output handler
hands it each step's SchedulerStats (running/waiting requests, KV usage, prefix-cache
queries and hits, preemptions) and IterationStats (token counts, TTFT, inter-token
latency, finished requests with their phases and parameters). At scrape time the route
also asks the engine core for the gauges only it knows exactly (free KV blocks, compiles
after warmup), summed over data-parallel replicas, with each replica's requests under a
`replica` label.

Each app gets its own CollectorRegistry, so several apps in one process do not clash.
"""

from dataclasses import fields

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from jengine.config import CacheConfig
from jengine.engine.stats import FinishedRequestStats, IterationStats, StatLoggerBase
from jengine.protocol import SchedulerStats

TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
# Also the phases' (queue, prefill, decode, inference), as vLLM's.
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
N_BUCKETS = [1, 2, 5, 10, 20]
FINISH_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


__all__ = ["CONTENT_TYPE_LATEST", "PrometheusStatLogger"]


class PrometheusStatLogger(StatLoggerBase):
    def __init__(
        self,
        model_name: str,
        num_blocks: int,
        max_model_len: int,
        cache_config: CacheConfig | None = None,
        replica_blocks: int | None = None,
        max_loras: int | None = None,
    ):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        if cache_config is not None:
            # vLLM's info gauge: the cache's settings as labels, value 1; num_gpu_blocks is
            # the count one engine core allocated (its null block included: each
            # data-parallel replica's), the override as asked.
            info = {f.name: str(getattr(cache_config, f.name)) for f in fields(cache_config)}
            info["num_gpu_blocks_override"] = info.pop("num_gpu_blocks")
            info["num_gpu_blocks"] = str(replica_blocks or num_blocks)
            Gauge("jengine:cache_config_info", "The KV cache's settings (labels)",
                  sorted(info), registry=r).labels(**info).set(1)  # fmt: skip
        # vLLM's: with LoRA served, the adapters waiting and running (labels, comma-separated
        # names) as of the time this series was last set (its value).
        self.max_loras = max_loras
        if max_loras is not None:
            self.lora_info = Gauge(
                "jengine:lora_requests_info",
                "LoRA adapters of the requests waiting and running (labels); value: when set",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=r,
            )

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_running = gauge("jengine:num_requests_running", "Requests running on the engine")
        self.num_waiting = gauge("jengine:num_requests_waiting", "Requests waiting to run")
        self.kv_usage = gauge("jengine:kv_cache_usage_perc", "KV-cache usage, 1 = full")
        self.free_blocks = gauge(
            "jengine:kv_cache_free_blocks", "Free KV-cache blocks (cached-but-unused included)"
        )
        self.total_blocks = gauge(
            "jengine:kv_cache_total_blocks", "Usable KV-cache blocks (the null block excluded)"
        )
        self.compiles = gauge(
            "jengine:compiles_after_warmup", "XLA compilations after warmup (should stay 0)"
        )
        self.prefix_queries = counter(
            "jengine:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = counter(
            "jengine:prefix_cache_hits", "Prompt tokens found in the prefix cache"
        )
        self.prefix_hit_rate = gauge(
            "jengine:prefix_cache_hit_rate", "Prefix-cache hits / queries since start"
        )
        self.preemptions = counter("jengine:num_preemptions", "Requests preempted")
        self.spec_drafts = counter(
            "jengine:spec_decode_num_drafts", "Speculative decoding: draft runs verified"
        )
        self.spec_draft_tokens = counter(
            "jengine:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed"
        )
        self.spec_accepted = counter(
            "jengine:spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted",
        )
        self.prompt_tokens = counter("jengine:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("jengine:generation_tokens", "Tokens generated")
        success = Counter(
            "jengine:request_success",
            "Finished requests by finish reason",
            labels + ["finished_reason"],
            registry=r,
        )
        self.request_success = {
            reason: success.labels(model_name, reason) for reason in FINISH_REASONS
        }
        self.ttft = histogram(
            "jengine:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS
        )
        self.itl = histogram(
            "jengine:inter_token_latency_seconds", "Time between output tokens", ITL_BUCKETS
        )
        self.e2e = histogram(
            "jengine:e2e_request_latency_seconds", "Arrival to finish", REQUEST_LATENCY_BUCKETS
        )
        # vLLM's phase histograms, observed as a request finishes in the engine core.
        self.queue_time = histogram(
            "jengine:request_queue_time_seconds",
            "Waiting before first scheduled",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "jengine:request_prefill_time_seconds", "First scheduled to first token",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.decode_time = histogram(
            "jengine:request_decode_time_seconds",
            "First token to last token",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "jengine:request_inference_time_seconds", "First scheduled to last token",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram(
            "jengine:request_prompt_tokens", "Prompt tokens of each finished request",
            token_buckets,
        )  # fmt: skip
        self.request_generation_tokens = histogram(
            "jengine:request_generation_tokens", "Tokens each finished request generated",
            token_buckets,
        )  # fmt: skip
        self.iteration_tokens = histogram(
            "jengine:iteration_tokens_total", "Prompt and generated tokens of each step",
            token_buckets,
        )  # fmt: skip
        self.params_n = histogram(
            "jengine:request_params_n", "The n of each finished request", N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "jengine:request_params_max_tokens", "The max_tokens of each finished request",
            token_buckets,
        )  # fmt: skip
        self.max_model_len = max_model_len
        # Per data-parallel replica (absent with one engine): how work is spread.
        replica = ["model_name", "replica"]
        self.replica_requests = Gauge(
            "jengine:replica_requests_added",
            "Engine-core requests (sequences) each data-parallel replica has taken",
            replica,
            registry=r,
        )
        self.replica_running = Gauge(
            "jengine:replica_requests_running",
            "Requests running on each data-parallel replica",
            replica,
            registry=r,
        )
        self.replica_up = Gauge(
            "jengine:replica_up", "1 while a data-parallel replica lives, 0 once it died",
            replica, registry=r,
        )  # fmt: skip
        self._replicas_seen: set[int] = set()
        self.model_name = model_name
        self.total_blocks.set(num_blocks - 1)
        self.free_blocks.set(num_blocks - 1)
        self._queries = 0
        self._hits = 0

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats):
        if scheduler_stats is not None:
            s = scheduler_stats
            self.num_running.set(s.num_running_reqs)
            self.num_waiting.set(s.num_waiting_reqs)
            self.kv_usage.set(s.kv_cache_usage)
            self.prefix_queries.inc(s.prefix_cache_queries)
            self.prefix_hits.inc(s.prefix_cache_hits)
            self.preemptions.inc(s.num_preemptions)
            self.spec_drafts.inc(s.spec_num_drafts)
            self.spec_draft_tokens.inc(s.spec_num_draft_tokens)
            self.spec_accepted.inc(s.spec_num_accepted_tokens)
            self._queries += s.prefix_cache_queries
            self._hits += s.prefix_cache_hits
            if self._queries:
                self.prefix_hit_rate.set(self._hits / self._queries)
        if iteration_stats is not None:
            it = iteration_stats
            self.prompt_tokens.inc(it.num_prompt_tokens)
            self.generation_tokens.inc(it.num_generation_tokens)
            for value in it.time_to_first_tokens:
                self.ttft.observe(value)
            for value in it.inter_token_latencies:
                self.itl.observe(value)
            if it.num_prompt_tokens or it.num_generation_tokens:
                self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
            if self.max_loras is not None:
                self.lora_info.labels(
                    max_lora=str(self.max_loras),
                    waiting_lora_adapters=",".join(sorted(it.waiting_lora_adapters)),
                    running_lora_adapters=",".join(sorted(it.running_lora_adapters)),
                ).set_to_current_time()
            for finished in it.finished_requests:
                self._record_finished(finished)

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        counter = self.request_success.get(finished.finish_reason)
        if counter is not None:
            counter.inc()
        self.e2e.observe(finished.e2e_latency)
        self.request_prompt_tokens.observe(finished.num_prompt_tokens)
        self.request_generation_tokens.observe(finished.num_generation_tokens)
        if finished.n is not None:  # once a user request, as vLLM's
            self.params_n.observe(finished.n)
        max_tokens = finished.max_tokens
        if max_tokens is None:  # up to the context limit, as vLLM fills it in
            max_tokens = self.max_model_len - finished.num_prompt_tokens
        self.params_max_tokens.observe(max_tokens)
        if finished.queue_time is not None:
            self.queue_time.observe(finished.queue_time)
            self.prefill_time.observe(finished.prefill_time)
            self.decode_time.observe(finished.decode_time)
            self.inference_time.observe(finished.inference_time)

    def record_engine_dead(self, num_failed: int) -> None:
        """The engine core died: nothing runs or waits any more, and the requests it held
        (sequences, as finished ones count) failed."""
        for gauge in (self.num_running, self.num_waiting, self.kv_usage):
            gauge.set(0)
        self.replica_running.clear()
        self.request_success["error"].inc(num_failed)

    def record_engine_stats(self, stats: dict) -> None:
        """Gauges read from the engine core at scrape time (EngineCore.get_stats)."""
        self.free_blocks.set(stats["num_free_blocks"])
        self.total_blocks.set(stats["num_blocks"] - 1)
        self.compiles.set(stats["compiles_after_warmup"])
        self.num_running.set(stats["num_running_reqs"])
        self.num_waiting.set(stats["num_waiting_reqs"])
        self.kv_usage.set(stats["kv_cache_usage"])
        if "replicas" in stats:  # data-parallel: the live replicas' own figures
            live = {replica["index"]: replica for replica in stats["replicas"]}
            self._replicas_seen |= set(live)
            for index in self._replicas_seen:
                labels = (self.model_name, str(index))
                replica = live.get(index)
                self.replica_up.labels(*labels).set(replica is not None)
                if replica is None:  # died: what it had taken stays, nothing runs
                    self.replica_running.labels(*labels).set(0)
                else:
                    self.replica_requests.labels(*labels).set(replica["num_requests_added"])
                    self.replica_running.labels(*labels).set(replica["num_running_reqs"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
