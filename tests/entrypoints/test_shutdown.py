"""Stopping `jengine serve`: SIGTERM drains (health and new requests 503, every request
received before it finishes, exit code 0, no process left, no noise), --shutdown-timeout
ends what is left with an error event, and a SIGKILLed API server takes its engine
process with it within 5 s, also one stopped while its engine still starts. Each test
starts its own server, since each ends it."""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx2
import pytest

from tests.entrypoints.remote_server import (
    LONG_SERVER_ARGS,
    MODEL_NAME,
    RemoteServer,
    free_port,
    metric,
)

PROMPT = "The quick brown fox"
STREAMS = 16
BODY = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True,
        "temperature": 0.0}  # fmt: skip


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper holds no memory and counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_running(server: RemoteServer) -> None:
    """Until the engine runs every stream (its gauges, fresh on each /metrics). The streams
    must have been sent at once (`send_streams`): started one by one, the first could finish
    before the last is admitted."""
    deadline = time.monotonic() + 60
    while True:
        metrics = httpx2.get(server.url_for("metrics"), timeout=10).text
        if metric(metrics, "jengine:num_requests_running") == STREAMS:
            return
        assert time.monotonic() < deadline, "the streams never all ran"
        time.sleep(0.01)


def _stop_and_wait(server: RemoteServer, processes: set[int]) -> None:
    assert server.proc.wait(60) == 0, server.log_text()[-3000:]
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in processes):
        assert time.monotonic() < deadline, f"left behind: {[p for p in processes if alive(p)]}"
        time.sleep(0.1)


def send_streams(server: RemoteServer, count: int) -> list[http.client.HTTPConnection]:
    """`count` streaming completions written whole to their sockets, responses unread: once
    this returns, the server's kernel holds every request."""
    body = json.dumps({**BODY, "stream": True})
    connections = []
    for _ in range(count):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        connections.append(connection)
    return connections


