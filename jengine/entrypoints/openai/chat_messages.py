"""A chat request's messages as chat templates take them.

Where it sits: serving_chat.py (and /tokenize through it) turns the validated
`ChatMessageParam`s into plain dicts just before rendering the template. Promises: the
fields templates read (`name`, `tool_call_id`, `tool_calls`), converted as `LLM.chat`
converts its dicts (`template_messages.template_message`: text content parts joined by
newlines, each call's arguments as a mapping), and any part that is not text a 400 naming
it."""

from jengine.engine.template_messages import ContentPartError, template_message
from jengine.entrypoints.openai.protocol import OpenAIError
from jengine.entrypoints.openai.protocol_chat import ChatMessageParam


def template_messages(message_params: list[ChatMessageParam]) -> list[dict]:
    return [_template_message(index, m) for index, m in enumerate(message_params)]


def _template_message(index: int, message: ChatMessageParam) -> dict:
    entry = {"role": message.role, "content": message.content}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": call.id, "type": "function", "function": call.function.model_dump()}
            for call in message.tool_calls
        ]
    try:
        return template_message(entry)
    except ContentPartError as e:
        raise OpenAIError(str(e), param=f"messages.{index}.content.{e.index}") from None
