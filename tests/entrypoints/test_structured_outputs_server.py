"""Structured outputs and tools over HTTP with the official `openai` client, on the tiny
random-weight model (whose free output is noise, so only the constraint can make it
valid): `response_format` json_schema and json_object's routes, vLLM's
`structured_outputs` and `guided_*` fields, `tools` with tool_choice "required" and a
named function (arguments validate against the function's parameters), streamed and not,
n > 1; tool-result messages in the history; bad constraints are 400s naming the field;
with `--reasoning-parser`, reasoning_content, streamed and not, and constraints that start
where the reply's answer does."""

import json
import re

import jsonschema
import openai
import pytest

from tests.engine.test_structured_outputs import GRAMMAR, GRAMMAR_LANGUAGE, REGEX
from tests.entrypoints.remote_server import MODEL_NAME, SERVER_ARGS, RemoteServer

# Small enough for the serving tests' 128-token context.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
    "$defs": {"tag": {"enum": ["red", "blue"]}},
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
OPENS_THINKING = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: <think>\n"
)


@pytest.fixture(scope="module")
def server(tiny_model):
    with RemoteServer(tiny_model, SERVER_ARGS) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url_for("v1"), api_key="none", max_retries=0, timeout=120)


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, **kwargs)  # to the context's end


def streamed_chat(client, **kwargs) -> tuple[dict[int, str], dict[int, dict], dict[int, str]]:
    """Per choice: joined content, tool calls {index: [name, arguments]}, finish reason."""
    content, calls, finish = {}, {}, {}
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content[choice.index] = content.get(choice.index, "") + (delta.content or "")
            for call in delta.tool_calls or []:
                entry = calls.setdefault(choice.index, {}).setdefault(call.index, ["", ""])
                if call.function.name:
                    entry[0] = call.function.name
                entry[1] += call.function.arguments or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return content, calls, finish


def test_response_format_json_schema(client):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    reply = chat(client, messages=MESSAGES, response_format=response_format, n=2, seed=3,
                 temperature=1.0)  # fmt: skip
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop"
    greedy = dict(messages=MESSAGES, response_format=response_format, temperature=0.0)
    whole = chat(client, **greedy).choices[0].message.content
    content, _, finish = streamed_chat(client, **greedy)
    assert content[0] == whole and finish[0] == "stop"
    jsonschema.validate(json.loads(whole), PERSON)


def test_vllm_fields_on_completions(client):
    def complete(**extra):
        return client.completions.create(
            model=MODEL_NAME, prompt="Answer:", max_tokens=100, temperature=1.0, seed=5, n=3,
            extra_body=extra,
        ).choices  # fmt: skip

    for choice in complete(structured_outputs={"regex": REGEX}):
        assert re.fullmatch(REGEX, choice.text)
    for choice in complete(guided_regex=REGEX):
        assert re.fullmatch(REGEX, choice.text)
    for choice in complete(guided_choice=["alpha", "beta"]):
        assert choice.text in ("alpha", "beta")
    for choice in complete(guided_grammar=GRAMMAR):
        assert GRAMMAR_LANGUAGE.fullmatch(choice.text)
    for choice in complete(guided_json=PERSON):
        jsonschema.validate(json.loads(choice.text), PERSON)
    # A stream joins into the same text.
    kwargs = dict(model=MODEL_NAME, prompt="Answer:", max_tokens=60, temperature=0.0,
                  extra_body={"guided_regex": REGEX})  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices
    )
    assert streamed == whole and re.fullmatch(REGEX, whole)


