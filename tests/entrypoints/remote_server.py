"""Shared by the serving tests: a real `jengine serve` subprocess on 127.0.0.1, its flags,
SSE and /metrics helpers.

Every server here uses the same engine shapes (`tiny_model.ENGINE_ARGS`, as the flags in
SERVER_ARGS), so after the first start the persistent XLA cache makes each further start
(and the in-process LLM of the fidelity test) take seconds.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx2

from tests.entrypoints.tiny_model import ENGINE_ARGS

API_KEY = "test-key"
MODEL_NAME = "tiny"


def engine_flags(engine_args: dict) -> list[str]:
    """`LLM` keyword arguments as `jengine serve` flags."""
    return [
        arg
        for name, value in engine_args.items()
        for arg in (f"--{name.replace('_', '-')}", str(value))
    ]


ENGINE_FLAGS = engine_flags(ENGINE_ARGS)  # see the module docstring
SERVER_ARGS = [
    *ENGINE_FLAGS,
    "--served-model-name", MODEL_NAME, "tiny-alias",
    "--disable-uvicorn-access-log",
]  # fmt: skip
# The tiny model writes 16 x 120 tokens in a fraction of a second: tests that need the
# engine busy for seconds (shutdown, faults) run 1000-token requests with room for them.
LONG_SERVER_ARGS = [*SERVER_ARGS, "--max-model-len", "1024", "--num-gpu-blocks-override", "1024"]


NATIVE_FRAME = re.compile(r"^\s*@\s+0x[0-9a-f]+")


def log_excerpt(text: str, limit: int = 8000) -> str:
    """The end of a process's log for a failure message, without the native stack frames
    (`    @     0x7f...  symbol`) an abort prints: dozens of them would push the Python
    traceback that says why out of the excerpt."""
    lines = [line for line in text.splitlines() if not NATIVE_FRAME.match(line)]
    return "\n".join(lines)[-limit:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m jengine.entrypoints.cli serve MODEL ...` on 127.0.0.1, log to a file;
    `python`: another interpreter's install (default: this one's), run from `cwd`."""

    def __init__(
        self,
        model: str,
        args: list[str],
        startup_timeout: float = 900.0,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        cwd: str | None = None,
    ):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the server)
            "w+", prefix="jengine-serve-", suffix=".log"
        )
        cmd = [
            python, "-m", "jengine.entrypoints.cli", "serve", model,
            "--host", "127.0.0.1", "--port", str(self.port), *args,
        ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        # A process group of its own, as a service manager gives it (tests signal it).
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
            start_new_session=True,
        )  # fmt: skip
        self._wait_ready(startup_timeout)

    def url_for(self, *parts: str) -> str:
        return "/".join([f"http://127.0.0.1:{self.port}", *parts])

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = log_excerpt(self.log_text())
                raise RuntimeError(f"server exited during start-up:\n{log}")
            try:
                if httpx2.get(self.url_for("health"), timeout=2).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout}s:\n{log_excerpt(self.log_text())}")

    @property
    def engine_pid(self) -> int:
        match = re.search(r"started the engine-core process \(pid (\d+)\)", self.log_text())
        assert match, "no engine pid in the server log"
        return int(match.group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
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


def sse_data(response) -> list[str]:
    """The `data:` payloads of a streamed httpx response, in order."""
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def metric(text: str, name: str) -> float:
    """Value of the first sample of `name` in Prometheus text."""
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match, f"metric {name} not found"
    return float(match.group(1))
