"""OpenAI's Responses API on a real model: `jengine serve smollm2` driven by the official
`openai` client's `responses.create`: a plain answer equal to the chat route's, a streamed
one whose events come in order and whose deltas join to the full text, a function tool
round trip (the call, then its output sent back as an input item), a JSON-schema text
format, logprobs equal to the chat route's (whole and streamed), vLLM's extra fields as
the chat route takes them, cached input tokens
counted as the chat and completion routes count them (--enable-prompt-tokens-details), and
the clear 400s for what jengine does not keep (stored responses)."""

import json

import jsonschema
import openai
import pytest

from tests.entrypoints.remote_server import RemoteServer
from tests.entrypoints.test_smollm2_chat import GET_WEATHER, LIMITS, QUESTION

WEATHER = {"type": "function", **GET_WEATHER}  # the Responses API's flat form


@pytest.fixture(scope="module")
def client():
    flags = [*LIMITS, "--disable-uvicorn-access-log", "--enable-prompt-tokens-details"]
    with RemoteServer("smollm2", flags) as server:
        yield openai.OpenAI(base_url=server.url_for("v1"), api_key="unused", max_retries=0)


def respond(client, **kwargs):
    return client.responses.create(model="smollm2", **{"temperature": 0, **kwargs})


def test_a_plain_response_is_the_chat_answer(client):
    response = respond(client, input=QUESTION, max_output_tokens=32)
    assert response.id.startswith("resp") and response.status == "completed"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert "Paris" in response.output_text
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=32,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0  # no reasoning parser
    salted = respond(client, input=QUESTION, max_output_tokens=32, extra_body={"cache_salt": "s"})
    assert salted.output_text == response.output_text
    # The sampling knobs used, the model's defaults where none was asked (they were null).
    defaults = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=1)
    assert (defaults.temperature, defaults.top_p) == (1.0, 1.0)
    # The text format echoed as OpenAI's: its type alone (a "name" came with every one).
    assert defaults.text.to_dict() == {"format": {"type": "text"}}
    text = {"format": {"type": "json_object"}}
    assert respond(client, input=QUESTION, max_output_tokens=1, text=text).text.to_dict() == text


def test_vllms_extra_fields_apply_as_on_the_chat_route(client):
    template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
    extra = {"chat_template": template, "top_k": 1, "repetition_penalty": 1.3}
    response = respond(client, input=QUESTION, max_output_tokens=12, temperature=1.0,
                       extra_body=extra)  # fmt: skip
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
        temperature=0, extra_body={"chat_template": template, "repetition_penalty": 1.3},
    )  # fmt: skip
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content  # top_k 1 is greedy


def test_instructions_and_message_items_are_the_chat_messages(client):
    blue = [{"type": "output_text", "text": "Blue."}]
    # Several text parts join with newlines, as on the chat route (they were run together).
    question = [{"type": "input_text", "text": part} for part in QUESTION.split(" ", 1)]
    items = [
        {"role": "user", "content": "Name a colour."},
        {"type": "message", "role": "assistant", "content": blue},
        {"role": "user", "content": question},
    ]
    response = respond(client, instructions="Answer in one sentence.", input=items,
                       max_output_tokens=24)  # fmt: skip
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[
            {"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": QUESTION.replace(" ", "\n", 1)},
        ],
        temperature=0,
        max_tokens=24,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_cached_input_tokens_are_counted_on_every_route(client):
    """The prefix cache's share of a prompt, as usage tells it: 0 the first time (a salt no
    other test uses), the prompt's full blocks after; the same on the chat route (whole and
    streamed), and summed over a batch of completion prompts."""
    salt = {"cache_salt": "usage-details"}
    first = respond(client, input=QUESTION, max_output_tokens=2, extra_body=salt)
    assert first.usage.input_tokens_details.cached_tokens == 0
    again = respond(client, input=QUESTION, max_output_tokens=2, extra_body=salt)
    cached = again.usage.input_tokens_details.cached_tokens
    assert 0 < cached < again.usage.input_tokens
    events = list(respond(client, input=QUESTION, max_output_tokens=2, extra_body=salt,
                          stream=True))  # fmt: skip
    assert events[-1].response.usage.input_tokens_details.cached_tokens == cached
    messages = [{"role": "user", "content": QUESTION}]
    kwargs = dict(model="smollm2", messages=messages, max_tokens=2, extra_body=salt)
    chat = client.chat.completions.create(**kwargs)
    assert chat.usage.prompt_tokens_details.cached_tokens == cached
    usage_chunk = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = list(client.chat.completions.create(**kwargs, **usage_chunk))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    other_salt = client.chat.completions.create(**{**kwargs, "extra_body": {"cache_salt": "x"}})
    assert other_salt.usage.prompt_tokens_details.cached_tokens == 0
    long_prompt = dict(model="smollm2", prompt=QUESTION * 4, max_tokens=1, extra_body=salt)
    client.completions.create(**{**long_prompt, "prompt": [QUESTION * 4] * 2})  # now cached
    batch = client.completions.create(**{**long_prompt, "prompt": [QUESTION * 4] * 2})
    one = client.completions.create(**long_prompt).usage.prompt_tokens_details.cached_tokens
    assert one > 0 and batch.usage.prompt_tokens_details.cached_tokens == 2 * one