def test_tool_choice_required(client):
    kwargs = dict(messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    # One call each: sampled, the random model may open a second call that the 128-token
    # context cannot hold (it then ends "length", as a real model would there).
    reply = chat(client, temperature=1.0, seed=11, n=3, parallel_tool_calls=False, **kwargs)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    whole = chat(client, temperature=0.0, **kwargs).choices[0]
    content, calls, finish = streamed_chat(client, temperature=0.0, **kwargs)
    assert finish[0] == "tool_calls" and content[0] == ""
    assert [(name, json.loads(args)) for _, (name, args) in sorted(calls[0].items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]


def test_tool_choice_named(client):
    kwargs = dict(
        messages=MESSAGES,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    for choice in chat(client, temperature=1.0, seed=2, n=2, **kwargs).choices:
        [call] = choice.message.tool_calls
        # OpenAI's (and vLLM's) finish_reason for a named function: "stop".
        assert call.function.name == "get_time" and choice.finish_reason == "stop"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_time"])
    _, calls, finish = streamed_chat(client, temperature=0.0, **kwargs)
    [(name, arguments)] = calls[0].values()
    assert name == "get_time" and finish[0] == "stop"
    jsonschema.validate(json.loads(arguments), PARAMETERS["get_time"])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_cut_by_max_tokens_is_still_a_call(client, tool_choice):
    """Cut three tokens before its end, a forced call comes back as a tool call with the
    arguments written so far and finish_reason "length", streamed and not; never as
    content."""
    kwargs = dict(messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice,
                  temperature=0.0)  # fmt: skip
    whole = chat(client, **kwargs)
    [full_call] = whole.choices[0].message.tool_calls
    cut = dict(kwargs, max_tokens=whole.usage.completion_tokens - 3)
    choice = chat(client, **cut).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == full_call.function.name and call.id
    assert full_call.function.arguments.startswith(call.function.arguments)
    assert call.function.arguments != full_call.function.arguments
    content, calls, finish = streamed_chat(client, **cut)
    assert content[0] == "" and finish[0] == "length"
    assert list(calls[0].values()) == [[call.function.name, call.function.arguments]]
    # Cut by a stop string inside the arguments: the call as far as it got, with
    # finish_reason "stop" and that stop string; "tool_calls" would say the calls are whole.
    arguments, head = full_call.function.arguments, '[{"name": "get_weather", "parameters":'
    at = next(
        i
        for i in range(len(arguments) // 2, len(arguments) - 3)
        if arguments.find(window := arguments[i : i + 3]) == i and window not in head
    )
    stop = arguments[at : at + 3]
    choice = chat(client, **kwargs, stop=[stop]).choices[0]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop)
    [call] = choice.message.tool_calls
    assert call.function.arguments == arguments[:at].rstrip()
    content, calls, finish = streamed_chat(client, **kwargs, stop=[stop])
    assert finish[0] == "stop"
    assert list(calls[0].values()) == [[call.function.name, call.function.arguments]]


def test_tool_parameters_must_be_an_object_schema(client):
    """OpenAI's rule: a function's parameters are an object's schema (a "required" call
    under a string schema was a success with no call)."""
    tool = {"type": "function", "function": {"name": "say", "parameters": {"type": "string"}}}
    for tool_choice in ("required", "auto", "none"):
        with pytest.raises(openai.BadRequestError) as refused:
            chat(client, messages=MESSAGES, tools=[tool], tool_choice=tool_choice)
        assert refused.value.body["param"] == "tools.0.function.parameters"
        assert 'type "object"' in refused.value.body["message"]


def test_tool_messages_in_the_history(client):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    reply = chat(client, messages=history, tools=[WEATHER_TOOL], tool_choice="none")
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_tool_choice_none_still_shows_the_template_its_tools(client):
    """vLLM's default: tool_choice "none" forbids calls, yet the template still sees the
    tools (`--exclude-tools-when-tool-choice-none` leaves them out)."""
    names = "{% for t in tools or [] %} {{ t.function.name }}{% endfor %}"
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}" + names

    def prompt_tokens(**kwargs) -> int:
        body = dict(messages=MESSAGES, max_tokens=1, extra_body={"chat_template": template})
        return chat(client, **body, **kwargs).usage.prompt_tokens

    assert prompt_tokens(tools=[WEATHER_TOOL], tool_choice="none") > prompt_tokens()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"extra_body": {"guided_json": {"type": "objekt"}}}, "guided_json"),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
         "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        # A schema the grammar compiler refuses names the field it came in.
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "objekt"}}}}}],
          "tool_choice": "required"}, "tools"),
        ({"extra_body": {"guided_regex": "a"}, "response_format": {"type": "json_object"}},
         "guided_regex"),
        ({"tools": [WEATHER_TOOL]}, "tool_choice"),  # "auto" needs the server flags
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                   "function": {"name": "nope"}}},
         "tool_choice"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, messages=MESSAGES, **kwargs)
    assert error.value.body["param"] == param, error.value.body
    assert chat(client, messages=MESSAGES, max_tokens=4).choices[0].message.content is not None


def test_a_constraint_the_vocabulary_cannot_meet_is_an_error(client):
    """The tiny vocabulary is printable ASCII: a constraint needing "é" cannot begin (a 400
    naming why, since nothing ran; an error event when streamed), and one that needs it
    after "abb" fails mid-way (a 500, an error event); never a 200 with empty content."""

    def complete(regex, **kwargs):
        return client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=16,
                                         temperature=0.0, extra_body={"guided_regex": regex},
                                         **kwargs)  # fmt: skip

    for regex, error_type, code in (("é+", openai.BadRequestError, 400),
                                    ("ab{2}é", openai.InternalServerError, 500)):  # fmt: skip
        with pytest.raises(error_type) as error:
            complete(regex)
        assert "cannot be met with this model's vocabulary" in error.value.body["message"]
        with pytest.raises(openai.APIError) as streamed:
            list(complete(regex, stream=True))
        assert streamed.value.body["code"] == code
        assert "cannot be met" in streamed.value.body["message"]
    assert re.fullmatch("ab{2}", complete("ab{2}").choices[0].text)  # the engine carries on


