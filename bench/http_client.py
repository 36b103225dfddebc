"""The benchmarks' HTTP side: a `jengine serve` process started for a benchmark, and
asyncio clients that drive an OpenAI-style server with token-id prompts.

Where it sits: throughput (workload A through the server), serve (the Poisson load
generator) and startup use it; llama-server is driven the same way by
bench/peers/llama_cpp.py. Loopback only.
"""

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JengineServer:
    """`jengine serve MODEL` on 127.0.0.1 as a user starts it, log to a temp file."""

    def __init__(self, model: str, flags: list[str], startup_timeout: float = 900.0):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="jengine-bench-serve-")  # noqa: SIM115
        command = [
            *(sys.executable, "-m", "jengine.entrypoints.cli", "serve", model),
            *("--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "bench"),
            *("--disable-uvicorn-access-log", "--disable-log-stats", *flags),
        ]
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        self._wait_ready(startup_timeout)
        self.startup_s = time.perf_counter() - started

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jengine serve exited during start-up:\n{self.log_text()}")
            try:
                if httpx2.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"jengine serve not ready after {timeout}s:\n{self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def completion_body(prompt_ids: list[int], max_tokens: int, stream: bool = False) -> dict:
    """Greedy, exactly `max_tokens` tokens (EOS masked by min_tokens, as on every side)."""
    body = dict(
        model="bench",
        prompt=prompt_ids,
        max_tokens=max_tokens,
        min_tokens=max_tokens,
        temperature=0,
        stream=stream,
    )
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def complete_all(base_url: str, prompts: list[list[int]], max_tokens: int) -> int:
    """Send every request at once (the server batches them); returns completion tokens."""
    limits = httpx2.Limits(max_connections=len(prompts) + 8)
    async with httpx2.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:

        async def one(prompt):
            response = await client.post(
                "/v1/completions", json=completion_body(prompt, max_tokens)
            )
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def stream_completion(
    client: httpx2.AsyncClient, prompt_ids: list[int], max_tokens: int
) -> tuple[list[float], int]:
    """One streamed completion: the arrival time of every chunk that carried text, and the
    completion tokens the usage chunk reports."""
    arrivals, tokens = [], 0
    body = completion_body(prompt_ids, max_tokens, stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    return arrivals, tokens