def read_stream(connection: http.client.HTTPConnection) -> tuple[int, list[str]]:
    response = connection.getresponse()
    lines = response.read().decode().splitlines()
    return response.status, [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def test_sigterm_to_the_process_group_serves_every_request_received(tiny_model):
    """16 streams whose requests the server received just before SIGTERM reached its whole
    process group (as systemd and `kill -- -PGID` send it): every one is served in full,
    /health and new requests get 503, exit code 0, no process left, and nothing but log
    lines is printed."""
    server = RemoteServer(tiny_model, [*LONG_SERVER_ARGS, "--shutdown-timeout", "60"])
    try:
        expected = httpx2.post(server.url_for("v1/completions"), json=BODY, timeout=60).json()
        processes = descendants(server.proc.pid)
        assert server.engine_pid in processes
        connections = send_streams(server, STREAMS)
        os.killpg(server.proc.pid, signal.SIGTERM)
        # Draining: /health and new requests answer 503 at once, while the streams run.
        deadline = time.monotonic() + 5
        while (health := httpx2.get(server.url_for("health"), timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200 after SIGTERM"
        assert health.status_code == 503 and health.json()["error"]["code"] == 503
        refused = httpx2.post(server.url_for("v1/completions"), json=BODY, timeout=5)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        for connection in connections:
            status, events = read_stream(connection)
            assert status == 200, events
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert (
                "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
                == (expected["choices"][0]["text"])
            )
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        _stop_and_wait(server, processes)
        log = server.log_text()
        assert "new requests are refused" in log
        assert "Traceback" not in log and "Exception ignored" not in log, log[-3000:]
    finally:
        server.stop()


@pytest.mark.parametrize("cut", ["timeout", "second signal"])
def test_shutdown_timeout_ends_streams_with_an_error_event(tiny_model, cut):
    """A timeout of 0: nothing may finish, so every stream gets the error
    (deterministically). A second signal while draining (a supervisor's repeated SIGTERM,
    Ctrl-C twice) skips the wait the same way: the error event, then a quiet exit (uvicorn
    cut the streams with no error event, and logged a traceback for each)."""
    flags = ["--shutdown-timeout", "0" if cut == "timeout" else "60"]
    server = RemoteServer(tiny_model, [*LONG_SERVER_ARGS, *flags])
    try:
        processes = descendants(server.proc.pid)
        connections = send_streams(server, STREAMS)
        wait_running(server)
        server.proc.send_signal(signal.SIGTERM)
        if cut == "second signal":
            deadline = time.monotonic() + 30
            while "new requests are refused" not in server.log_text():
                assert time.monotonic() < deadline, "the drain never started"
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGINT)
        for connection in connections:
            status, events = read_stream(connection)
            assert status == 200 and events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["code"] == 503 and "shutting down" in error["message"]
            assert ("--shutdown-timeout" in error["message"]) == (cut == "timeout")
        _stop_and_wait(server, processes)
        assert "Traceback" not in server.log_text()
    finally:
        server.stop()


def test_sigkill_of_the_api_server_takes_the_engine_down(tiny_model, tmp_path):
    """The engine exits within 5 s and removes the server's socket folder (it was left in
    /tmp: a SIGKILLed process cleans up nothing)."""
    server = RemoteServer(tiny_model, LONG_SERVER_ARGS, env={"TMPDIR": str(tmp_path)})
    try:
        engine_pid = server.engine_pid
        assert [p for p in os.listdir(tmp_path) if p.startswith("jengine-")]
        connections = send_streams(server, STREAMS)
        wait_running(server)  # killed mid-step, not while idle
        server.proc.kill()
        server.proc.wait(10)
        deadline = time.monotonic() + 5
        while alive(engine_pid):
            assert time.monotonic() < deadline, "the engine outlived its API server by 5 s"
            time.sleep(0.1)
        assert not [p for p in os.listdir(tmp_path) if p.startswith("jengine-")]
        for connection in connections:
            connection.close()
    finally:
        server.stop()


# `jengine serve` as typed in a terminal: Ctrl-C raises KeyboardInterrupt (a process this
# test starts may inherit SIGINT ignored, as a non-interactive shell's background jobs do).
SERVE_AS_TYPED = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from jengine.entrypoints.cli import main; main()"
)


@pytest.mark.parametrize("stop", ["SIGTERM", "Ctrl-C"])
def test_an_api_server_stopped_while_its_engine_starts_takes_the_engine_down(
    tiny_model, stop, tmp_path
):
    """SIGTERM to `jengine serve` as soon as its engine process exists (still importing,
    loading, compiling), or Ctrl-C's SIGINT to its process group once the engine has
    loaded (the server waits for its warmup): the server exits, its engine stopped before
    the end of its warmup, and the engine does not live on as an orphan. (It once read its
    parent's pid only once ready, by then init's, so it never noticed; and it warmed up
    and held its KV cache until SIGKILLed. Ctrl-C's first SIGINT once only cancelled the
    event loop's task, which went on waiting for the engine to the end of its warmup. And
    SIGTERM ended the server on the spot, exit code -15, its socket folder left in /tmp.)"""
    command = [sys.executable, "-c", SERVE_AS_TYPED, "serve", tiny_model,
               "--host", "127.0.0.1", "--port", str(free_port()), *LONG_SERVER_ARGS]  # fmt: skip
    server = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path)),
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    wait_for = "started the engine-core process" if stop == "SIGTERM" else "KV cache: "
    try:
        engine_pid = None
        for line in server.stderr:
            started = re.search(r"started the engine-core process \(pid (\d+)\)", line)
            engine_pid = int(started.group(1)) if started else engine_pid
            if wait_for in line:
                break
        else:
            raise AssertionError(f"the server never logged {wait_for!r}")
        if stop == "SIGTERM":
            server.terminate()
        else:
            os.killpg(server.pid, signal.SIGINT)
        server.wait(30)
        # Ctrl-C stops the engine at its current compile, not at the end of its warmup.
        log = server.stderr.read()
        assert "engine ready" not in log, log
        assert server.returncode == 0, log
        assert not [p for p in os.listdir(tmp_path) if p.startswith("jengine-")], log
        deadline = time.monotonic() + 5
        while alive(engine_pid):
            assert time.monotonic() < deadline, "the engine outlived its API server by 5 s"
            time.sleep(0.1)
    finally:
        server.kill()
        server.wait()
