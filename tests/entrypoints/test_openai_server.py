"""A real `jengine serve` process on 127.0.0.1, driven by the official `openai` client (and
httpx for raw SSE, disconnects and error bodies): completions and chat, streamed and not,
n > 1, batches, stop strings, lengths, logprobs, echo, usage, fidelity to LLM.generate,
64 concurrent streams, and every error status (clients that hang up: test_faults.py)."""

import asyncio
import json
import os
import re
import time

import httpx2
import openai
import pytest

from tests.entrypoints.remote_server import (
    API_KEY,
    ENGINE_ARGS,
    MODEL_NAME,
    SERVER_ARGS,
    RemoteServer,
    metric,
    sse_data,
)
from tests.entrypoints.tiny_model import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE

PROMPT = "The quick brown fox"
BODY_LIMIT = 1 << 20
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOL_CHAT_TEMPLATE)
    args = [*SERVER_ARGS, "--api-key", API_KEY, "--log-stats-interval", "1",
            "--max-request-body-bytes", str(BODY_LIMIT), "--enable-request-id-headers",
            "--chat-template", str(template)]  # fmt: skip
    with RemoteServer(tiny_model, args) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx2.Client(base_url=server.url_for(), headers=HEADERS, timeout=120) as c:
        yield c


def complete(client, **kwargs):
    return client.completions.create(model=MODEL_NAME, **{"temperature": 0.0, **kwargs})


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, **{"temperature": 0.0, **kwargs})


def raw_stream(http, path: str, body: dict) -> list[str]:
    with http.stream("POST", path, json={"model": MODEL_NAME, **body}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_data(response)


def num_tokens(http, text: str) -> int:
    return http.post("/tokenize", json={"prompt": text}).json()["count"]


# -- completions -------------------------------------------------------------------------


def test_completion_streamed_equals_full_with_exact_usage(client, http):
    full = complete(client, prompt=PROMPT, max_tokens=20)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.prompt_tokens == num_tokens(http, PROMPT)
    assert full.usage.completion_tokens == 20
    assert full.usage.total_tokens == full.usage.prompt_tokens + 20
    assert full.model == MODEL_NAME and full.object == "text_completion"

    chunks = list(
        complete(
            client,
            prompt=PROMPT,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in text_chunks[:-1]] == [None] * (len(text_chunks) - 1)
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]] and not chunks[-1].choices
    assert chunks[-1].usage == full.usage

    # On the wire: [DONE] comes last, after the usage chunk.
    data = raw_stream(
        http,
        "/v1/completions",
        dict(prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
             stream_options={"include_usage": True}),
    )  # fmt: skip
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["usage"]["completion_tokens"] == 20
    # Without stream_options no chunk carries usage.
    data = raw_stream(
        http, "/v1/completions", dict(prompt=PROMPT, max_tokens=5, temperature=0, stream=True)
    )
    assert data[-1] == "[DONE]"
    assert all(json.loads(d).get("usage") is None for d in data[:-1])


