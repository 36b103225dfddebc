"""Soak: mixed traffic against one `jengine serve` for a bounded time — streams read to
the end, streams cancelled mid-way, bad requests, n > 1, logprobs, chat and completions —
with the resident memory of both processes watched. No response may be a 5xx, every KV
block must be free at the end, and each process's RSS at the end must be within 10% of
its level after the warm-up (the first minute; 10 s in the short run).

The short run (30 s) is part of the normal suite; the 15-minute run is marked `soak` and
runs only on request: `pytest -m soak tests/entrypoints/test_soak.py -s` (it prints the
figures quoted in bench/README.md).
"""

import asyncio
import random
import re
import time
from dataclasses import dataclass, field

import httpx2
import pytest

from tests.entrypoints.remote_server import MODEL_NAME, SERVER_ARGS, RemoteServer, metric

WORKERS = 8
PROMPTS = ["The quick brown fox", "Once upon a time", "To be or not to be", "In the beginning"]
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
BAD = [
    {"prompt": "x", "max_tokens": 10_000},
    {"prompt": "x", "temperature": -1},
    {"prompt": "x", "n": 1000},
    {"prompt": "x", "stop": ["s"] * 100},
    {"max_tokens": 3},
]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


@dataclass
class Tally:
    statuses: dict[int, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)

    def count(self, kind: str, status: int) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.statuses[status] = self.statuses.get(status, 0) + 1


async def one_request(http: httpx2.AsyncClient, rng: random.Random, tally: Tally) -> None:
    kind = rng.choice(["stream", "cancel", "n3", "logprobs", "chat", "chat_stream", "bad"])
    body = {"model": MODEL_NAME, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 64),
            "temperature": rng.choice([0.0, 0.8])}  # fmt: skip
    path = "/v1/completions"
    if kind == "n3":
        body["n"] = 3
    elif kind == "logprobs":
        body["logprobs"] = 5
    elif kind.startswith("chat"):
        path = "/v1/chat/completions"
        del body["prompt"]
        body.update(messages=MESSAGES, logprobs=True, top_logprobs=3)
    elif kind == "bad":
        body = {"model": MODEL_NAME, **rng.choice(BAD)}
    if kind in ("stream", "cancel", "chat_stream"):
        body["stream"] = True
        async with http.stream("POST", path, json=body) as response:
            tally.count(kind, response.status_code)
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data: ")
                if kind == "cancel" and chunks == 3:
                    break  # hang up mid-stream: the server aborts the request
                assert '"code":5' not in line.replace(" ", ""), line
        return
    response = await http.post(path, json=body)
    tally.count(kind, response.status_code)
    if kind == "bad":
        assert response.status_code == 400, response.text


async def traffic(server: RemoteServer, seconds: float, warmup: float) -> dict:
    pids = {"api": server.proc.pid, "engine": server.engine_pid}
    tally = Tally()
    samples: list[tuple[float, dict[str, int]]] = []
    started = time.monotonic()

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        async with httpx2.AsyncClient(base_url=server.url_for(), timeout=120) as http:
            while time.monotonic() - started < seconds:
                await one_request(http, rng, tally)

    async def sampler() -> None:
        while time.monotonic() - started < seconds:
            samples.append((time.monotonic() - started, {k: rss_kib(p) for k, p in pids.items()}))
            await asyncio.sleep(2)

    await asyncio.gather(sampler(), *(worker(i) for i in range(WORKERS)))
    samples.append((time.monotonic() - started, {k: rss_kib(p) for k, p in pids.items()}))
    baseline = next(rss for t, rss in samples if t >= warmup)
    return {"tally": tally, "baseline": baseline, "final": samples[-1][1],
            "peak": {k: max(rss[k] for _, rss in samples) for k in pids}}  # fmt: skip


def soak(tiny_model: str, seconds: float, warmup: float) -> None:
    with RemoteServer(tiny_model, SERVER_ARGS) as server:
        gauges = httpx2.get(server.url_for("metrics"), timeout=30).text
        start_free = metric(gauges, "jengine:kv_cache_free_blocks")
        result = asyncio.run(traffic(server, seconds, warmup))
        deadline = time.monotonic() + 30
        while True:  # the last aborts reach the engine
            gauges = httpx2.get(server.url_for("metrics"), timeout=30).text
            if metric(gauges, "jengine:kv_cache_free_blocks") == start_free:
                break
            assert time.monotonic() < deadline, "KV blocks leaked"
            time.sleep(0.2)
        assert metric(gauges, "jengine:num_requests_running") == 0
        assert metric(gauges, "jengine:compiles_after_warmup") == 0
    tally = result["tally"]
    print(
        f"\nsoak {seconds:.0f}s, {WORKERS} clients: {sum(tally.kinds.values())} requests "
        f"{tally.kinds}, statuses {tally.statuses}; RSS KiB after {warmup:.0f}s "
        f"{result['baseline']}, at the end {result['final']}, peak {result['peak']}"
    )
    assert not [status for status in tally.statuses if status >= 500], tally.statuses
    assert set(tally.statuses) <= {200, 400}
    for process, baseline in result["baseline"].items():
        growth = result["final"][process] / baseline - 1
        assert abs(growth) <= 0.10, f"{process} RSS moved {growth:+.1%} after the warm-up"


def test_soak_30s(tiny_model):
    soak(tiny_model, seconds=30, warmup=10)


@pytest.mark.soak
def test_soak_15min(tiny_model):
    soak(tiny_model, seconds=900, warmup=60)
