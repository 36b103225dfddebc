"""Faults, injected on purpose (jengine/fault_injection.py) into a real `jengine serve`: a
failure while building one request's output, or while formatting it, ends that request with
an error and nothing else; a client that reads its stream slowly stalls nobody; clients
that hang up mid-generation get their sequences aborted and every KV block back; a request
whose client-chosen id a running request holds runs beside it, and one used again once
its request ended gets its own tokens; a prompt of megabytes stalls nobody while it is
tokenized; a failing
engine step is logged with its request ids and takes the engine down cleanly into 503s.
The server runs with JENGINE_FAULT_INJECTION set; the step fault kills its engine, so that
test comes last."""

import asyncio
import json
import socket
import threading
import time

import httpx2
import pytest

from tests.entrypoints.remote_server import (
    LONG_SERVER_ARGS,
    MODEL_NAME,
    RemoteServer,
    metric,
    sse_data,
)

FAULTS = "output=fault-output,format=fault-format,engine_step=fault-step"
BODY = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 100,
        "ignore_eos": True, "temperature": 0.0}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model):
    env = {"JENGINE_FAULT_INJECTION": FAULTS}
    with RemoteServer(tiny_model, LONG_SERVER_ARGS, env=env) as remote:
        yield remote


@pytest.fixture(scope="module")
def http(server):
    with httpx2.Client(base_url=server.url_for(), timeout=120) as client:
        yield client


def engine_gauges(http) -> dict[str, float]:
    text = http.get("/metrics").text
    return {
        name: metric(text, f"jengine:{name}")
        for name in ("kv_cache_free_blocks", "kv_cache_total_blocks", "num_requests_running")
    }


