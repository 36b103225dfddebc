"""If the engine-core process dies, the server says so: /health and every generation route
answer 503 in OpenAI's error shape, promptly, and a stream in flight ends instead of
hanging. Its own server, since the test kills the engine."""

import os
import re
import signal
import threading
import time

import httpx2
import pytest

from tests.entrypoints.remote_server import LONG_SERVER_ARGS, MODEL_NAME, RemoteServer


@pytest.fixture(scope="module")
def server(tiny_model):
    with RemoteServer(tiny_model, LONG_SERVER_ARGS) as remote:
        yield remote


def test_dead_engine_answers_503(server):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}
    with httpx2.Client(base_url=server.url_for(), timeout=30) as http:
        assert http.post("/v1/completions", json=body).status_code == 200

        # A long stream is running when the engine dies.
        events: list[str] = []

        def stream():
            # 900 tokens: seconds of work (120 once all ended before the kill landed).
            long = {**body, "max_tokens": 900, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=long) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
                        if len(events) == 1:
                            os.kill(server.engine_pid, signal.SIGKILL)

        reader = threading.Thread(target=stream)
        reader.start()
        reader.join(30)
        assert not reader.is_alive(), "the stream hung after the engine died"
        assert events[-1] == "[DONE]"
        assert '"code":503' in events[-2].replace(" ", "")

        deadline = time.monotonic() + 10
        while http.get("/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        health = http.get("/health")
        assert health.json()["error"]["code"] == 503

        started = time.monotonic()
        for path, payload in (
            ("/v1/completions", body),
            ("/v1/completions", {**body, "stream": True}),
            ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [
                {"role": "user", "content": "Hi"}]}),
        ):  # fmt: skip
            response = http.post(path, json=payload)
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
        assert time.monotonic() - started < 5
        # Routes that need no engine still work; /metrics still renders.
        assert http.get("/v1/models").status_code == 200
        assert http.post("/tokenize", json={"prompt": "Hello"}).status_code == 200
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        # Nothing runs any more, and the stream the engine held counts as failed (its
        # gauges stayed at their last values, and it was counted nowhere).
        labels = f'model_name="{MODEL_NAME}"'
        assert f"jengine:num_requests_running{{{labels}}} 0.0" in metrics.text
        failed = f'jengine:request_success_total{{finished_reason="error",{labels}}} 1.0'
        assert failed in metrics.text, metrics.text
    # Stopped, it waits for none of them: each has had its error (the log once counted
    # every request the engine held when it died as still running).
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(30)
    assert re.search(r"waiting up to \d+s for 0 running", server.log_text())
