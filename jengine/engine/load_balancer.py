"""Data parallelism on the front end: which engine-core replica gets each request, and one
view of the replicas for stats and metrics.

Where it sits: the MP clients (jengine/engine/client.py) own one `DataParallelBalancer`
when `--data-parallel-size` > 1. They ask it where to send each new request (`route`),
where its aborts go (`take`), tell it every `EngineCoreOutputs` that arrives (`observe`)
and which replica died (`replica_died`); `combine_utility_results` merges what the
replicas answer to a utility call, `combine_ready` their start-up handshakes. Jax-free,
like the rest of the front end.

What it promises:
- least load: a request goes to the live replica with the fewest running + waiting
  requests, as the replicas report them in every step's `SchedulerStats`, plus the
  sequences sent to it that the report does not count yet (routed minus the report's
  `num_requests_received`; vLLM's DPLB client does the same);
- ties go round: among replicas equally loaded, the first after the one chosen last. When
  requests come one at a time and each ends before the next, every replica is idle at
  each arrival; the lowest index would take them all.
- affinity: the sequences of one request (n > 1) go to one replica and stay there for
  their whole life, so aborts reach the replica that holds them;
- the stats handed on are the sum over replicas (gauges from each replica's latest
  report, counters as each report brings them), so stat loggers see one engine;
- thread-safe: the sync client routes on the caller's thread and observes on its
  output thread.
"""

import threading

from jengine.protocol import EngineCoreOutputs, EngineCoreReady, SchedulerStats


class DataParallelBalancer:
    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self.alive = [True] * num_replicas
        self.loads = [0] * num_replicas
        self.num_routed = [0] * num_replicas  # sequences ever sent to each replica
        self._latest_stats: list[SchedulerStats] = [SchedulerStats()] * num_replicas
        self._replica_of: dict[str, int] = {}  # unfinished sequence id -> replica
        self._last_routed = -1
        self._lock = threading.Lock()

    @property
    def any_alive(self) -> bool:
        return any(self.alive)

    def route(self, request_ids: list[str]) -> int | None:
        """The replica for the sequences of one new request (None if every one is dead)."""
        with self._lock:
            live = [i for i in range(self.num_replicas) if self.alive[i]]
            if not live:
                return None
            least = min(self.loads[i] for i in live)
            tied = [i for i in live if self.loads[i] == least]
            index = next((i for i in tied if i > self._last_routed), tied[0])
            self._last_routed = index
            self.loads[index] += len(request_ids)
            self.num_routed[index] += len(request_ids)
            for request_id in request_ids:
                self._replica_of[request_id] = index
            return index

    def take(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Forget sequences (aborted); returns them grouped by the replica holding them."""
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                index = self._replica_of.pop(request_id, None)
                if index is not None:
                    by_replica.setdefault(index, []).append(request_id)
        return by_replica

    def observe(self, outputs: EngineCoreOutputs) -> None:
        """Note one replica's step: finished sequences, its load; and replace its
        SchedulerStats by the sum over replicas."""
        index = outputs.engine_index
        with self._lock:
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    self._replica_of.pop(output.request_id, None)
            stats = outputs.scheduler_stats
            if stats is None:
                return
            self._latest_stats[index] = stats
            in_transit = max(0, self.num_routed[index] - stats.num_requests_received)
            self.loads[index] = stats.num_running_reqs + stats.num_waiting_reqs + in_transit
            outputs.scheduler_stats = self._aggregate(stats)

    def _aggregate(self, delta: SchedulerStats) -> SchedulerStats:
        live = [s for s, alive in zip(self._latest_stats, self.alive) if alive]
        return SchedulerStats(
            num_running_reqs=sum(s.num_running_reqs for s in live),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in live),
            # Replicas have equal caches, so the mean is the usage of all blocks together.
            kv_cache_usage=sum(s.kv_cache_usage for s in live) / max(len(live), 1),
            num_requests_received=sum(s.num_requests_received for s in live),
            prefix_cache_queries=delta.prefix_cache_queries,
            prefix_cache_hits=delta.prefix_cache_hits,
            num_preemptions=delta.num_preemptions,
            spec_num_drafts=delta.spec_num_drafts,
            spec_num_draft_tokens=delta.spec_num_draft_tokens,
            spec_num_accepted_tokens=delta.spec_num_accepted_tokens,
        )

    def replica_died(self, index: int) -> list[str]:
        """Mark a replica dead; returns the unfinished sequences it took down."""
        with self._lock:
            self.alive[index] = False
            self.loads[index] = 0
            self._latest_stats[index] = SchedulerStats()
            lost = [rid for rid, i in self._replica_of.items() if i == index]
            for request_id in lost:
                del self._replica_of[request_id]
            return lost


def combine_utility_results(method: str, results: list, replicas: list[int] | None = None):
    """One answer from the live replicas' answers to the utility `method`; `replicas`:
    the answering replicas' indices (None: one engine, not data-parallel)."""
    if method == "get_stats" and replicas is not None:
        return combine_stats(results, replicas)  # each replica's own figures too
    if len(results) == 1:
        return results[0]
    if method in ("has_unfinished_requests", "add_lora", "remove_lora"):
        return any(results)
    if method == "reset_prefix_cache":
        return all(results)
    if method in ("num_free_blocks", "compiles_after_warmup"):
        return sum(results)
    raise ValueError(f"no rule to combine {method!r} over data-parallel replicas")


def combine_stats(per_replica: list[dict], replicas: list[int]) -> dict:
    """`EngineCore.get_stats` over the live replicas (indices `replicas`): counts summed,
    usage averaged; each replica's own figures, with its "index", under "replicas"."""
    combined = {
        key: sum(stats[key] for stats in per_replica)
        for key in (
            "num_running_reqs",
            "num_waiting_reqs",
            "num_free_blocks",
            "num_preemptions",
            "compiles_after_warmup",
            "num_requests_added",
            "spec_decode_drafts",
            "spec_decode_draft_tokens",
            "spec_decode_accepted_tokens",
        )
    }
    # Each replica's pool holds one null block; `num_blocks - 1` stays the usable total.
    combined["num_blocks"] = sum(s["num_blocks"] for s in per_replica) - len(per_replica) + 1
    combined["kv_cache_usage"] = sum(s["kv_cache_usage"] for s in per_replica) / len(per_replica)
    combined["attention_impl"] = per_replica[0]["attention_impl"]
    combined["replicas"] = [
        {**stats, "index": index} for stats, index in zip(per_replica, replicas, strict=True)
    ]
    return combined


def combine_ready(readies: list[EngineCoreReady]) -> EngineCoreReady:
    """The replicas' handshakes as one engine's (blocks summed like `combine_stats`)."""
    if len(readies) == 1:
        return readies[0]
    return EngineCoreReady(
        pid=readies[0].pid,
        vocab_size=readies[0].vocab_size,
        num_blocks=sum(r.num_blocks for r in readies) - len(readies) + 1,
        capacity_report=f"{len(readies)} replicas, each: {readies[0].capacity_report}",
        startup_seconds=max(r.startup_seconds for r in readies),
    )
