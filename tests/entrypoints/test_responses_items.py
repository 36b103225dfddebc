"""The Responses API's items without a server: a reply with reasoning, text and tool calls
becomes items in the order the model wrote them, whole and streamed (the streamed events
numbered, each item opened before its deltas and closed once before the next opens, the
final items equal to the whole reply's); input items become the chat messages the template gets."""

import json

import pytest

from jengine.entrypoints.openai.protocol import OpenAIError
from jengine.entrypoints.openai.protocol_chat import (
    ChatMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from jengine.entrypoints.openai.protocol_responses import ResponsesRequest
from jengine.entrypoints.openai.responses_items import (
    Events,
    StreamedItems,
    chat_messages,
    output_items,
)


def _events(frames: list[str]) -> list[dict]:
    parsed = []
    for frame in frames:
        event_line, data_line = frame.strip().split("\n")
        body = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {body['type']}"
        parsed.append(body)
    return parsed


def test_a_reply_with_reasoning_text_and_calls_streams_into_the_same_items():
    call = ToolCall(id="call-1", function=FunctionCall(name="get_weather", arguments='{"c": 1}'))
    whole = output_items(
        ChatMessage(
            role="assistant", content="Hi there", reasoning_content="Think", tool_calls=[call]
        )
    )
    assert [item["type"] for item in whole] == ["reasoning", "message", "function_call"]

    items = StreamedItems(Events())
    frames = [*items.feed("Th", None), *items.feed("ink", "Hi"), *items.feed(None, " there")]
    items.add_call_delta(
        DeltaToolCall(index=0, id="call-1", function=DeltaFunctionCall(name="get_weather"))
    )
    items.add_call_delta(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"c": 1}')))
    frames += items.finish()
    events = _events(frames)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.output_item.added",  # reasoning
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",  # closed before the next item opens, as OpenAI's
        "response.output_item.done",
        "response.output_item.added",  # message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # function call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [
        0,
        1,
        2,
    ]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    for streamed, full in zip(done, whole, strict=True):
        assert {k: v for k, v in streamed.items() if k != "id"} == {
            k: v for k, v in full.items() if k != "id"
        }
    assert items.output == done


def test_input_items_become_chat_messages():
    request = ResponsesRequest(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use metric units."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather?"}],
            },
            {"type": "reasoning", "id": "rs-1", "summary": []},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "a", "output": "1"},
        ],
    )
    messages = chat_messages(request)
    roles = [m["role"] for m in messages]
    assert roles == ["system", "developer", "user", "assistant", "tool"]  # as the chat route
    assert messages[2]["content"] == "Weather?"
    assert [c["id"] for c in messages[3]["tool_calls"]] == ["a", "b"]  # one assistant turn
    assert messages[4] == {"role": "tool", "tool_call_id": "a", "content": "1"}
    assert chat_messages(ResponsesRequest(input="Hi")) == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "item, param",
    [
        ({"role": "critic", "content": "x"}, "input.0.role"),
        ({"type": "function_call", "name": "f"}, "input.0.call_id"),
        ({"role": "user", "content": 7}, "input.0.content"),
        ({"type": "web_search_call", "id": "w"}, "input.0.type"),
    ],
)
def test_items_it_cannot_take_name_themselves(item, param):
    with pytest.raises(OpenAIError) as caught:
        chat_messages(ResponsesRequest(input=[item]))
    assert caught.value.param == param