def test_n3_and_batched_prompts(client):
    prompts = [PROMPT, "Hello, world!", "To be, or not to be"]
    singles = [complete(client, prompt=p, max_tokens=8).choices[0].text for p in prompts]
    batch = complete(client, prompt=prompts, max_tokens=8)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == singles
    assert batch.usage.completion_tokens == 24

    # Token-id prompts, batched, with n=2: choice index = prompt_index * n + i.
    ids = [[40, 41, 42, 43], [50, 51]]
    out = complete(client, prompt=ids, max_tokens=4, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 6 and out.usage.completion_tokens == 16
    assert out.choices[0].text == out.choices[1].text  # greedy: both sequences agree
    # Streamed with continuous_usage_stats, a chunk's usage is its choice's, as vLLM's: that
    # prompt's tokens and the choice's tokens so far; the last chunk has the whole usage.
    options = {"include_usage": True, "continuous_usage_stats": True}
    ids_too = {"return_token_ids": True}
    chunks = list(complete(client, prompt=ids, max_tokens=4, n=2, stream=True,
                           stream_options=options, extra_body=ids_too))  # fmt: skip
    so_far = [0] * 4
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        so_far[choice.index] += len(choice.model_extra.get("token_ids") or [])
        assert chunk.usage.prompt_tokens == len(ids[choice.index // 2])
        assert chunk.usage.completion_tokens == so_far[choice.index]
    assert so_far == [4] * 4
    assert chunks[-1].usage == out.usage

    sampled = complete(client, prompt=PROMPT, max_tokens=12, n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    assert sampled.usage.completion_tokens == 36
    assert len({c.text for c in sampled.choices}) > 1  # distinct seeds per sequence
    again = complete(client, prompt=PROMPT, max_tokens=12, n=3, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]

    streamed = {}
    for chunk in complete(
        client, prompt=PROMPT, max_tokens=12, n=3, temperature=1.0, seed=7, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in sampled.choices]


def test_stop_strings(client):
    text = complete(client, prompt=PROMPT, max_tokens=40).choices[0].text
    stop = text[12:15]
    expected = text[: text.find(stop)]
    out = complete(client, prompt=PROMPT, max_tokens=40, stop=[stop])
    choice = out.choices[0]
    assert choice.text == expected
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    assert out.usage.completion_tokens < 40
    streamed = "".join(
        c.choices[0].text
        for c in complete(client, prompt=PROMPT, max_tokens=40, stop=stop, stream=True)
        if c.choices
    )
    assert streamed == expected
    kept = complete(
        client,
        prompt=PROMPT,
        max_tokens=40,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == expected + stop


def test_completion_logprobs_and_echo(client, http):
    out = complete(client, prompt=PROMPT, max_tokens=6, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0.0
        assert 3 <= len(top) <= 4 and top[token] == value
        assert max(top.values()) == value  # greedy picks the most likely token

    num_prompt = num_tokens(http, PROMPT)
    echo = complete(client, prompt=PROMPT, max_tokens=6, logprobs=2, echo=True)
    choice = echo.choices[0]
    assert choice.text == PROMPT + out.choices[0].text
    elp = choice.logprobs
    assert len(elp.tokens) == num_prompt + 6
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v is not None for v in elp.token_logprobs[1:])
    assert elp.token_logprobs[num_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert echo.usage.completion_tokens == 6

    streamed = "".join(
        c.choices[0].text
        for c in complete(client, prompt=PROMPT, max_tokens=6, echo=True, stream=True)
        if c.choices
    )
    assert streamed == choice.text


def test_prompt_logprobs_are_returned(client, http):
    """vLLM's `prompt_logprobs` (through `extra_body`): per prompt token, None for the
    first, else the token's own entry and the k most likely, each {logprob, rank,
    decoded_token}; per choice in completions, once per response in chat. The values are
    echo's logprobs of the same prompt."""
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    echo = complete(client, prompt=PROMPT, max_tokens=2, logprobs=2, echo=True)
    echoed = echo.choices[0].logprobs
    out = complete(client, prompt=PROMPT, max_tokens=2, n=2, extra_body={"prompt_logprobs": 2})
    for choice in out.choices:
        rows = choice.prompt_logprobs
        assert len(rows) == len(prompt_ids) and rows[0] is None
        for i, (token_id, row) in enumerate(zip(prompt_ids[1:], rows[1:], strict=True), 1):
            own = row[str(token_id)]  # JSON object keys are strings
            assert own["logprob"] == pytest.approx(echoed.token_logprobs[i], abs=1e-5)
            assert own["decoded_token"] == echoed.tokens[i]
            top = {e["decoded_token"]: e["logprob"] for e in row.values()}
            assert top == pytest.approx(echoed.top_logprobs[i], abs=1e-5)
            assert sorted(e["rank"] for e in row.values() if e["rank"] <= 2) == [1, 2]
    assert complete(client, prompt=PROMPT, max_tokens=2).choices[0].prompt_logprobs is None

    reply = chat(client, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0})
    rows = reply.model_extra["prompt_logprobs"]
    assert len(rows) == reply.usage.prompt_tokens and rows[0] is None
    assert all(len(row) == 1 and next(iter(row.values()))["logprob"] <= 0 for row in rows[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        chat(client, messages=MESSAGES, stream=True, extra_body={"prompt_logprobs": 1})


def test_cache_salt_keeps_prompts_apart(client, http):
    """vLLM's `cache_salt`: a prompt hits the prefix cache again under its salt only (read
    from /metrics, which counts a step's hits before its request's output is sent)."""
    prompt = "Salted: the same words again and again, long enough for full blocks. " * 2

    def hits_after(salt: str) -> float:
        out = complete(client, prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt})
        assert out.usage.prompt_tokens_details is None  # no --enable-prompt-tokens-details
        return metric(http.get("/metrics").text, "jengine:prefix_cache_hits_total")

    first, again, other = hits_after("a" * 43), hits_after("a" * 43), hits_after("b" * 43)
    assert again > first and other == again


def test_truncate_prompt_tokens_keeps_the_last_ones(client, http):
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens are what the model reads
    (and what echo repeats); -1 keeps up to max_model_len."""
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    kept = complete(client, prompt=prompt_ids[-3:], max_tokens=5)
    out = complete(
        client, prompt=PROMPT, max_tokens=5, echo=True, extra_body={"truncate_prompt_tokens": 3}
    )
    assert out.usage.prompt_tokens == 3
    echoed = http.post("/detokenize", json={"tokens": prompt_ids[-3:]}).json()["prompt"]
    assert out.choices[0].text == echoed + kept.choices[0].text
    whole = complete(client, prompt=PROMPT, max_tokens=5, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(prompt_ids)
    reply = chat(client, messages=MESSAGES, max_tokens=2, extra_body={"truncate_prompt_tokens": 4})
    assert reply.usage.prompt_tokens == 4


def test_sampling_fields_take_effect(client, http):
    [e_id] = http.post("/tokenize", json={"prompt": "e"}).json()["tokens"]
    biased = complete(client, prompt=PROMPT, max_tokens=5, logit_bias={str(e_id): 100})
    assert biased.choices[0].text == "eeeee"
    # A stop token that is always chosen ends generation at once, but not before min_tokens.
    extra = {"stop_token_ids": [e_id], "min_tokens": 4}
    out = complete(client, prompt=PROMPT, max_tokens=10, logit_bias={str(e_id): 100},
                   extra_body=extra)  # fmt: skip
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == e_id
    # vLLM's meaning: the stop token is masked for the first 4 tokens, so it is the 5th.
    assert out.usage.completion_tokens == 5
    # top_k=1 sampling is greedy; the other vLLM fields are accepted.
    greedy = complete(client, prompt=PROMPT, max_tokens=8).choices[0].text
    top1 = complete(
        client,
        prompt=PROMPT,
        max_tokens=8,
        temperature=1.0,
        extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0},
    )
    assert top1.choices[0].text == greedy
    penalized = complete(
        client, prompt=PROMPT, max_tokens=8, presence_penalty=2.0, frequency_penalty=2.0
    )
    assert penalized.usage.completion_tokens == 8


# -- chat --------------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "You are a small engine."},
    {"role": "user", "content": "What is the capital of France?"},
]


def rendered(http, **body) -> str:
    tokens = http.post("/tokenize", json=body).json()["tokens"]
    return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_chat_template_file_and_per_request_template(client, http):
    """--chat-template FILE renders what the model's own template leaves out (the tools and
    an earlier call); a request's `chat_template` wins over it."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call]}]
    kwargs = {"tools": [weather]}
    server_file = rendered(http, messages=history, chat_template_kwargs=kwargs)
    assert server_file.startswith("<|system|>\nTools: get_weather<|end|>")
    assert 'call get_weather {"city": "Paris"}<|end|>' in server_file
    assert rendered(http, messages=history, tools=[weather]) == server_file  # vLLM's field
    own = rendered(http, messages=history, chat_template_kwargs=kwargs, chat_template=CHAT_TEMPLATE)
    assert own == server_file.replace("<|system|>\nTools: get_weather<|end|>\n", "").replace(
        'call get_weather {"city": "Paris"}', ""
    )
    # The chat route renders the same way: the tools reach the prompt.
    with_tools = chat(client, messages=MESSAGES, tools=[weather], tool_choice="required",
                      max_tokens=1)  # fmt: skip
    without = chat(client, messages=MESSAGES, max_tokens=1)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens
    # vLLM's `documents` reach the template as transformers passes them.
    rag = "{% for d in documents %}{{ d.title }}: {{ d.text }}\n{% endfor %}"
    rag += "{{ messages[-1].content }}"
    documents = [{"title": "Doc", "text": "Paris is the capital of France."}]
    answered = chat(client, messages=MESSAGES, max_tokens=1, extra_body={
        "chat_template": rag, "documents": documents, "add_generation_prompt": False})  # fmt: skip
    expected = f"Doc: {documents[0]['text']}\n{MESSAGES[-1]['content']}"
    assert answered.usage.prompt_tokens == num_tokens(http, expected)


def test_chat_streamed_equals_full(client, http):
    full = chat(client, messages=MESSAGES, max_completion_tokens=16)
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 16
    rendered = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert full.usage.prompt_tokens == rendered["count"]
    # The deprecated max_tokens means the same.
    assert chat(client, messages=MESSAGES, max_tokens=16).choices[0].message.content == (
        choice.message.content
    )

    chunks = list(
        chat(
            client,
            messages=MESSAGES,
            max_completion_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
    assert chunks[-1].usage == full.usage
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}

    data = raw_stream(
        http,
        "/v1/chat/completions",
        dict(messages=MESSAGES, max_tokens=4, temperature=0, stream=True),
    )
    assert data[-1] == "[DONE]"
    assert json.loads(data[0])["object"] == "chat.completion.chunk"


def test_chat_n_stop_logprobs_echo(client):
    text = chat(client, messages=MESSAGES, max_tokens=30).choices[0].message.content
    stop = text[10:13]
    out = chat(client, messages=MESSAGES, max_tokens=30, stop=stop)
    assert out.choices[0].message.content == text[: text.find(stop)]
    assert out.choices[0].finish_reason == "stop"

    sampled = chat(client, messages=MESSAGES, max_tokens=8, n=3, temperature=1.0, seed=3)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    assert sampled.usage.completion_tokens == 24

    lp = chat(client, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == lp.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())
    plain = chat(client, messages=MESSAGES, max_tokens=5)
    assert plain.choices[0].logprobs is None

    # echo + continue_final_message: the reply continues (and repeats) the last message.
    partial = [*MESSAGES, {"role": "assistant", "content": "Paris is"}]
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    echoed = chat(client, messages=partial, max_tokens=6, extra_body=extra)
    reply = echoed.choices[0].message.content
    assert reply.startswith("Paris is") and len(reply) > len("Paris is")
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in chat(client, messages=partial, max_tokens=6, extra_body=extra, stream=True)
        if c.choices
    )
    assert streamed == reply


@pytest.fixture(scope="module")
def offline_llm(tiny_model):
    """The server's model and engine settings in this process (LLM)."""
    from jengine import LLM

    return LLM(tiny_model, **ENGINE_ARGS)


def test_use_beam_search_answers_llm_beam_searchs_beams(client, offline_llm):
    """vLLM's use_beam_search: the n choices are LLM.beam_search's beams, best first, with
    their text, logprobs and finish reasons, whole and streamed, in completions and chat;
    usage counts every beam's tokens."""
    from jengine.sampling_params import BeamSearchParams

    beams = dict(use_beam_search=True, length_penalty=0.5)
    full = complete(client, prompt=PROMPT, max_tokens=6, n=3, logprobs=1, extra_body=beams)
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
    [offline] = offline_llm.beam_search(PROMPT, params)
    choices = sorted(full.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [b.text for b in offline.sequences]
    assert [c.finish_reason for c in choices] == [b.finish_reason for b in offline.sequences]
    tokenizer = offline_llm.get_tokenizer()
    for choice, beam in zip(choices, offline.sequences, strict=True):
        own = beam.tokens[-len(choice.logprobs.token_logprobs) :]
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(beam.cum_logprob, abs=1e-4)
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in own]
    assert full.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in choices)
    streamed = {}
    for chunk in complete(client, prompt=PROMPT, max_tokens=6, n=3, stream=True, extra_body=beams):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == [c.text for c in choices]
    reply = chat(client, messages=MESSAGES, max_tokens=6, n=2, extra_body=beams)
    assert len(reply.choices) == 2 and reply.choices[0].message.content


def test_served_text_equals_llm_generate(client, offline_llm):
    from jengine import SamplingParams

    prompts = [PROMPT, "Hello, world!", "Blocks of sixteen tokens"]
    served = [complete(client, prompt=p, max_tokens=24).choices[0].text for p in prompts]
    served_chat = chat(client, messages=MESSAGES, max_tokens=24).choices[0].message.content
    llm = offline_llm
    params = SamplingParams(temperature=0.0, max_tokens=24)
    offline = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert served == offline
    offline_chat = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text
    assert served_chat == offline_chat
    # vLLM's token lists, through extra_body.
    lists = {"allowed_token_ids": list(range(40, 90)), "bad_words": offline[0].split()[:2]}
    served_lists = complete(client, prompt=PROMPT, max_tokens=24, extra_body=lists)
    [offline_lists] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, **lists),
                                   use_tqdm=False)  # fmt: skip
    assert served_lists.choices[0].text == offline_lists.outputs[0].text != offline[0]
    assert set(offline_lists.outputs[0].token_ids) <= set(lists["allowed_token_ids"])

    # vLLM's LLM.chat arguments render as the chat route's fields do.
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    served_tools = chat(client, messages=MESSAGES, max_tokens=24,
                        extra_body={"chat_template_kwargs": {"tools": [weather]}})  # fmt: skip
    [offline_tools] = llm.chat(MESSAGES, params, use_tqdm=False, tools=[weather],
                               chat_template=TOOL_CHAT_TEMPLATE)  # fmt: skip
    assert offline_tools.prompt.startswith("<|system|>\nTools: get_weather<|end|>")
    assert offline_tools.outputs[0].text == served_tools.choices[0].message.content
    parts = [{"type": "text", "text": "Paris"}, {"type": "text", "text": "is"}]
    partial = [*MESSAGES, {"role": "assistant", "content": parts}]
    continued = dict(add_generation_prompt=False, continue_final_message=True)
    served_continued = chat(client, messages=partial, max_tokens=24, extra_body=continued)
    [offline_continued] = llm.chat(partial, params, use_tqdm=False, **continued)
    assert offline_continued.prompt.endswith("Paris\nis")
    assert offline_continued.outputs[0].text == served_continued.choices[0].message.content
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(partial, params, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        llm.chat(MESSAGES, params, chat_template_kwargs={"tokenize": True})
    # vLLM's text parts (an assistant's refusal, the Responses API's kinds) are text; the
    # others are named with their place.
    texts = [{"type": "output_text", "text": "Paris"}, {"type": "refusal", "refusal": "no"}]
    said = [*MESSAGES, {"role": "assistant", "content": texts}, *MESSAGES]
    served_said = chat(client, messages=said, max_tokens=8).choices[0].message.content
    eight = SamplingParams(temperature=0.0, max_tokens=8)
    assert llm.chat(said, eight, use_tqdm=False)[0].outputs[0].text == served_said
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[2\]: .* type 'image_url'"):
        llm.chat([{"role": "user", "content": [*texts, {"type": "image_url"}]}], params)
    # A tool call's arguments reach the template as a mapping, its null content as empty
    # text, offline as over HTTP (offline they were JSON text, rendered twice encoded).
    called = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]  # fmt: skip
    shows_calls = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments | tojson }}{% endfor %} {% endfor %}"
    )
    served_called = chat(client, messages=called, max_tokens=8,
                         extra_body={"chat_template": shows_calls})  # fmt: skip
    [offline_called] = llm.chat(called, params, use_tqdm=False, chat_template=shows_calls)
    assert 'assistant: {"city": "Paris"} ' in offline_called.prompt
    assert served_called.usage.prompt_tokens == len(offline_called.prompt_token_ids)
    with pytest.raises(ValueError, match="messages holds a lone UTF-16 surrogate"):
        llm.chat([{"role": "user", "content": "Hi \udc00"}], params)
    with pytest.raises(ValueError, match="prompt holds a lone UTF-16 surrogate"):
        llm.generate("Hi \ud800", params)


