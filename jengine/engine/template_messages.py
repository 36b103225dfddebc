"""Chat messages as chat templates take them, the same for the chat route and `LLM.chat`.

Where it sits: `InputProcessor.render_chat` converts every message with `template_message`
before the template runs; the API process's `openai/chat_messages.py` converts its
validated messages through it first, to name a bad part's place in the request, and the
Responses API reads its items' text with `text_of_content`. Jax-free.

Promises: text content parts (OpenAI's `text`, the Responses API's `input_text` /
`output_text`, an assistant's `refusal`) joined by newlines, as vLLM joins them; null
content as empty text; any other part a `ContentPartError` naming its index; each tool
call's arguments as a mapping where they are a JSON object's text, since templates
iterate them (`| tojson`, `.items()`).
"""

import json

# OpenAI's text content parts (chat's, the Responses API's, an assistant's refusal) and the
# field each holds its text in; vLLM reads them all as text.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


class ContentPartError(ValueError):
    """A content part that is not text; `index` is its place in the content list."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def text_of_content(content: str | list[dict] | None) -> str:
    """A message's content as templates take it: OpenAI's text parts joined by newlines
    (None: empty); a ContentPartError names the first part of another kind."""
    if not isinstance(content, list):
        return content or ""
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        text = part.get(TEXT_PARTS[kind]) if kind in TEXT_PARTS else None
        if not isinstance(text, str):
            raise ContentPartError(
                index, f"content parts of type {kind!r} are not supported (text only)"
            )
        texts.append(text)
    return "\n".join(texts)


def template_message(message: dict) -> dict:
    """One chat message as templates read it (the chat route's and `LLM.chat`'s): its
    content as text, and each tool call's arguments as a mapping where they are a JSON
    object's text, since templates iterate them (`| tojson`, `.items()`)."""
    if not isinstance(message, dict):
        raise ValueError(f"messages must be dicts with a role and content, got {message!r}")
    entry = {**message, "content": text_of_content(message.get("content"))}
    if message.get("tool_calls"):
        entry["tool_calls"] = [_with_arguments_object(call) for call in message["tool_calls"]]
    return entry


def _with_arguments_object(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}
