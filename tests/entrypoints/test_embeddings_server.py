"""`/v1/embeddings` with the official `openai` client against `jengine serve --runner pooling`
on the tiny model: one and many inputs (strings and token ids, whole or cut by
`truncate_prompt_tokens`) equal `LLM.embed`'s embeddings of the same prompts, base64 equal
to float, `dimensions` refused on a model that is not matryoshka, and the 400s: an empty or
too-long input, embeddings asked of a generating server, generation asked of an embedding
server. An embedding engine runs prompts only, so it is a server of its own: the two
servers run side by side here, a generation stream on one while the other embeds, and
neither compiles after warmup."""

import base64
import re
import threading

import httpx2
import numpy as np
import openai
import pytest

from jengine.entrypoints.openai.serving_embedding import encode_embedding
from tests.entrypoints.remote_server import MODEL_NAME, SERVER_ARGS, RemoteServer, metric
from tests.entrypoints.tiny_model import ENGINE_ARGS

TEXTS = ["The quick brown fox", "jumps over the lazy dog", "a"]


@pytest.fixture(scope="module")
def servers(tiny_model):
    with (
        RemoteServer(tiny_model, [*SERVER_ARGS, "--runner", "pooling"]) as embedder,
        RemoteServer(tiny_model, SERVER_ARGS) as generator,
    ):
        yield embedder, generator


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url_for("v1"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected(tiny_model):
    """`LLM.embed` of TEXTS in this process: the embeddings the server should send."""
    from jengine import LLM

    llm = LLM(tiny_model, runner="pooling", **ENGINE_ARGS)
    outputs = llm.embed(TEXTS, use_tqdm=False)
    token_ids = [o.prompt_token_ids for o in outputs]
    return token_ids, [np.array(o.outputs.embedding) for o in outputs]


def test_embeddings_of_one_and_many_inputs(servers, expected):
    embedder, _ = servers
    client = client_of(embedder)
    token_ids, vectors = expected
    one = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="float")
    assert one.object == "list" and one.model == MODEL_NAME
    assert [d.index for d in one.data] == [0]
    np.testing.assert_allclose(one.data[0].embedding, vectors[0], atol=1e-6)
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(token_ids[0])
    many = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    for data, vector in zip(many.data, vectors, strict=True):
        np.testing.assert_allclose(data.embedding, vector, atol=1e-6)
        assert abs(np.linalg.norm(data.embedding) - 1) < 1e-5  # normalised by default
    assert many.usage.prompt_tokens == sum(map(len, token_ids))
    as_ids = client.embeddings.create(model=MODEL_NAME, input=token_ids, encoding_format="float")
    for data, vector in zip(as_ids.data, vectors, strict=True):
        np.testing.assert_allclose(data.embedding, vector, atol=1e-6)
    single_ids = client.embeddings.create(model=MODEL_NAME, input=token_ids[1])
    np.testing.assert_allclose(single_ids.data[0].embedding, vectors[1], atol=1e-6)
    # vLLM's truncate_prompt_tokens: each input's last k tokens.
    k = len(token_ids[1])
    longer = [token_ids[0] + token_ids[1], token_ids[1]]
    cut = client.embeddings.create(
        model=MODEL_NAME, input=longer, extra_body={"truncate_prompt_tokens": k}
    )
    for data in cut.data:
        np.testing.assert_allclose(data.embedding, vectors[1], atol=1e-6)
    assert cut.usage.prompt_tokens == 2 * k


def test_embeddings_count_in_the_metrics(servers, expected):
    """An embedding's prompt tokens are counted, and it ends as "stop" (it was 0 prompt
    tokens, and every embedding "length")."""
    embedder, _ = servers
    token_ids, _ = expected

    def counts():
        text = httpx2.get(embedder.url_for("metrics")).text
        ended = {  # a reason's line appears with its first request
            reason: re.search(rf'request_success_total{{finished_reason="{reason}".*}} (\S+)', text)
            for reason in ("stop", "length")
        }
        return [metric(text, "jengine:prompt_tokens_total")] + [
            float(m.group(1)) if m else 0.0 for m in ended.values()
        ]

    before = counts()
    client_of(embedder).embeddings.create(model=MODEL_NAME, input=token_ids)
    tokens, stopped, cut = (a - b for a, b in zip(counts(), before, strict=True))
    assert (tokens, stopped, cut) == (sum(map(len, token_ids)), len(token_ids), 0)


