"""The Responses API's items: input items as chat messages, and a chat reply (whole, or as
its stream's deltas) as output items and their server-sent events.

Where it sits: serving_responses.py calls `chat_messages` on the way in and
`output_items` / `StreamedItems` on the way out; nothing here runs the engine.
"""

import json
from dataclasses import dataclass, field

import pydantic

from jengine.engine.template_messages import ContentPartError, text_of_content
from jengine.entrypoints.openai.protocol import OpenAIError, random_id
from jengine.entrypoints.openai.protocol_chat import ChatCompletionLogProbs, ChatMessage
from jengine.entrypoints.openai.protocol_responses import ResponsesRequest

# -- items ------------------------------------------------------------------------------------


def output_items(
    message: ChatMessage, logprobs: ChatCompletionLogProbs | None = None, cut_short: bool = False
) -> list[dict]:
    """A chat reply as Responses output items, in the order the model wrote them; the
    reply's `logprobs` go on the message's text. `cut_short` (max_output_tokens ended the
    reply): the item it ended, the last, is "incomplete", as OpenAI's (a function call's
    arguments then are not whole). A reply of nothing (EOS at once) is an empty message,
    as the chat route's `content: ""`."""
    items = []
    if message.reasoning_content:
        items.append(_reasoning_item(message.reasoning_content))
    if message.content or not (items or message.tool_calls):
        items.append(_message_item(message.content or "", logprobs=_entries(logprobs)))
    for call in message.tool_calls or []:
        items.append(_function_call_item(call.id, call.function.name, call.function.arguments))
    if cut_short:
        items[-1]["status"] = "incomplete"
    return items