def test_a_cut_off_response_is_incomplete(client):
    """The response and the message item it cut short are "incomplete", whole and streamed."""
    response = respond(client, input=QUESTION, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    assert [item.status for item in response.output] == ["incomplete"]
    events = list(respond(client, input=QUESTION, max_output_tokens=3, stream=True))
    [done] = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.status == "incomplete" and events[-1].type == "response.incomplete"
    assert [item.status for item in events[-1].response.output] == ["incomplete"]
    # A function call cut short is "incomplete" too (its arguments are not whole: it said
    # "completed"), streamed (OpenAI's stream_options taken) or not.
    forced = dict(input="What is the weather like in Tokyo today?", tools=[WEATHER],
                  tool_choice="required", max_output_tokens=6)  # fmt: skip
    [call] = respond(client, **forced).output
    assert call.type == "function_call" and call.status == "incomplete"
    events = list(
        respond(client, **forced, stream=True, stream_options={"include_obfuscation": False})
    )
    assert [item.status for item in events[-1].response.output] == ["incomplete"]


def test_a_reply_of_nothing_is_an_empty_message(client):
    """A reply a stop string ends before any text is one message item of "" (there was
    no item), as the chat route's `content: ""`, whole and streamed."""
    first_word = respond(client, input=QUESTION, max_output_tokens=4).output_text.split()[0]
    stopped = dict(input=QUESTION, max_output_tokens=8, extra_body={"stop": [first_word]})
    for output in (
        respond(client, **stopped).output,
        list(respond(client, **stopped, stream=True))[-1].response.output,
    ):
        [message] = output
        assert message.type == "message" and message.content[0].text == ""


def test_streamed_events_come_in_order_and_join_to_the_text(client):
    whole = respond(client, input=QUESTION, max_output_tokens=32)
    events = list(respond(client, input=QUESTION, max_output_tokens=32, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in deltas) and final.output[0].id == item_id


def test_logprobs_are_the_chat_routes_whole_and_streamed(client):
    include = ["message.output_text.logprobs"]
    response = respond(client, input=QUESTION, max_output_tokens=16, include=include,
                       top_logprobs=2)  # fmt: skip
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=16,
        logprobs=True,
        top_logprobs=2,
    )
    expected = chat.choices[0].logprobs.content
    [part] = response.output[0].content
    assert [e.token for e in part.logprobs] == [e.token for e in expected]
    for ours, chats in zip(part.logprobs, expected, strict=True):
        assert abs(ours.logprob - chats.logprob) < 1e-4
        assert [t.token for t in ours.top_logprobs] == [t.token for t in chats.top_logprobs]
        assert ours.top_logprobs[0].token == ours.token  # greedy
    events = list(respond(client, input=QUESTION, max_output_tokens=16, include=include,
                          top_logprobs=2, stream=True))  # fmt: skip
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [entry.token for e in deltas for entry in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response.output[0].content[0]
    assert streamed == [e.token for e in done.logprobs] == [e.token for e in final.logprobs]
    assert streamed[: len(part.logprobs)] == [e.token for e in part.logprobs]
    plain = respond(client, input=QUESTION, max_output_tokens=4)
    assert plain.output[0].content[0].logprobs == []


def test_a_function_tool_round_trip(client):
    question = "What is the weather like in Tokyo today?"
    response = respond(client, input=question, tools=[WEATHER], tool_choice="required",
                       max_output_tokens=60)  # fmt: skip
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] == "Tokyo"
    assert response.tools[0].name == "get_weather" and response.tool_choice == "required"

    streamed = list(respond(client, input=question, tools=[WEATHER], tool_choice="required",
                            max_output_tokens=60, stream=True))  # fmt: skip
    [added] = [e for e in streamed if e.type == "response.output_item.added"]
    assert added.item.type == "function_call"
    [done] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments
    assert streamed[-1].response.output[0].arguments == call.arguments
    # One creation time, when the request was taken (each event's was its own moment).
    assert len({e.response.created_at for e in streamed if hasattr(e, "response")}) == 1

    result = {"temperature_c": 21, "sky": "clear"}
    follow_up = [
        {"role": "user", "content": question},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps(result)},
    ]  # fmt: skip
    answer = respond(client, input=follow_up, tools=[WEATHER], tool_choice="none",
                     max_output_tokens=40)  # fmt: skip
    [message] = answer.output
    assert message.type == "message" and answer.output_text
    # The call and its result reached the prompt.
    assert answer.usage.input_tokens > response.usage.input_tokens + 10


def test_a_json_schema_text_format_validates(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}}
    response = respond(client, input="Give the capital of France as JSON.", text=text,
                       max_output_tokens=60)  # fmt: skip
    answer = json.loads(response.output_text)
    jsonschema.validate(answer, schema)
    assert "Paris" in answer["city"]
    assert response.text.to_dict() == text


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(input=QUESTION, store=True), "store"),
        (dict(input=QUESTION, previous_response_id="resp-123"), "previous_response_id"),
        (dict(input=QUESTION, conversation="conv-123"), "conversation"),
        (dict(input=[{"type": "file_search_call", "id": "x"}]), "input.0.type"),
        (
            dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
            "input.0.content.0",
        ),  # fmt: skip
        (dict(input=[{"type": "function_call_output", "output": "{}"}]), "input.0.call_id"),
        (dict(input=QUESTION, tools=[WEATHER], tool_choice="auto"), "tool_choice"),
        (dict(input=QUESTION, extra_body={"cache_salt": ""}), "cache_salt"),
        # The chat fields they become are not what the client sent.
        (
            dict(input=QUESTION, text={"format": {"type": "json_schema", "name": "x"}}),
            "text.format",
        ),
        (
            dict(
                input=QUESTION,
                text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}},
            ),
            "text.format",
        ),
        (dict(input=QUESTION, max_output_tokens=10**6), "max_output_tokens"),
        # Chat fields a response has no place for, and what no route serves.
        (dict(input=QUESTION, extra_body={"n": 2}), "n"),
        (dict(input=QUESTION, extra_body={"max_tokens": 5}), "max_tokens"),
        (dict(input=QUESTION, extra_body={"use_beam_search": True}), "use_beam_search"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        respond(client, **kwargs)
    assert caught.value.body["param"] == param
