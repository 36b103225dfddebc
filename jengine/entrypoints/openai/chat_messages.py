"""A chat request's messages as chat templates take them.

Where it sits: serving_chat.py (and /tokenize through it) turns the validated
`ChatMessageParam`s into plain dicts just before rendering the template. Promises: text
content parts joined by newlines (any other part is a 400 naming the message), and the
fields templates read (`name`, `tool_call_id`, `tool_calls`) with each call's arguments as
a mapping where they are a JSON object, since templates iterate them (`| tojson`,
`.items()`)."""

import json

from jengine.engine.input_processor import text_of_content
from jengine.entrypoints.openai.protocol import OpenAIError
from jengine.entrypoints.openai.protocol_chat import ChatMessageParam


def template_messages(message_params: list[ChatMessageParam]) -> list[dict]:
    return [_template_message(index, m) for index, m in enumerate(message_params)]


def _template_message(index: int, message: ChatMessageParam) -> dict:
    try:
        content = text_of_content(message.content)
    except ValueError as e:
        raise OpenAIError(str(e), param=f"messages.{index}.content") from None
    entry = {"role": message.role, "content": content}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments_object(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    return entry


def _arguments_object(arguments: str):
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments
