"""`jengine serve --enable-auto-tool-choice --tool-call-parser P` through the official openai
client, on a model scripted to reply in each parser's format: the reply's calls come back as
`tool_calls` (whole, streamed, and as the Responses API's function calls) with their markers
special tokens, as some checkpoints make them; a plain reply stays content. (The parsers'
other formats: test_tool_parsers.py.)"""

import json

import openai
import pytest

from tests.entrypoints.remote_server import MODEL_NAME, SERVER_ARGS, RemoteServer
from tests.entrypoints.scripted_model import make_scripted_model

CALL = {"city": "Paris; France"}
WEATHER = {"name": "get_weather", "arguments": CALL}
SCRIPTS = {
    "hermes": ["Let me check.", "<tool_call>", json.dumps(WEATHER), "</tool_call>"],
    "mistral": ["[TOOL_CALLS]", json.dumps([WEATHER])],
    "plain": ["It is ", "sunny."],
    # Two calls, each one piece of text (the markers in them are not the special tokens).
    "twice_hermes": [f"<tool_call>{json.dumps(dict(WEATHER, arguments={'city': c}))}</tool_call>"
                     for c in ("A", "B")],
    "twice_mistral": ["[TOOL_CALLS]" + json.dumps([dict(WEATHER, arguments={"city": "A"}),
                                                   dict(WEATHER, arguments={"city": "B"})])],
}  # fmt: skip
# Special tokens, as in Hermes-2-Pro's and Mistral's tokenizers.
SPECIAL = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")
CONTENT = {"hermes": "Let me check.", "mistral": None}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("scripted_model"))
    return make_scripted_model(path, {name.upper(): s for name, s in SCRIPTS.items()}, SPECIAL)


@pytest.fixture(scope="module", params=["hermes", "mistral"])
def served(request, scripted_model):
    args = ["--enable-auto-tool-choice", "--tool-call-parser", request.param]
    with RemoteServer(scripted_model, [*SERVER_ARGS, *args]) as server:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="EMPTY")
        yield request.param, client


def _chat(client, trigger: str, **kwargs):
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": trigger}],
        tools=TOOLS,
        temperature=0.0,
        max_tokens=8,
        **kwargs,
    )


def test_a_reply_in_the_parsers_format_is_a_tool_call(served):
    parser, client = served
    choice = _chat(client, parser.upper()).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CONTENT[parser]
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", CALL)

    content, calls, finish_reasons = "", {}, []
    for chunk in _chat(client, parser.upper(), stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            name, arguments = calls.get(call.index, ("", ""))
            calls[call.index] = (
                name + (call.function.name or ""),
                arguments + call.function.arguments,
            )
        finish_reasons.append(chunk.choices[0].finish_reason)
    assert (content or None) == CONTENT[parser]
    assert [(name, json.loads(args)) for name, args in calls.values()] == [("get_weather", CALL)]
    assert finish_reasons[-1] == "tool_calls"

    response = client.responses.create(model=MODEL_NAME, input=parser.upper(), tools=[
        {"type": "function", **TOOLS[0]["function"]}
    ], temperature=0.0, max_output_tokens=8)  # fmt: skip
    [call] = [item for item in response.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", CALL)


def test_parallel_tool_calls_false_keeps_the_first_call(served):
    """OpenAI's `parallel_tool_calls: false`: at most one call, whole and streamed (vLLM
    keeps the first); by default, every call the reply makes."""
    parser, client = served
    trigger = f"TWICE_{parser.upper()}"

    def cities(tool_calls) -> list[str]:
        return [json.loads(call.function.arguments)["city"] for call in tool_calls]

    assert cities(_chat(client, trigger).choices[0].message.tool_calls) == ["A", "B"]
    choice = _chat(client, trigger, parallel_tool_calls=False).choices[0]
    assert cities(choice.message.tool_calls) == ["A"] and choice.finish_reason == "tool_calls"
    indexes = {
        call.index
        for chunk in _chat(client, trigger, parallel_tool_calls=False, stream=True)
        for call in chunk.choices[0].delta.tool_calls or []
    }
    assert indexes == {0}


def test_a_plain_reply_stays_content_and_markers_only_matter_with_tools(served):
    parser, client = served
    choice = _chat(client, "PLAIN").choices[0]
    assert (choice.message.content, choice.message.tool_calls) == ("It is sunny.", [])
    assert choice.finish_reason == "stop"
    # Without tools the reply is decoded as any other: its special tokens are skipped.
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": parser.upper()}],
        temperature=0.0, max_tokens=8,
    )  # fmt: skip
    assert reply.choices[0].message.content == "".join(
        piece for piece in SCRIPTS[parser] if piece not in SPECIAL
    )