def test_base64_is_the_float32_bytes_of_the_floats(servers):
    embedder, _ = servers
    body = dict(model=MODEL_NAME, input=TEXTS)
    floats = httpx2.post(embedder.url_for("v1/embeddings"), json=body).json()
    b64 = httpx2.post(
        embedder.url_for("v1/embeddings"), json={**body, "encoding_format": "base64"}
    ).json()
    # Two requests are two runs: the engine is not batch-invariant (which prompts share a
    # step changes the last bits), so across requests the values agree to float32
    # rounding; the encoding itself is exact (below).
    for f, b in zip(floats["data"], b64["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), "<f4")
        assert decoded.dtype == np.float32 and len(decoded) == len(f["embedding"])
        np.testing.assert_allclose(decoded, f["embedding"], atol=1e-6, rtol=0)
    # The openai client asks for base64 by default and decodes it itself.
    default = client_of(embedder).embeddings.create(model=MODEL_NAME, input=TEXTS)
    for d, f in zip(default.data, floats["data"], strict=True):
        np.testing.assert_allclose(d.embedding, f["embedding"], atol=1e-6, rtol=0)


def test_base64_encodes_the_float32_values_exactly():
    rng = np.random.default_rng(0)
    vector = rng.standard_normal(333).astype(np.float32).tolist()
    encoded = encode_embedding(vector, "base64")
    assert np.frombuffer(base64.b64decode(encoded), "<f4").tolist() == vector
    assert encode_embedding(vector, "float") is vector


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "input is empty"),
        ({"input": [[]]}, "input", "prompt is empty"),
        ({"input": [1] * 200}, "input", "longer than the maximum model length"),
        ({"input": [10**6]}, "input", "out of vocabulary"),
        ({"input": "hi", "dimensions": 8}, "dimensions", "matryoshka"),
        ({"input": "hi", "model": "nope"}, "model", "does not exist"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 or from 1"),
        ({"input": "hi", "use_beam_search": True}, "use_beam_search", "not supported"),
        # vLLM's chat-style input: "input: Field required" alone, dropped beside an input.
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "not supported"),
        ({"input": "hi", "messages": []}, "messages", "not supported"),
        ({}, "input", "input is required"),
    ],
)
def test_bad_embedding_requests_are_400s_naming_the_field(servers, body, param, words):
    embedder, _ = servers
    response = httpx2.post(embedder.url_for("v1/embeddings"), json={"model": MODEL_NAME, **body})
    error = response.json()["error"]
    assert response.status_code == (404 if param == "model" else 400), error
    assert error["param"] == param and words in error["message"], error


def test_each_server_refuses_the_others_work(servers):
    embedder, generator = servers
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client_of(generator).embeddings.create(model=MODEL_NAME, input="hi")
    with pytest.raises(openai.BadRequestError, match="serves embeddings"):
        client_of(embedder).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="serves embeddings"):
        client_of(embedder).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], stream=True
        )


def test_embedding_beside_generation_compiles_nothing(servers, expected):
    embedder, generator = servers
    _, vectors = expected
    texts = []

    def generate():
        stream = client_of(generator).completions.create(
            model=MODEL_NAME, prompt="Once upon", max_tokens=100, stream=True, temperature=0
        )
        texts.extend(chunk.choices[0].text for chunk in stream)

    thread = threading.Thread(target=generate)
    thread.start()
    for size in (1, 7, 16, 40):  # batches across the step shapes
        inputs = [TEXTS[i % 3] for i in range(size)]
        result = client_of(embedder).embeddings.create(
            model=MODEL_NAME, input=inputs, encoding_format="float"
        )
        for i, data in enumerate(result.data):
            np.testing.assert_allclose(data.embedding, vectors[i % 3], atol=1e-6)
    thread.join()
    assert len("".join(texts)) > 0
    for server in servers:
        text = httpx2.get(server.url_for("metrics")).text
        assert metric(text, "jengine:compiles_after_warmup") == 0
