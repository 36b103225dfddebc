"""Overload: far more concurrent requests than the KV cache holds. A server with room for
about 4 full-length requests (31 blocks of 16 tokens, max_model_len 128) and
`--max-queued-requests 4` gets 40 at once through the official client: those admitted
(16 seats + 4 queued, over 4x the KV capacity) all complete, each equal to the same
request run alone (preemption and recompute change nothing); the excess gets 429s in
OpenAI's shape with Retry-After; afterwards every KV block is free again. One request of
more sequences than seats and queue together is a 400. (With 24, a
cold suite on two loaded cores once saw 4 requests finish before the last arrived, and
nothing was left to refuse.)"""

import asyncio

import httpx2
import openai
import pytest

from tests.entrypoints.remote_server import MODEL_NAME, SERVER_ARGS, RemoteServer, metric

NUM_BLOCKS = 32  # one is the null block
SEATS, QUEUED, BURST = 16, 4, 40
MAX_TOKENS = 100


@pytest.fixture(scope="module")
def server(tiny_model):
    args = list(SERVER_ARGS)
    args[args.index("--num-gpu-blocks-override") + 1] = str(NUM_BLOCKS)
    with RemoteServer(tiny_model, [*args, "--max-queued-requests", str(QUEUED)]) as remote:
        yield remote


def prompt(i: int) -> str:
    return f"Request {i}: the quick brown fox"


async def complete(client: openai.AsyncOpenAI, i: int) -> str:
    response = await client.completions.create(
        model=MODEL_NAME,
        prompt=prompt(i),
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert response.choices[0].finish_reason == "length"
    return response.choices[0].text


def test_burst_beyond_kv_capacity_completes_exactly_and_excess_gets_429(server):
    assert "max concurrency at max_model_len=128: 3.88x" in server.log_text()

    def gauges() -> str:
        return httpx2.get(server.url_for("metrics"), timeout=30).text

    start_free = metric(gauges(), "jengine:kv_cache_free_blocks")

    async def run():
        client = openai.AsyncOpenAI(
            base_url=server.url_for("v1"), api_key="none", max_retries=0, timeout=300
        )
        alone = [await complete(client, i) for i in range(BURST)]
        burst = await asyncio.gather(
            *(complete(client, i) for i in range(BURST)), return_exceptions=True
        )
        return alone, burst

    alone, burst = asyncio.run(run())
    done = [i for i, result in enumerate(burst) if isinstance(result, str)]
    refused = [result for result in burst if not isinstance(result, str)]
    assert all(isinstance(e, openai.RateLimitError) for e in refused), refused
    # Everything sent at once: at most seats + queue admitted (a few more if some finish
    # before the last arrive), the rest refused.
    assert len(done) >= SEATS + QUEUED and refused
    for error in refused:
        assert error.status_code == 429 and error.response.headers["retry-after"] == "1"
        assert error.body["code"] == 429 and error.body["type"] == "RateLimitError"
    for i in done:
        assert burst[i] == alone[i], f"request {i} differs from its run alone"
    after = gauges()
    assert metric(after, "jengine:kv_cache_free_blocks") == start_free
    assert metric(after, "jengine:num_preemptions_total") > 0  # the KV cache really overflowed
    assert metric(after, "jengine:compiles_after_warmup") == 0


def test_a_request_larger_than_seats_and_queue_is_a_400_not_a_429(server):
    """A 429 says "retry later"; one that could never be admitted, even on an idle server,
    would have a client (the openai client retries 429s) retry forever."""
    client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none", max_retries=0)
    too_many = SEATS + QUEUED + 1
    with pytest.raises(openai.BadRequestError) as n:
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, n=too_many)
    assert n.value.body["param"] == "n" and f"at most {SEATS + QUEUED} at once" in str(n.value)
    with pytest.raises(openai.BadRequestError) as prompts:
        client.completions.create(model=MODEL_NAME, prompt=["Hi"] * too_many, max_tokens=2)
    assert prompts.value.body["param"] == "prompt"
    fits = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, n=SEATS + QUEUED)
    assert len(fits.choices) == SEATS + QUEUED
