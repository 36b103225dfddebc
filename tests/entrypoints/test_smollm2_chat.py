"""A real instruction-tuned model as a user meets it: `jengine chat` with no model named
(SmolLM2-135M-Instruct, installed by the test setup) answers a question, and `jengine serve
smollm2` answers through `/v1/chat/completions` with the official `openai` client: the
template's default system prompt applies and `<|im_end|>` ends the turn. Under a JSON schema
it names Paris as the capital of France; forced to call `get_weather`, it passes the city
the question names and nothing else; a date regex's `\\d` gives ASCII digits; vLLM's
`return_token_ids` gives the ids of an emoji reply, whole and streamed. The server
decodes in multi-steps of 4 (`--num-scheduler-steps 4`), so that path meets a real model
too: EOS inside the 4 tokens, streaming, and grammars beside it (their steps run single)."""

import json
import re
import subprocess
import sys

import httpx2
import jsonschema
import openai
import pytest

from tests.entrypoints.remote_server import RemoteServer

QUESTION = "What is the capital of France?"
# The function the tool tests force a call of (test_responses_api.py too).
GET_WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
# A few shapes: one request at a time, short prompts.
LIMITS = ["--max-model-len", "256", "--max-num-seqs", "2", "--max-num-batched-tokens", "128"]


def test_jengine_chat_answers_with_the_default_model():
    command = [sys.executable, "-m", "jengine.entrypoints.cli", "chat", QUESTION]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout, result.stdout
    assert "SmolLM2-135M-Instruct" in result.stderr  # it says which default it took


@pytest.fixture(scope="module")
def server():
    flags = [*LIMITS, "--num-scheduler-steps", "4", "--disable-uvicorn-access-log",
             "--return-tokens-as-token-ids"]  # fmt: skip
    with RemoteServer("smollm2", flags) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url_for("v1"), api_key="unused")


def test_chat_completion_is_a_real_answer(client):
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=32,
    )
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    # `<|im_end|>` (the GGUF's EOS) ended the turn: stop, and its text is not shown.
    assert choice.finish_reason == "stop" and "<|im_end|>" not in choice.message.content
    assert reply.usage.completion_tokens < 32
    # The template's default system prompt ("You are a helpful AI assistant named SmolLM")
    # is in the prompt: 30-odd tokens beyond the question's own.
    assert reply.usage.prompt_tokens > 30


def test_streamed_chat_gives_the_same_answer(client):
    kwargs = dict(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=32,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


# -- structured outputs and tools on a real model -------------------------------------------


def test_capital_as_json(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "capital", "schema": schema},
        },
        temperature=0,
        max_tokens=60,
    )
    answer = json.loads(reply.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert "Paris" in answer["city"]
    # Any JSON object: a real model closes it.
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Describe France in JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert reply.choices[0].finish_reason == "stop"


def test_required_tool_call_names_the_city(client):
    weather = {"type": "function", "function": GET_WEATHER}
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the weather like in Tokyo today?"}],
        tools=[weather],
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    # Only the parameter the schema lists, as vLLM's default backend allows: read as JSON
    # Schema's letter, the model adds keys of its own.
    assert json.loads(call.function.arguments) == {"city": "Tokyo"}


def test_a_named_tool_call_has_only_the_listed_arguments(client):
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[{"type": "function", "function": GET_WEATHER}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    [call] = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_date_regex_gives_ascii_digits(client):
    # `\d` is [0-9], as in xgrammar and JavaScript; read as Unicode, SmolLM2 fills it with
    # segmented digits ("🯸🯸🯸🯸-🯸🯸-").
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "A date?"}],
        extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}},
        temperature=0,
        max_tokens=20,
    )
    choice = reply.choices[0]
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", choice.message.content), choice
    assert choice.finish_reason == "stop"


# -- vLLM's token-id fields -----------------------------------------------------------------

EMOJI_CHAT = [
    {"role": "system", "content": "You like to use emojis in your responses."},
    {"role": "user", "content": "Repeat after me: I love cats 🐱"},
]