def test_reasoning_content(tiny_model):
    """deepseek_r1: the prompt opens the thinking, so a reply without `</think>` is all
    reasoning (and all its tokens are reasoning tokens); streamed, the deltas join into the
    same reasoning."""
    args = [*SERVER_ARGS, "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes"]  # fmt: skip
    with RemoteServer(tiny_model, args) as server:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none", max_retries=0)
        kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0.0)
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.reasoning_content and message.content is None
        # The same with tools the reply could call (its content was "" then).
        called = client.chat.completions.create(**kwargs, tools=[WEATHER_TOOL])
        assert called.choices[0].message == message
        reasoning = "".join(
            getattr(c.choices[0].delta, "reasoning_content", None) or ""
            for c in client.chat.completions.create(stream=True, **kwargs)
            if c.choices
        )
        assert reasoning == message.reasoning_content
        # vLLM's include_reasoning=False leaves it out, whole and streamed.
        hidden = dict(**kwargs, extra_body={"include_reasoning": False})
        message = client.chat.completions.create(**hidden).choices[0].message
        assert message.reasoning_content is None and message.content is None
        chunks = [c for c in client.chat.completions.create(stream=True, **hidden) if c.choices]
        assert not any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        # The Responses API counts the reply's tokens as reasoning, whole and streamed.
        reply = dict(model=MODEL_NAME, input="Hi", max_output_tokens=12, temperature=0.0)
        usage = client.responses.create(**reply).usage
        assert usage.output_tokens == 12 and usage.output_tokens_details.reasoning_tokens == 12
        events = list(client.responses.create(stream=True, **reply))
        usage = events[-1].response.usage
        assert usage.output_tokens == 12 and usage.output_tokens_details.reasoning_tokens == 12
        # The Responses API's logprobs would mix the reasoning's tokens with the answer's.
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL_NAME, input="Hi", top_logprobs=1)
        assert refused.value.body["param"] == "include"


def _vocab_size(model_path: str) -> int:
    with open(f"{model_path}/config.json") as f:
        return json.load(f)["vocab_size"]


def test_a_constraint_starts_where_the_answer_does(tiny_model):
    """qwen3: a reply to a prompt without `<think>` is all answer, so the constraint holds
    from its first token (it once waited for a `</think>` that never came: free noise, and
    a required tool call with no call). Where it waits: test_tool_parsers.py."""
    # vLLM flags beside: a role of its own, one whose purpose jengine meets anyway, and
    # logprobs over the whole vocabulary.
    args = [*SERVER_ARGS, "--reasoning-parser", "qwen3", "--response-role", "model",
            "--trust-remote-code", "--max-logprobs", "-1"]  # fmt: skip
    with RemoteServer(tiny_model, args) as server:
        assert "--trust-remote-code changes nothing" in server.log_text()
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none", max_retries=0)
        schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0.0)
        message = client.chat.completions.create(**kwargs, response_format=schema)
        jsonschema.validate(json.loads(message.choices[0].message.content), PERSON)
        assert message.choices[0].message.role == "model"
        # A truncated prompt, which loses its text, is read from its tokens (it was a 500).
        kept = client.chat.completions.create(
            **kwargs, response_format=schema, extra_body={"truncate_prompt_tokens": 12}
        )
        jsonschema.validate(json.loads(kept.choices[0].message.content), PERSON)
        # --max-logprobs -1: a request may ask for the whole vocabulary's (-1, as vLLM's).
        vocab = _vocab_size(tiny_model)
        short = {**kwargs, "max_tokens": 2}
        every = client.chat.completions.create(**short, logprobs=True, top_logprobs=-1)
        assert len(every.choices[0].logprobs.content[0].top_logprobs) == vocab > 20
        echoed = client.completions.create(
            model=MODEL_NAME, prompt="a b c", max_tokens=1, echo=True, logprobs=-1,
            extra_body={"return_tokens_as_token_ids": True},  # distinct keys for the dicts
        ).choices[0].logprobs  # fmt: skip
        assert {len(row) for row in echoed.top_logprobs[1:]} == {vocab}
        called = (
            client.chat.completions.create(**kwargs, tools=[WEATHER_TOOL], tool_choice="required")
            .choices[0]
            .message.tool_calls
        )
        assert len(called) >= 1 and called[0].function.name == "get_weather"
        # A template that opens `<think>` itself (Qwen3-2507's thinking models): the reply
        # only closes it, so all of this one (which never does) is reasoning, whole and
        # streamed; it was shown as the answer.
        opened = {"chat_template": OPENS_THINKING}
        kwargs["max_tokens"] = 12
        whole = client.chat.completions.create(**kwargs, extra_body=opened).choices[0].message
        assert whole.content is None and whole.reasoning_content
        stream = client.chat.completions.create(**kwargs, extra_body=opened, stream=True)
        deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (
            whole.reasoning_content
        )
        assert not any(d.content for d in deltas)