def wait_until_idle(http, free_blocks: float, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        gauges = engine_gauges(http)
        if gauges["kv_cache_free_blocks"] == free_blocks and not gauges["num_requests_running"]:
            return gauges
        assert time.monotonic() < deadline, f"engine not idle: {gauges}"
        time.sleep(0.2)


def free_blocks(http) -> float:
    return metric(http.get("/metrics").text, "jengine:kv_cache_free_blocks")


def wait_for_free_blocks(http, expected: float) -> None:
    deadline = time.monotonic() + 30
    while free_blocks(http) != expected:
        assert time.monotonic() < deadline, "KV blocks were not returned"
        time.sleep(0.1)


def stream_events(http, body: dict, events: list[str] | None = None) -> list[str]:
    """The stream's `data:` payloads, appended to `events` as they come."""
    events = [] if events is None else events
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    return events


def streamed_text(events: list[str]) -> str:
    chunks = [httpx2.Response(200, content=event).json() for event in events[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def error_of(event: str) -> dict:
    return httpx2.Response(200, content=event).json()["error"]


class Background:
    """A normal stream running on a thread while a test does something bad beside it."""

    def __init__(self, http, body: dict):
        self.events: list[str] = []
        self.thread = threading.Thread(
            target=stream_events, args=(http, body, self.events), daemon=True
        )
        self.thread.start()

    def join(self) -> list[str]:
        self.thread.join(60)
        assert not self.thread.is_alive()
        return self.events


@pytest.mark.parametrize("site", ["output", "format"])
def test_a_fault_building_one_output_ends_only_that_request(server, http, site):
    expected = http.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
    start = free_blocks(http)
    neighbour = Background(http, BODY)
    marked = {**BODY, "request_id": f"fault-{site}-stream"}
    events = stream_events(http, marked)
    assert events[-1] == "[DONE]"
    error = error_of(events[-2])
    assert error["code"] == 500 and "InjectedFault" in error["message"]
    full = http.post("/v1/completions", json={**marked, "request_id": f"fault-{site}-full"})
    assert full.status_code == 500 and full.json()["error"]["code"] == 500
    assert streamed_text(neighbour.join()) == expected
    wait_for_free_blocks(http, start)  # the failed requests were aborted in the engine
    assert http.post("/v1/completions", json=BODY).json()["choices"][0]["text"] == expected
    if site == "output":
        assert "building the output of request cmpl-fault-output-stream" in server.log_text()
        # A response stream ends with the error, then `response.failed` (OpenAI's last event
        # of a response that failed: the stream had none).
        body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 8, "stream": True}
        headers = {"X-Request-Id": "fault-output-response"}
        with http.stream("POST", "/v1/responses", json=body, headers=headers) as response:
            lines = [line for line in response.iter_lines() if line.startswith("event: ")]
        assert lines[-2:] == ["event: error", "event: response.failed"]


def test_an_unexpected_error_keeps_the_connection(server):
    """A 500 from an exception no route turned into an error body (the format fault) is
    OpenAI's error body, and the client's next request on the same keep-alive connection
    is served (Starlette's last-resort handler re-raised, and uvicorn closed it: the
    official client's next call failed with a connection error)."""
    failing = json.dumps({**BODY, "request_id": "fault-format-keepalive"}).encode()
    plain = json.dumps({**BODY, "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as conn:
        reader = conn.makefile("rb")
        statuses = []
        for body in (failing, plain):
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            conn.sendall(head + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            status = reader.readline()
            assert status, "the server closed the connection"
            headers = {}
            while (line := reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            payload = json.loads(reader.read(int(headers["content-length"])))
            statuses.append((int(status.split()[1]), payload))
    (code, error), (ok, reply) = statuses
    assert code == 500 and error["error"]["code"] == 500 and "InjectedFault" in str(error)
    assert ok == 200 and reply["usage"]["completion_tokens"] == 2


def test_a_slow_reader_stalls_nobody(server, http):
    """One client opens a big stream (n=4, logprobs) and reads nothing: its request still
    finishes in the engine (outputs wait for it, merged, in one bounded slot) and every
    other client is served meanwhile; read later, its stream is whole."""
    slow_body = {**BODY, "n": 4, "logprobs": 5, "stream": True}
    expected = http.post("/v1/completions", json={**slow_body, "stream": False}).json()
    start = free_blocks(http)
    with http.stream("POST", "/v1/completions", json=slow_body) as slow:
        assert slow.status_code == 200
        started = time.monotonic()
        for _ in range(8):
            assert http.post("/v1/completions", json=BODY).status_code == 200
        assert time.monotonic() - started < 30
        wait_for_free_blocks(http, start)  # the unread request is done in the engine
        events = sse_data(slow)
    assert events[-1] == "[DONE]"
    texts = ["", "", "", ""]
    for event in events[:-1]:
        for choice in httpx2.Response(200, content=event).json()["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [choice["text"] for choice in expected["choices"]]


@pytest.mark.parametrize("chunked", [False, True], ids=["sized", "chunked"])
def test_a_huge_prompt_stalls_no_other_client(server, http, chunked):
    """A prompt of megabytes takes seconds to tokenize, off the event loop: /health answers
    meanwhile (it waited for the tokenizer: 11 s for 4 MB on 2 cores), and the prompt is
    then refused as too long. Also when the body comes chunked, with no Content-Length
    (it was tokenized on the event loop then)."""
    body = {"model": MODEL_NAME, "prompt": "hello world " * 350_000, "max_tokens": 1}
    data = json.dumps(body).encode()
    content = iter([data[i : i + 65536] for i in range(0, len(data), 65536)]) if chunked else data
    headers = {"content-type": "application/json"}

    def send():
        answer["response"] = http.post("/v1/completions", content=content, headers=headers,
                                       timeout=300)  # fmt: skip

    answer = {}
    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(1.0)  # sent, and being tokenized
    started = time.monotonic()
    assert http.get("/health").status_code == 200
    waited = time.monotonic() - started
    sender.join()
    assert answer["response"].status_code == 400
    assert "maximum context length" in answer["response"].json()["error"]["message"]
    assert waited < 1.0, waited


def test_a_request_id_in_use_runs_beside_it(server, http):
    """A client's request_id that a running request holds (a retry while the first's abort
    is on its way, two clients with one trace id): the second runs beside it, streamed or
    not, with the tokens it gets alone, and the running request is unharmed, as in vLLM.
    (It was a 400, also to a client retrying at once after hanging up.)"""
    short = {**BODY, "max_tokens": 8, "return_token_ids": True}
    alone = http.post("/v1/completions", json=short).json()["choices"][0]["token_ids"]
    body = {**BODY, "max_tokens": 900, "request_id": "same-id", "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as first:
        lines = (line for line in first.iter_lines() if line.startswith("data: "))
        events = [next(lines)]  # it runs (900 tokens: seconds)
        for stream in (True, False):
            again = http.post("/v1/completions", json={**short, "request_id": "same-id",
                                                        "stream": stream})  # fmt: skip
            assert again.status_code == 200, again.text
            if not stream:
                assert again.json()["id"] == "cmpl-same-id"
                assert again.json()["choices"][0]["token_ids"] == alone
        events += list(lines)
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)


def test_a_request_id_used_again_gets_its_own_tokens(server, http):
    """A client's request_id used again once its request stopped: the new request's tokens
    are those a fresh id gets. (With async scheduling the step after a stop is still in
    flight when the next request comes; the new request once took its token as its own.)"""
    body = {**BODY, "max_tokens": 24, "return_token_ids": True}
    tokens = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    other = {**body, "prompt": "Once upon a time"}
    fresh = http.post("/v1/completions", json=other).json()["choices"][0]["token_ids"]
    stopped = {**body, "request_id": "used-again", "stop_token_ids": [tokens[5]]}
    choice = http.post("/v1/completions", json=stopped).json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # a stop the scheduler could not foresee
    again = http.post("/v1/completions", json={**other, "request_id": "used-again"})
    assert again.json()["choices"][0]["token_ids"] == fresh


def test_disconnects_return_kv_blocks(server, http):
    """Clients that hang up mid-generation (60 concurrent streams, each as soon as its
    first token arrives; one full-response client with n=2 while it runs) get their
    sequences aborted, each counted once, and every KV block comes back to the pool."""
    total = engine_gauges(http)["kv_cache_total_blocks"]
    assert total == 1023  # LONG_SERVER_ARGS' 1024 blocks, minus the null block
    start = wait_until_idle(http, total)["kv_cache_free_blocks"]
    aborts = 'jengine:request_success_total{finished_reason="abort",model_name="tiny"}'
    lengths = 'jengine:request_success_total{finished_reason="length",model_name="tiny"}'
    before = http.get("/metrics").text
    aborted_before, lengths_before = metric(before, aborts), metric(before, lengths)
    # 1000 tokens take >= 1000 engine steps, seconds: far longer than a hang-up takes to be
    # noticed (120 were not, once decode got faster: 50 of 60 streams finished first).
    body = {**BODY, "max_tokens": 1000}
    del body["temperature"]

    async def run():
        async def stream(aclient, seed):
            json_body = {**body, "stream": True, "seed": seed, "temperature": 1.0}
            async with aclient.stream("POST", "/v1/completions", json=json_body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        return  # first token: hang up

        async def full(aclient):
            response = await aclient.post("/v1/completions", json={**body, "n": 2})
            assert response.status_code == 200, response.text

        limits = httpx2.Limits(max_connections=100)
        async with httpx2.AsyncClient(
            base_url=server.url_for(), timeout=120, limits=limits
        ) as aclient:
            await asyncio.gather(*(stream(aclient, seed) for seed in range(60)))
            wait_until_idle(http, start)
            # Hang up once a scrape sees both sequences run. Should the 1000 steps end
            # between two scrapes, that response finished by length, and the client asks
            # again.
            finished_early = 0
            deadline = time.monotonic() + 60
            while True:
                task = asyncio.create_task(full(aclient))
                while not task.done():
                    busy = (await aclient.get("/metrics")).text
                    if metric(busy, "jengine:num_requests_running") == 2:
                        break
                    await asyncio.sleep(0.01)
                if not task.done():
                    break
                task.result()  # a 200, or the error it was
                finished_early += 1
                assert time.monotonic() < deadline, "no scrape saw the n=2 request run"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return busy, finished_early

    busy, finished_early = asyncio.run(run())
    assert metric(busy, "jengine:kv_cache_free_blocks") < start
    wait_until_idle(http, start)
    # Each of the 62 sequences ends once, counted when the server notices its hang-up
    # (which may come after the blocks are back): wait for all, then check that the
    # count stops there. A stream whose hang-up the server noticed only after its 1000
    # tokens would finish by length; the hang-ups are noticed long before that.
    expected = 62 + 2 * finished_early
    deadline = time.monotonic() + 30
    while True:
        metrics = http.get("/metrics").text
        aborted = metric(metrics, aborts) - aborted_before
        finished = metric(metrics, lengths) - lengths_before
        assert aborted + finished <= expected, (aborted, finished, expected)
        if aborted + finished == expected:
            break
        assert time.monotonic() < deadline, f"{aborted} aborted + {finished} finished of {expected}"
        time.sleep(0.1)
    assert aborted >= 2 + 30, f"only {aborted} of 62 sequences aborted ({finished} finished)"
    assert metric(metrics, "jengine:compiles_after_warmup") == 0
    # And the server is as good as new.
    again = http.post("/v1/completions", json={**body, "max_tokens": 3, "ignore_eos": False})
    assert again.json()["usage"]["completion_tokens"] == 3


def test_a_beam_search_the_client_leaves_stops(server, http):
    """use_beam_search runs a step of engine requests after another: a client that hangs
    up mid-search stops it (no further step starts) and every block comes back."""
    start = wait_until_idle(http, engine_gauges(http)["kv_cache_total_blocks"])
    body = {**BODY, "max_tokens": 500, "n": 4, "use_beam_search": True}

    async def run():
        async with httpx2.AsyncClient(base_url=server.url_for(), timeout=120) as aclient:
            task = asyncio.create_task(aclient.post("/v1/completions", json=body))
            deadline = time.monotonic() + 60
            while metric((await aclient.get("/metrics")).text,
                         "jengine:num_requests_running") == 0:  # fmt: skip
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    wait_until_idle(http, start["kv_cache_free_blocks"])
    generated = metric(http.get("/metrics").text, "jengine:generation_tokens_total")
    time.sleep(1.0)  # a search still going would have run more steps by now
    assert metric(http.get("/metrics").text, "jengine:generation_tokens_total") == generated
    assert http.post("/v1/completions", json={**BODY, "max_tokens": 3}).status_code == 200


def test_a_failing_engine_step_dies_cleanly_into_503s(server, http):
    neighbour = Background(http, {**BODY, "max_tokens": 1000})
    while not neighbour.events:  # running: in the failing step too
        time.sleep(0.01)
    events = stream_events(http, {**BODY, "request_id": "fault-step"})
    for stream in (events, neighbour.join()):
        assert stream[-1] == "[DONE]" and error_of(stream[-2])["code"] == 503
    log = server.log_text()
    assert "the engine step failed while running requests" in log
    assert "fault-step" in log.split("the engine step failed while running requests")[1][:500]
    deadline = time.monotonic() + 10
    while http.get("/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    response = http.post("/v1/completions", json=BODY)
    assert response.status_code == 503 and response.json()["error"]["code"] == 503
    assert server.proc.poll() is None  # the API server itself carries on, answering 503s