def _post(server, path: str, body: dict) -> dict:
    response = httpx2.post(server.url_for(path), json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_token_ids_beside_the_text(server, client):
    """`return_token_ids`: the prompt's ids (the rendered chat, as /tokenize gives them) and
    the reply's, `<|im_end|>` included; streamed, the prompt's come once and each chunk
    brings its new ids, an emoji's first bytes before its text. `return_tokens_as_token_ids`
    (here the server's default): logprob tokens are "token_id:<id>". Not asked: the fields
    are null, and absent from chunks."""
    kwargs = dict(model="smollm2", messages=EMOJI_CHAT, temperature=0, max_tokens=40)
    full = client.chat.completions.create(
        **kwargs, logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True}
    )
    choice = full.choices[0]
    assert choice.finish_reason == "stop" and "🐱" in choice.message.content
    rendered = _post(server, "tokenize", {"messages": EMOJI_CHAT})["tokens"]
    assert full.prompt_token_ids == rendered
    decoded = _post(server, "detokenize", {"tokens": choice.token_ids})["prompt"]
    assert decoded == choice.message.content + "<|im_end|>"
    entries = choice.logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in choice.token_ids]
    assert entries[0].bytes == list(entries[0].token.encode())
    assert all(top.token.startswith("token_id:") for e in entries for top in e.top_logprobs)

    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, extra_body={"return_token_ids": True})
    )
    assert chunks[0].prompt_token_ids == rendered
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    streamed = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed == choice.token_ids

    plain = client.chat.completions.create(**kwargs)
    assert plain.prompt_token_ids is None and plain.choices[0].token_ids is None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        assert "prompt_token_ids" not in chunk.model_dump()
        assert "token_ids" not in chunk.choices[0].model_dump()


def test_logprob_bytes_join_into_the_emoji(client):
    """OpenAI's logprob `bytes`: the emoji's tokens each write U+FFFD as their text, and
    their bytes join into the emoji again, so all the entries' bytes are the reply's UTF-8
    (the end of turn aside); so are the candidates' (the request asks for text tokens
    against the server's default)."""
    reply = client.chat.completions.create(
        model="smollm2", messages=EMOJI_CHAT, temperature=0, max_tokens=40, logprobs=True,
        top_logprobs=3, extra_body={"return_tokens_as_token_ids": False},
    )  # fmt: skip
    choice = reply.choices[0]
    entries = [e for e in choice.logprobs.content if e.token != "<|im_end|>"]
    assert any("\ufffd" in e.token for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == choice.message.content
    for top in (top for e in choice.logprobs.content for top in e.top_logprobs):
        assert bytes(top.bytes).decode("utf-8", "replace") == top.token


def test_completion_token_ids_with_echo(server, client):
    """Completions: each choice's prompt ids; with echo and logprobs as ids, the logprob
    tokens are the prompt's ids then the reply's; streamed, the same ids in order; a
    request may ask for the tokens as text against the server's default."""
    prompt = "I love coding 🚀 and"
    prompt_ids = _post(server, "tokenize", {"prompt": prompt})["tokens"]
    extra = {"return_token_ids": True}
    kwargs = dict(model="smollm2", prompt=prompt, temperature=0, max_tokens=12, extra_body=extra)
    out = client.completions.create(**kwargs, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.prompt_token_ids == prompt_ids and len(choice.token_ids) == 12
    tokens = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert tokens == prompt_ids + choice.token_ids
    decoded = _post(server, "detokenize", {"tokens": choice.token_ids})["prompt"]
    # The text holds back the last token when the 12 end inside an emoji (" \xf0\x9f"
    # decodes as " \ufffd"), as vLLM's does.
    assert choice.text.startswith(prompt) and decoded.startswith(choice.text[len(prompt) :])

    chunks = list(client.completions.create(**kwargs, stream=True, n=2))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].prompt_token_ids == prompt_ids
        assert all("prompt_token_ids" not in c.model_dump() for c in mine[1:])
        assert [t for c in mine for t in c.token_ids or []] == choice.token_ids

    # A request's own `return_tokens_as_token_ids: false` wins over the server's default.
    extra["return_tokens_as_token_ids"] = False
    as_text = client.completions.create(**kwargs, logprobs=1).choices[0]
    assert as_text.token_ids == choice.token_ids
    assert "".join(as_text.logprobs.tokens).startswith(as_text.text)
    assert not any(t.startswith("token_id:") for t in as_text.logprobs.tokens)
