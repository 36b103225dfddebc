"""Tool-call parsers (`--tool-call-parser`, vLLM's names): a model's tool-call text ->
OpenAI `tool_calls`, whole or streamed.

Where it sits: the chat route, with `--enable-auto-tool-choice` and `tool_choice` "auto",
runs the reply's content through one of these (and a forced call through
`RequiredToolCallParser` or `NamedToolCallParser`). Each parser says, for the text so far,
which part is surely plain content and which tool calls it holds (`split`: whole ones, and
for a forced call, the one being written); the full response uses it once on the final
text, a stream (`ToolCallStream`) on each growing prefix and sends only what is new, so
the streamed pieces join into the full response.

What it promises: plain text stays content; text that looks like a call but does not
parse (malformed JSON, a missing name) stays content too, never an error; a marker cut
across stream deltas is held back until it is whole. Jax-free.

- `hermes` (Hermes, Qwen2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, after optional content.
- `llama3_json` (Llama 3.1+): the whole reply is `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`), several separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`
  (tokenizers before v11), or `[TOOL_CALLS]name{...}` / `[TOOL_CALLS]name[ARGS]{...}` for
  each call (v11 and later).

`hermes` and `mistral` read the reply with its special tokens, as vLLM's do: some
checkpoints make `<tool_call>` or `[TOOL_CALLS]` one, and decoding would drop the marker.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from jengine.entrypoints.openai.protocol_chat import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text (cut short: as far as it got)
    complete: bool = True  # False: cut short, or still being written

    def tool_call(self) -> ToolCall:
        function = FunctionCall(name=self.name, arguments=self.arguments)
        return ToolCall(id=new_call_id(), function=function)


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call_from(obj, arguments_keys=("arguments", "parameters")) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(arguments, str):  # some models send the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_call(text: str) -> ParsedCall | None:
    try:
        return _call_from(json.loads(text))
    except json.JSONDecodeError:
        return None


_DECODER = json.JSONDecoder()


def _json_values(text: str, separator: str) -> list | None:
    """The JSON values `text` holds one after another, `separator` between them (a
    separator inside a JSON string is part of it); None unless that is all it holds."""
    values, at = [], 0
    while True:
        at = len(text) - len(text[at:].lstrip())
        if at == len(text) and values:
            return values  # a separator may end the list
        try:
            value, at = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)
        rest = text[at:].lstrip()
        if not rest:
            return values
        if not rest.startswith(separator):
            return None
        at = len(text) - len(rest) + len(separator)


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolParser:
    name = ""
    # Whether the reply must be decoded with its special tokens, the parser's markers
    # being special tokens in some checkpoints.
    keeps_special_tokens = False

    def split(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        """(the content so far, the calls so far). Both only grow as `text` grows while
        not finished (the last call's arguments may grow, while it is incomplete); with
        `finished`, they are the final answer."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall], bool]:
        """The full response: (content, or None if only whitespace beside the calls;
        tool calls; whether there are calls and all are complete)."""
        content, calls = self.split(text, finished=True)
        if calls and not content.strip():
            content = None
        return content, [c.tool_call() for c in calls], _all_complete(calls)


def _all_complete(calls: list[ParsedCall]) -> bool:
    return bool(calls) and all(call.complete for call in calls)


class FirstCallOnly(ToolParser):
    """`parallel_tool_calls: false` with tool_choice "auto": a reply's first call only (the
    text of the others dropped, as vLLM's)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.keeps_special_tokens = parser.keeps_special_tokens

    def split(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        content, calls = self.parser.split(text, finished)
        return content, calls[:1]


class HermesToolParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def split(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        first = text.find(self.START)
        if first == -1:
            cut = len(text) if finished else len(text) - _held_back(text, self.START)
            return text[:cut], []
        # Streaming: the content before the first call, then the calls closed so far
        # (stopping at one that is open or malformed). Finished: every valid call, and all
        # other text (malformed blocks, text between calls) is content.
        content, calls, position = text[:first], [], first
        for block in self._BLOCK.finditer(text, first):
            call = _parse_call(block.group(1)) if block.group(2) or finished else None
            if call is None and not finished:
                break
            if finished:
                content += text[position : block.start()]
                if call is None:
                    content += block.group(0)
            position = block.end()
            if call is not None:
                calls.append(call)
        if finished:
            content += text[position:]
        return content, calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def split(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        looks_like_calls = body.startswith("{") or (not finished and self.TAG.startswith(body))
        if not looks_like_calls:
            return text, []
        if not finished:
            return "", []  # a call list is known only once the reply is complete
        calls = [_call_from(value) for value in _json_values(body, ";") or [None]]
        return ("", calls) if None not in calls else (text, [])


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True
    MARKER = "[TOOL_CALLS]"
    # v11 and later: one call after each marker, its name then its arguments object.
    _CALL = re.compile(
        r"\s*(?P<name>[\w.-]+)\s*(?:\[CALL_ID\]\s*\w+\s*)?(?:\[ARGS\])?(?P<arguments>.*)",
        re.DOTALL,
    )

    def split(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        at = text.find(self.MARKER)
        if at == -1:
            cut = len(text) if finished else len(text) - _held_back(text, self.MARKER)
            return text[:cut], []
        if not finished:
            return text[:at], []
        calls = self._calls(text[at + len(self.MARKER) :].split(self.MARKER))
        if not calls or None in calls:
            return text, []
        return text[:at], calls

    def _calls(self, pieces: list[str]) -> list[ParsedCall | None]:
        if pieces[0].lstrip().startswith(("[", "{")):  # before v11: a JSON array of calls
            if len(pieces) > 1:
                return [None]
            try:
                items = json.loads(pieces[0])
            except json.JSONDecodeError:
                return [None]
            return [_call_from(item) for item in (items if isinstance(items, list) else [items])]
        calls = []
        for piece in pieces:
            match = self._CALL.fullmatch(piece)
            arguments = match and match.group("arguments").strip()
            calls.append(
                match and _call_from({"name": match.group("name"), "arguments": arguments})
            )
        return calls


class RequiredToolCallParser(ToolParser):
    """tool_choice "required": the reply is the JSON array of `{"name", "parameters"}`
    calls its grammar forced (structured_outputs.tool_choice_constraint). Each call's
    arguments are the JSON text written for its parameters, so a stream sends them as they
    are written, from the moment the name is complete. A reply cut short (max_tokens, a
    stop string) is still calls: the complete ones, then the last as far as it got (its
    name completed from `names` when only one fits what was written), marked incomplete."""

    def __init__(self, names: list[str]):
        self.names = names

    def split(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        if finished:
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return "", self._calls(text, finished)
            whole = [_call_from(item) for item in items] if isinstance(items, list) else [None]
            if not whole or None in whole:
                return text, []
        return "", self._calls(text, finished)

    def _calls(self, text: str, finished: bool) -> list[ParsedCall]:
        calls = []
        for start, end in _array_objects(text):
            written = text[start:end] if end is not None else text[start:]
            cut = _CUT_CALL.match(written)
            if end is not None:  # a whole call: its arguments as written, if it reads so
                arguments = (cut and cut.group("arguments") or "").strip()[:-1].rstrip()
                whole = cut and _call_from({"name": "", "arguments": arguments})
                call = ParsedCall(cut.group("name"), arguments) if whole else _parse_call(written)
                if call is None:
                    break
                calls.append(call)
                continue
            if cut is None or (cut.group("closed") is None and not finished):
                break  # not begun, or its name is still being written
            name = cut.group("name")
            if cut.group("closed") is None:
                fits = [n for n in self.names if n.startswith(name)]
                name = fits[0] if len(fits) == 1 else name
            calls.append(ParsedCall(name, (cut.group("arguments") or "").strip(), False))
        return calls


# A call as far as it got: `{"name": "na`, `{"name": "name", "parameters": {"ci`, or whole.
_CUT_CALL = re.compile(
    r'\{\s*"name"\s*:\s*"(?P<name>[^"\\]*)(?P<closed>")?'
    r'(?:\s*,\s*"parameters"\s*:(?P<arguments>.*))?',
    re.DOTALL,
)


def _array_objects(text: str) -> list[tuple[int, int | None]]:
    """The spans of the objects directly inside the JSON array `text`; the end of one cut
    off is None."""
    spans, depth, start, in_string, escaped = [], 0, None, False, False
    for index, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth == 2:
                start = index
        elif char in "]}":
            if depth == 2:
                spans.append((start, index + 1))
                start = None
            depth -= 1
    if start is not None:
        spans.append((start, None))
    return spans


class NamedToolCallParser(ToolParser):
    """tool_choice naming a function: the reply is that function's arguments object, the
    call's arguments as written (streamed as they are written; cut short, incomplete)."""

    def __init__(self, function_name: str):
        self.function_name = function_name

    def split(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        arguments = text.strip()  # trailing whitespace held back until more follows
        complete = finished and _call_from({"name": "", "arguments": arguments}) is not None
        return "", [ParsedCall(self.function_name, arguments, complete)]


TOOL_PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


class ToolCallStream:
    """One streamed choice through a parser: each delta's new content and calls (a call's
    first chunk has its index, id and name, then its arguments follow as they grow, in
    fragments)."""

    ARGUMENT_FRAGMENT = 16  # characters per arguments chunk, at most

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.sent_arguments: list[int] = []  # per call sent: the arguments' length sent
        self.complete = False  # calls were made, and all are complete

    def feed(self, delta: str, finished: bool) -> list[DeltaMessage]:
        self.text += delta
        content, calls = self.parser.split(self.text, finished)
        messages = []
        # Whitespace alone is not sent (the full response drops it beside calls).
        if len(content) > self.sent_content and content.strip():
            messages.append(DeltaMessage(content=content[self.sent_content :]))
            self.sent_content = len(content)
        for index, call in enumerate(calls):
            if index == len(self.sent_arguments):
                self.sent_arguments.append(0)
                function = DeltaFunctionCall(name=call.name, arguments="")
                messages.append(_call_delta(index, function, id=new_call_id(), type="function"))
            sent = self.sent_arguments[index]
            for start in range(sent, len(call.arguments), self.ARGUMENT_FRAGMENT):
                fragment = call.arguments[start : start + self.ARGUMENT_FRAGMENT]
                messages.append(_call_delta(index, DeltaFunctionCall(arguments=fragment)))
            self.sent_arguments[index] = max(sent, len(call.arguments))
        self.complete = _all_complete(calls)
        return messages


def _call_delta(index: int, function: DeltaFunctionCall, **first) -> DeltaMessage:
    return DeltaMessage(tool_calls=[DeltaToolCall(index=index, function=function, **first)])