# -- load -------------------------------------------------------------------------------


def test_64_concurrent_streams(server, client):
    prompts = [f"Request number {i} says hello" for i in range(64)]
    expected = [c.text for c in complete(client, prompt=prompts, max_tokens=12).choices]

    async def one(aclient, prompt):
        text, usage = "", None
        stream = await aclient.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=12,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage

    async def run():
        aclient = openai.AsyncOpenAI(
            base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0, timeout=300
        )
        async with aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(run())
    assert [text for text, _ in results] == expected
    assert all(usage.completion_tokens == 12 for _, usage in results)


# -- errors ------------------------------------------------------------------------------


def _assert_error(response, status: int, param: str | None = "any"):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"] and error["type"]
    if param != "any":
        assert error["param"] == param
    return error


BAD_COMPLETIONS = [
    ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),  # wrong type
    ({"max_tokens": 4}, "prompt"),  # missing field
    ({"prompt": PROMPT, "max_tokens": 200}, "max_tokens"),  # over max_model_len
    ({"prompt": "word " * 200}, "prompt"),  # prompt alone too long
    ({"prompt": [1, 2, 99999]}, "prompt"),  # out of vocabulary
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": PROMPT, "logit_bias": {"99999": 5}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"abc": 5}}, "logit_bias"),
    ({"prompt": PROMPT, "seed": 2**70}, "seed"),
    ({"prompt": PROMPT, "stop": [""]}, "stop"),
    ({"prompt": PROMPT, "suffix": "x"}, "suffix"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    # Upper bounds on what one request may ask for.
    ({"prompt": PROMPT, "n": 129}, "n"),
    ({"prompt": PROMPT, "n": 2, "best_of": 129}, "best_of"),
    ({"prompt": PROMPT, "max_tokens": 2**40}, "max_tokens"),
    ({"prompt": PROMPT, "stop": [f"s{i}" for i in range(65)]}, "stop"),
    ({"prompt": PROMPT, "stop": "x" * 1025}, "stop"),
    ({"prompt": [PROMPT] * 257, "max_tokens": 1}, "prompt"),
    ({"prompt": PROMPT, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": PROMPT, "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    ({"prompt": PROMPT, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": PROMPT, "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    ({"prompt": PROMPT, "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": PROMPT, "allowed_token_ids": [1, 10**6]}, "allowed_token_ids"),
    ({"prompt": PROMPT, "bad_words": [" "]}, "bad_words"),
    ({"prompt": PROMPT, "cache_salt": ""}, "cache_salt"),
    ({"prompt": PROMPT, "priority": 1}, "priority"),  # the server schedules fcfs
    # Valid JSON ("\\ud800") but no Unicode character: no tokenizer takes it.
    ({"prompt": "Hi \ud800"}, "prompt"),
    ({"prompt": ["Hi", "\udfff"]}, "prompt.1"),
    # vLLM's fields jengine does not implement: refused, not ignored.
    ({"prompt": PROMPT, "prompt_embeds": "AAAA"}, "prompt_embeds"),
    # Beam search takes no sampling knobs it would not apply (vLLM ignores them).
    ({"prompt": PROMPT, "use_beam_search": True, "n": 2, "stop": ["x"]}, "stop"),
    ({"prompt": PROMPT, "use_beam_search": True, "n": 2, "guided_choice": ["a"]}, "guided_choice"),
    ({"prompt": PROMPT, "use_beam_search": True, "n": 11}, "n"),
    ({"prompt": PROMPT, "length_penalty": 0.5}, "length_penalty"),
]

BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"messages": MESSAGES, "max_completion_tokens": 500}, "max_completion_tokens"),
    ({"messages": MESSAGES, "max_tokens": 500}, "max_tokens"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages.0.content.0",
    ),
    ({"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": MESSAGES, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"messages": MESSAGES, "chat_template": "{{ raise_exception('no') }}"}, "messages"),
    ({"messages": [{"role": "user", "content": "Hi \udc00"}]}, "messages.0.content"),
    ({"messages": MESSAGES, "stop": ["\ud83d"]}, "stop.0"),
]


def _post(http, path: str, body: dict):
    """`body` as the openai client sends it: json.dumps escapes a lone surrogate (httpx2's
    json= would refuse to encode it)."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def test_request_ids_as_vllm_reads_them(http):
    """vLLM's: an X-Request-Id header names the request over the body's request_id, and
    the response's id is the route's prefix and that id; with --enable-request-id-headers
    every response carries X-Request-Id (the request's own, else a fresh one). The header
    was ignored, and a request_id was the bare id."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}
    traced = http.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-1"})
    assert traced.json()["id"] == "cmpl-trace-1"
    assert traced.headers["x-request-id"] == "trace-1"
    messages = [{"role": "user", "content": "Hi"}]
    chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "request_id": "own"}
    named = http.post("/v1/chat/completions", json=chat)
    assert named.json()["id"] == "chatcmpl-own"
    assert re.fullmatch("[0-9a-f]{32}", named.headers["x-request-id"])
    streamed = {**chat, "stream": True}
    with http.stream(
        "POST", "/v1/chat/completions", json=streamed, headers={"X-Request-Id": "trace-2"}
    ) as response:
        chunks = [json.loads(d) for d in sse_data(response) if d != "[DONE]"]
    assert {chunk["id"] for chunk in chunks} == {"chatcmpl-trace-2"}
    assert "x-request-id" in http.get("/health").headers
    assert http.get("/ping").status_code == http.post("/ping").status_code == 200  # vLLM's


def test_errors_have_openai_shape_and_status(server, http):
    for body, param in BAD_COMPLETIONS:
        _assert_error(_post(http, "/v1/completions", {"model": MODEL_NAME, **body}), 400, param)
        if "stream_options" not in body:
            streamed = _post(http, "/v1/completions", {"model": MODEL_NAME, "stream": True, **body})
            _assert_error(streamed, 400, param)
    for body, param in BAD_CHATS:
        response = _post(http, "/v1/chat/completions", {"model": MODEL_NAME, **body})
        _assert_error(response, 400, param)
    for body in ({"max_completion_tokens": 0}, {"logprobs": True, "top_logprobs": 21}):
        response = _post(
            http, "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, **body}
        )
        assert _assert_error(response, 400, list(body)[-1])["message"].startswith(list(body)[-1])
    surrogate = _post(http, "/v1/responses", {"model": MODEL_NAME, "input": "Hi \ud800"})
    _assert_error(surrogate, 400, "input")
    for path in ("/v1/completions", "/v1/chat/completions"):
        malformed = http.post(path, content=b'{"model": "tiny", "prompt": ', headers={
            "content-type": "application/json"})  # fmt: skip
        assert "JSON" in _assert_error(malformed, 400)["message"]
    missing = http.post("/v1/completions", json={"model": "gpt-4", "prompt": PROMPT})
    assert _assert_error(missing, 404, "model")["type"] == "NotFoundError"
    alias = http.post(
        "/v1/completions", json={"model": "tiny-alias", "prompt": PROMPT, "max_tokens": 2}
    )
    assert alias.status_code == 200 and alias.json()["model"] == MODEL_NAME
    with httpx2.Client(base_url=server.url_for(), timeout=30) as anonymous:
        body = {"model": MODEL_NAME, "prompt": PROMPT}
        _assert_error(anonymous.post("/v1/completions", json=body), 401)
        wrong = {"Authorization": "Bearer wrong"}
        _assert_error(anonymous.post("/v1/completions", json=body, headers=wrong), 401)
        _assert_error(anonymous.get("/v1/models"), 401)
        _assert_error(anonymous.post("/tokenize", json={"prompt": PROMPT}), 401)
        _assert_error(anonymous.post("/detokenize", json={"tokens": [1]}), 401)
        _assert_error(anonymous.get("/metrics"), 401)
        # Probes carry no key.
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/version").status_code == 200
    _assert_error(http.get("/v1/nothing-here"), 404)
    assert "Method Not Allowed" in _assert_error(http.get("/v1/completions"), 405)["message"]
    # Model names are looked up, never opened as paths.
    for name in ("../../etc/passwd", "/etc", os.path.dirname(__file__)):
        response = http.post("/v1/completions", json={"model": name, "prompt": PROMPT})
        _assert_error(response, 404, "model")


def test_body_size_limit_is_a_413(http):
    """Told up front (Content-Length) or only as the chunks add up: 413, nothing else."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "x" * BODY_LIMIT}).encode()
    _assert_error(http.post("/v1/completions", content=body), 413)

    def chunks():
        for i in range(0, len(body), 1 << 16):
            yield body[i : i + (1 << 16)]

    _assert_error(http.post("/v1/completions", content=chunks()), 413)
    small = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT})
    assert small.status_code == 200


def test_errors_through_the_openai_client(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, prompt=PROMPT, max_tokens=1000)
    assert "maximum context length" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url_for("v1"), api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        chat(client, messages=MESSAGES, logprobs=True, top_logprobs=50)


def test_bad_requests_do_not_disturb_a_running_stream(client, http):
    expected = complete(client, prompt=PROMPT, max_tokens=40).choices[0].text
    text = ""
    stream = complete(client, prompt=PROMPT, max_tokens=40, stream=True)
    for i, chunk in enumerate(stream):
        text += "".join(c.text for c in chunk.choices)
        if i < len(BAD_COMPLETIONS):
            body, _ = BAD_COMPLETIONS[i]
            response = _post(http, "/v1/completions", {"model": MODEL_NAME, **body})
            assert response.status_code == 400
    assert text == expected


# -- other routes ------------------------------------------------------------------------


def test_models_tokenize_detokenize_version_health_metrics(server, client, http, tiny_model):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME, "tiny-alias"]
    assert models.data[0].model_extra["max_model_len"] == 128

    tokens = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 128
    assert tokens["token_strs"] is None
    strs = {"model": MODEL_NAME, "prompt": PROMPT, "return_token_strs": True}
    token_strs = http.post("/tokenize", json=strs).json()["token_strs"]
    from jengine.engine.tokenizer import load_tokenizer_from

    tokenizer = load_tokenizer_from(tiny_model)
    assert token_strs == tokenizer.convert_ids_to_tokens(tokens["tokens"])
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == PROMPT
    _assert_error(http.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    _assert_error(http.post("/tokenize", json={}), 400)
    _assert_error(_post(http, "/tokenize", {"prompt": "Hi \ud800"}), 400, "prompt")
    _assert_error(http.post("/tokenize", json={"model": "x", "prompt": "a"}), 404, "model")

    assert http.get("/version").json()["version"]
    assert http.get("/health").status_code == 200

    complete(client, prompt=PROMPT, max_tokens=4)
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in (
        "jengine:num_requests_running",
        "jengine:num_requests_waiting",
        "jengine:kv_cache_usage_perc",
        "jengine:kv_cache_free_blocks",
        "jengine:prefix_cache_hit_rate",
        "jengine:prefix_cache_queries_total",
        "jengine:prefix_cache_hits_total",
        "jengine:prompt_tokens_total",
        "jengine:generation_tokens_total",
        "jengine:time_to_first_token_seconds_count",
        "jengine:inter_token_latency_seconds_count",
        "jengine:e2e_request_latency_seconds_count",
    ):
        metric(text, name)
    assert metric(text, "jengine:generation_tokens_total") >= 4
    # vLLM's cache_config_info: the cache's settings as labels, value 1.
    [info] = [line for line in text.splitlines() if line.startswith("jengine:cache_config_info{")]
    assert info.endswith(" 1.0")
    total = metric(text, "jengine:kv_cache_total_blocks")
    for label in ('block_size="16"', 'enable_prefix_caching="True"', 'kv_cache_dtype="auto"',
                  f'num_gpu_blocks="{int(total) + 1}"'):  # fmt: skip
        assert label in info, (label, info)
    assert metric(text, "jengine:time_to_first_token_seconds_count") >= 1
    assert 'jengine:request_success_total{finished_reason="length",model_name="tiny"}' in text
    # The periodic stats line (every second here).
    deadline = time.monotonic() + 10
    while "Avg generation throughput" not in server.log_text():
        assert time.monotonic() < deadline, "no stats line in the server log"
        time.sleep(0.2)
    assert "KV cache usage" in server.log_text()


def test_request_phase_and_parameter_histograms(client, http):
    """vLLM's per-request histograms: its phases on the engine core's clock (queue, prefill,
    decode, inference = prefill + decode), its n and max_tokens, its token counts, and the
    tokens of each step."""

    def scrape():
        text = http.get("/metrics").text
        names = (
            "request_queue_time_seconds", "request_prefill_time_seconds",
            "request_decode_time_seconds", "request_inference_time_seconds",
            "request_params_n", "request_params_max_tokens", "request_prompt_tokens",
            "request_generation_tokens", "iteration_tokens_total",
        )  # fmt: skip
        figures = {
            f"{name}_{part}": metric(text, f"jengine:{name}_{part}")
            for name in names
            for part in ("count", "sum")
        }
        figures["tokens"] = metric(text, "jengine:prompt_tokens_total") + metric(
            text, "jengine:generation_tokens_total"
        )
        return figures

    before = scrape()
    response = complete(client, prompt=PROMPT, max_tokens=5, n=2, temperature=0.8, seed=1)
    num_prompt = response.usage.prompt_tokens
    after = scrape()
    delta = {name: after[name] - before[name] for name in before}
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta[f"request_{phase}_time_seconds_count"] == 2
        assert delta[f"request_{phase}_time_seconds_sum"] >= 0
    assert delta["request_prefill_time_seconds_sum"] > 0  # a forward pass at least
    assert delta["request_inference_time_seconds_sum"] == pytest.approx(
        delta["request_prefill_time_seconds_sum"] + delta["request_decode_time_seconds_sum"]
    )
    # n once a request (it was once each of its sequences, each saying n = 2), max_tokens
    # once each sequence.
    assert (delta["request_params_n_count"], delta["request_params_n_sum"]) == (1, 2)
    assert (delta["request_params_max_tokens_count"], delta["request_params_max_tokens_sum"]) == (
        2,
        10,
    )
    # A request its client leaves: the same (its sequences said n = 1 and max_tokens up to
    # the context limit).
    before = scrape()
    stream = complete(client, prompt=PROMPT, max_tokens=100, n=3, temperature=0.8, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while (after := scrape())["request_params_max_tokens_count"] < before[
        "request_params_max_tokens_count"
    ] + 3:
        assert time.monotonic() < deadline, "the left request never ended"
        time.sleep(0.05)
    assert after["request_params_n_count"] - before["request_params_n_count"] == 1
    assert after["request_params_n_sum"] - before["request_params_n_sum"] == 3
    assert after["request_params_max_tokens_sum"] - before["request_params_max_tokens_sum"] == 300
    assert delta["request_prompt_tokens_sum"] == 2 * num_prompt
    assert delta["request_generation_tokens_sum"] == response.usage.completion_tokens
    assert delta["iteration_tokens_total_sum"] == delta["tokens"]
    assert delta["iteration_tokens_total_count"] >= 1
    # A request the API process ends (a stop string in its text) has its phases too.
    text = complete(client, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].strip())
    before = scrape()
    cut = complete(client, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert scrape()["request_decode_time_seconds_count"] == (
        before["request_decode_time_seconds_count"] + 1
    )


def test_api_process_never_imports_jax_and_neither_process_torch(server):
    """torch is installed here (a test dependency), yet neither process loads it: it is
    ~2 s of each start that serving never uses."""
    with open(f"/proc/{server.proc.pid}/maps") as f:
        maps = f.read()
    assert "jaxlib" not in maps and "libtorch" not in maps
    assert "tokenizers" in maps  # the check sees the process's shared libraries
    with open(f"/proc/{server.engine_pid}/maps") as f:
        maps = f.read()
    assert "jaxlib" in maps  # ... and jax lives in the engine process
    assert "libtorch" not in maps
    assert os.getpgid(server.engine_pid)  # still running
