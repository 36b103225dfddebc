"""llama-server as a benchmark peer: started on 127.0.0.1 for the duration of a `with`
block, driven with greedy token-id requests to its native `/completion`.

Where it sits: bench/throughput.py (`complete_all`, every request at once) and
bench/serve.py (`stream_completion`, streamed, for TTFT and inter-token latency) drive it;
`find_llama_cpp` and `convert_to_gguf` in llama_cpp.py give it its binary and model.
Requests are greedy (top-k 1), EOS is ignored (as jengine's `min_tokens` masks it) and the
prompt cache is off, so every request computes its whole prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence

from .llama_cpp import LlamaCpp, no_repack_args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _completion_body(prompt_ids: Sequence[int], n_predict: int, stream: bool) -> dict:
    return {
        "prompt": [int(t) for t in prompt_ids],  # token ids: taken as they are, no BOS added
        "n_predict": int(n_predict),
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 1,
        "samplers": ["top_k"],  # greedy: the argmax token, nothing else in the chain
        "cache_prompt": False,
        "return_tokens": True,
        "stream": stream,
    }


class LlamaServer:
    """`llama-server` on 127.0.0.1 while the `with` block runs.

    `parallel` slots with continuous batching, `threads` threads for decoding and for
    prompt batches, `ctx_size` KV-cache tokens in all (llama.cpp gives each of the
    `parallel` slots ctx_size / parallel unless `--kv-unified` is among `extra_args`),
    no web UI, no RAM prompt cache (`--cache-ram 0`: every request is computed in full,
    requests also send `cache_prompt: false`). The server's log goes to `log_path`, else
    to a temporary file removed on exit; its tail is in the error if the server fails to
    start, and `log_tail()` reads it while the server runs.

    Numerics: by default the KV cache is float32 and flash attention off, so llama.cpp
    computes what jengine computes in float32 (greedy workload-A outputs were identical,
    32 of 32 requests x 128 tokens). llama.cpp's own defaults, `kv_cache_type="f16"` and
    `flash_attn="auto"` (flash attention with an f16 cache), may decode faster at large
    batches but round K/V to f16 (then 13 of those 32 requests matched all 128 tokens).
    """

    def __init__(
        self,
        llama_cpp: LlamaCpp,
        gguf_path: str,
        *,
        parallel: int,
        ctx_size: int,
        threads: int,
        port: int | None = None,
        kv_cache_type: str = "f32",
        flash_attn: str = "off",
        extra_args: Sequence[str] = (),
        log_path: str | None = None,
        startup_timeout_s: float = 300.0,
    ):
        self.llama_cpp, self.gguf_path = llama_cpp, gguf_path
        self.kv_cache_type, self.flash_attn = kv_cache_type, flash_attn
        self.parallel, self.ctx_size, self.threads = parallel, ctx_size, threads
        self.port = port or _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.extra_args = list(extra_args)
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._temp_log = False

    def command(self) -> list[str]:
        return [
            self.llama_cpp.server,
            "-m", self.gguf_path,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "-np", str(self.parallel),
            "--cont-batching",
            "-t", str(self.threads),
            "-tb", str(self.threads),
            "-c", str(self.ctx_size),
            "-ctk", self.kv_cache_type,
            "-ctv", self.kv_cache_type,
            "-fa", self.flash_attn,
            "--no-webui",
            "--cache-ram", "0",
            *no_repack_args(self.llama_cpp, self.gguf_path),
            *self.extra_args,
        ]  # fmt: skip

    def __enter__(self) -> LlamaServer:
        self._temp_log = self.log_path is None
        if self._temp_log:
            self._log = tempfile.NamedTemporaryFile(
                "w+", prefix="llama-server-", suffix=".log", delete=False
            )
            self.log_path = self._log.name
        else:
            self._log = open(self.log_path, "w+")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, chars: int = 4000) -> str:
        if not self.log_path or not os.path.isfile(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited ({self.proc.returncode}) while starting:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200 and json.load(r).get("status") == "ok":
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.2)
        raise TimeoutError(
            f"llama-server not ready after {self.startup_timeout_s} s:\n" + self.log_tail()
        )

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
            if self._temp_log:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.log_path)
                self.log_path = None

    def complete(
        self, prompt_ids: Sequence[int], n_predict: int, timeout_s: float = 600
    ) -> list[int]:
        """Greedy completion of a token-id prompt: exactly `n_predict` generated token ids."""
        body = json.dumps(_completion_body(prompt_ids, n_predict, stream=False)).encode()
        request = urllib.request.Request(
            self.base_url + "/completion",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            result = json.load(r)
        return [int(t) for t in result["tokens"]]

    async def _events(self, client, prompt_ids: Sequence[int], n_predict: int):
        """(arrival time, event) for every streamed event of one greedy completion."""
        body = _completion_body(prompt_ids, n_predict, stream=True)
        async with client.stream("POST", self.base_url + "/completion", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if not payload or payload == "[DONE]":
                    continue
                now = time.perf_counter()
                event = json.loads(payload)
                if "error" in event:
                    raise RuntimeError(f"llama-server: {event['error']}")
                yield now, event
                if event.get("stop"):
                    return

    async def complete_stream(
        self, client, prompt_ids: Sequence[int], n_predict: int
    ) -> AsyncIterator[float]:
        """Stream a greedy completion; yields `time.perf_counter()` as each token arrives.

        `client`: an `httpx2.AsyncClient` (or httpx's; only `.stream()` is used) with no
        read timeout shorter than a request. One value per generated token: an event that
        brings k tokens at once (llama-server holds a token back while it ends inside a
        UTF-8 character and sends it with the next one) yields its arrival time k times, so
        the count is always `n_predict`. Take the start time before calling, for TTFT.
        """
        seen = 0
        async for now, event in self._events(client, prompt_ids, n_predict):
            total = event.get("tokens_predicted", seen)
            for _ in range(total - seen):
                yield now
            seen = max(seen, total)

    async def stream_completion(
        self, client, prompt_ids: Sequence[int], max_tokens: int
    ) -> tuple[list[float], int]:
        """One streamed completion as bench/http_client.py's `stream_completion` measures
        jengine: the arrival time of every event that carried text, and the number of
        tokens generated (llama-server's `tokens_predicted`)."""
        arrivals, tokens = [], 0
        async for now, event in self._events(client, prompt_ids, max_tokens):
            if event.get("content"):
                arrivals.append(now)
            tokens = max(tokens, int(event.get("tokens_predicted") or 0))
        return arrivals, tokens

    async def complete_all(
        self, prompts: Sequence[Sequence[int]], max_tokens: int
    ) -> list[list[int]]:
        """Send every request at once (the server batches them over its slots and queues
        the rest); the generated token ids of each, in order."""
        import httpx2

        limits = httpx2.Limits(max_connections=len(prompts) + 8)
        async with httpx2.AsyncClient(timeout=None, limits=limits) as client:

            async def one(prompt):
                body = _completion_body(prompt, max_tokens, stream=False)
                response = await client.post(self.base_url + "/completion", json=body)
                response.raise_for_status()
                return [int(t) for t in response.json()["tokens"]]

            return list(await asyncio.gather(*(one(p) for p in prompts)))