def _reasoning_item(text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {
        "type": "reasoning",
        "id": random_id("rs_"),
        "summary": [],
        "content": content,
        "status": status,
    }


def _entries(logprobs: ChatCompletionLogProbs | None) -> list[dict]:
    """The chat route's logprobs as the Responses API's entries (the same fields)."""
    if logprobs is None or not logprobs.content:
        return []
    return [entry.model_dump(mode="json") for entry in logprobs.content]


def _output_text(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(
    text: str | None, status: str = "completed", logprobs: list[dict] | None = None
) -> dict:
    content = [] if text is None else [_output_text(text, logprobs)]
    return {
        "type": "message",
        "id": random_id("msg_"),
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": random_id("fc_"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class Events:
    """Server-sent events of the Responses API, numbered in order."""

    def __init__(self):
        self.sequence_number = 0

    def __call__(self, event_type: str, **fields) -> str:
        body = {"type": event_type, "sequence_number": self.sequence_number}
        for name, value in fields.items():
            body[name] = (
                value.model_dump(mode="json", by_alias=True)
                if isinstance(value, pydantic.BaseModel)
                else value
            )
        self.sequence_number += 1
        return f"event: {event_type}\ndata: {json.dumps(body)}\n\n"


@dataclass
class StreamedItems:
    """The output items of a stream as its deltas arrive: reasoning, then the message
    text, then the function calls (whose arguments arrive whole from the chat stream's
    parsers at the end of each call, and are sent when the reply is done). Items follow
    one another: an item's done events come before the next one's `output_item.added`."""

    events: Events
    output: list[dict] = field(default_factory=list)
    texts: dict[str, list[str]] = field(default_factory=dict)  # item id -> its pieces
    calls: dict[int, dict] = field(default_factory=dict)
    logprobs: list[dict] = field(default_factory=list)  # every token's, in order
    unsent_logprobs: list[dict] = field(default_factory=list)  # since the last text delta
    open_item: dict | None = None  # the text item deltas go to, closed when the next opens

    def _open(self, item: dict) -> list[str]:
        """The events that close the open item (if any) and open `item`."""
        events = self._close() if self.open_item is not None else []
        self.output.append(item)
        self.texts[item["id"]] = []
        self.open_item = item if item["type"] != "function_call" else None
        events.append(
            self.events("response.output_item.added", output_index=len(self.output) - 1, item=item)
        )
        return events

    def _current(self, item_type: str) -> dict | None:
        item = self.open_item
        return item if item is not None and item["type"] == item_type else None

    def feed(
        self,
        reasoning: str | None,
        content: str | None,
        logprobs: ChatCompletionLogProbs | None = None,
    ) -> list[str]:
        """Events for one chat chunk; its logprobs go with the next text delta (a chunk may
        hold tokens whose text is still held back)."""
        entries = _entries(logprobs)
        self.logprobs += entries
        self.unsent_logprobs += entries
        events = []
        if reasoning:
            item = self._current("reasoning")
            if item is None:
                item = _reasoning_item(None, status="in_progress")
                events += self._open(item)
            self.texts[item["id"]].append(reasoning)
            events.append(
                self._content_event("response.reasoning_text.delta", item, delta=reasoning)
            )
        if content:
            item = self._current("message")
            if item is None:
                item = _message_item(None, status="in_progress")
                events += self._open(item)
                events.append(
                    self._content_event("response.content_part.added", item, part=_output_text(""))
                )
            self.texts[item["id"]].append(content)
            delta_logprobs, self.unsent_logprobs = self.unsent_logprobs, []
            events.append(
                self._content_event(
                    "response.output_text.delta", item, delta=content, logprobs=delta_logprobs
                )
            )
        return events

    def add_call_delta(self, call) -> None:
        entry = self.calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
        entry["id"] = call.id or entry["id"]
        if call.function is not None:
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""

    def _close(self, status: str = "completed") -> list[str]:
        """The done events of the open text item, which takes `status`."""
        item, self.open_item = self.open_item, None
        text = "".join(self.texts[item["id"]])
        item["status"] = status
        events = []
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events.append(self._content_event("response.reasoning_text.done", item, text=text))
        else:
            if self.unsent_logprobs:  # tokens with no text of their own, as EOS
                events.append(
                    self._content_event(
                        "response.output_text.delta", item, delta="", logprobs=self.unsent_logprobs
                    )
                )
                self.unsent_logprobs = []
            part = _output_text(text, self.logprobs)
            item["content"] = [part]
            events.append(
                self._content_event(
                    "response.output_text.done", item, text=text, logprobs=self.logprobs
                )
            )
            events.append(self._content_event("response.content_part.done", item, part=part))
        events.append(self._done(item))
        return events

    def finish(self, cut_short: bool = False) -> list[str]:
        """The done events; `cut_short` and a reply of nothing as in `output_items`."""
        calls = [call for _, call in sorted(self.calls.items())]
        events = []
        if not (self.output or calls):
            item = _message_item(None, status="in_progress")
            events += self._open(item)
            events.append(
                self._content_event("response.content_part.added", item, part=_output_text(""))
            )
        if self.open_item is not None:
            events += self._close("incomplete" if cut_short and not calls else "completed")
        for position, call in enumerate(calls):
            item = _function_call_item(
                call["id"] or random_id("call_"), call["name"], "", "in_progress"
            )
            events += self._open(item)
            index = len(self.output) - 1
            for event_type, key in (("delta", "delta"), ("done", "arguments")):
                events.append(
                    self.events(
                        f"response.function_call_arguments.{event_type}",
                        item_id=item["id"],
                        output_index=index,
                        **{key: call["arguments"]},
                    )
                )
            cut = cut_short and position == len(calls) - 1
            item.update(arguments=call["arguments"], status="incomplete" if cut else "completed")
            events.append(self._done(item))
        return events

    def _index(self, item: dict) -> int:
        return next(i for i, other in enumerate(self.output) if other is item)

    def _content_event(self, event_type: str, item: dict, **fields) -> str:
        """An event about `item`'s one content part (reasoning text or output text)."""
        return self.events(
            event_type,
            item_id=item["id"],
            output_index=self._index(item),
            content_index=0,
            **fields,
        )

    def _done(self, item: dict) -> str:
        return self.events("response.output_item.done", output_index=self._index(item), item=item)


# -- input ------------------------------------------------------------------------------------


def chat_messages(request: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` as chat messages (a 400 naming the item it cannot take)."""
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    if isinstance(request.input, str):
        return [*messages, {"role": "user", "content": request.input}]
    for i, item in enumerate(request.input):
        param = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(f"unknown message role {role!r}", param=f"{param}.role")
            # "developer" reaches the template as it is, as on the chat route (and vLLM's).
            messages.append(
                {"role": role, "content": _text(item.get("content"), f"{param}.content")}
            )
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _field(item, "name", param),
                    "arguments": item.get("arguments", ""),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(_field(item, "output", param), f"{param}.output")
            messages.append(
                {"role": "tool", "tool_call_id": _field(item, "call_id", param), "content": output}
            )
        elif kind == "reasoning":
            continue  # the model's own earlier reasoning: chat templates leave it out
        else:
            raise OpenAIError(
                f"input items of type {kind!r} are not supported", param=f"{param}.type"
            )
    return messages


def _field(item: dict, name: str, param: str):
    if name not in item:
        raise OpenAIError(f"a {item.get('type')} item needs {name!r}", param=f"{param}.{name}")
    return item[name]


def _text(content, param: str) -> str:
    """A message's content as text: a string, or text parts joined (by newlines, as the
    chat route and vLLM join them)."""
    if not isinstance(content, (str, list)):
        raise OpenAIError("content must be a string or a list of text parts", param=param)
    try:
        return text_of_content(content)
    except ContentPartError as e:
        raise OpenAIError(str(e), param=f"{param}.{e.index}") from None
