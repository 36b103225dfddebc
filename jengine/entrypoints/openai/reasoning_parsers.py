"""Reasoning parsers (`--reasoning-parser`, vLLM's names): the text a model thinks in,
between `<think>` and `</think>`, moved out of the answer into `reasoning_content`.

Where it sits: the chat route splits every reply here before anything else (tool calls
are parsed from the answer part only); with a structured-output constraint the engine
starts enforcing it after `END` (the request's `StructuredOutputsParams.reasoning_end`)
when the reply starts thinking (`starts_thinking`), else from its first token.
`split` is prefix-stable like the tool parsers': a stream (`ReasoningStream`) sends only
what each delta adds, and the pieces join into the full response; `ReplyStream` chains it
with a tool-call stream for one streamed chat choice. Jax-free.

Whether a reply starts inside a think block is read from its prompt's end
(`starts_thinking`): a template that opens `<think>` for the reply (DeepSeek-R1, Qwen3-2507's
thinking models) makes it reasoning up to `</think>`; one that closed the block (thinking
turned off) makes it all answer. With neither marker there the parsers differ:

- `deepseek_r1`: the model thinks anyway, so the reply is reasoning up to `</think>` (an
  opening `<think>` is dropped); with no `</think>`, it is all reasoning.
- `qwen3`: reasoning only inside `<think>...</think>`; with no `<think>`, it is all answer
  (Qwen3 with thinking off).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jengine.entrypoints.openai.protocol_chat import DeltaMessage
from jengine.entrypoints.openai.tool_parsers import ToolCallStream, ToolParser, _held_back

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    reasoning_without_start = True  # is text before `</think>` reasoning without `<think>`?

    def starts_thinking(self, prompt: str) -> bool:
        """Whether a reply to `prompt` starts inside a think block, so that an output
        constraint waits for `</think>`. Only the prompt's end tells, where the template
        writes the reply's start: `<think>` there (a reasoning model's template) opens the
        block; `</think>` (Qwen3 with thinking off) closed it. A marker anywhere else, as
        a user's message naming the tag or an earlier turn's reasoning, says nothing of
        this reply. With neither at the end, deepseek_r1's model thinks anyway, and qwen3's
        reply is answer unless the model opens `<think>` itself, which a constraint from
        the first token forbids (a constraint waiting for a `</think>` that never comes
        would be none at all)."""
        end = prompt.rstrip()
        if end.endswith(START):
            return True
        if end.endswith(END):
            return False
        return self.reasoning_without_start

    def split(self, text: str, finished: bool, thinking: bool | None = None) -> tuple[str, str]:
        """(reasoning so far, answer so far); both only grow while not finished.
        `thinking`: whether the reply starts inside a think block (`starts_thinking` of
        its prompt); None: as after a prompt with neither marker."""
        if thinking is None:
            thinking = self.reasoning_without_start
        if not finished and START.startswith(text.lstrip()):
            # Perhaps `<think>` is still arriving, which would drop the whitespace before
            # it: nothing is decided (a stream's pieces must never be taken back).
            return "", ""
        body = text
        opened = body.lstrip().startswith(START)
        if opened:
            body = body.lstrip()[len(START) :]
        end = body.find(END)
        if end != -1:
            if opened or thinking:
                return body[:end], body[end + len(END) :]
            return "", text
        if opened or thinking:
            cut = len(body) if finished else len(body) - _held_back(body, END)
            return body[:cut], ""
        cut = len(text) if finished else len(text) - _held_back(text, START)
        return "", text[:cut]

    def num_reasoning_tokens(
        self,
        token_ids: Sequence[int],
        decode: Callable[[Sequence[int]], str],
        thinking: bool | None = None,
    ) -> int:
        """How many of a finished reply's tokens are reasoning (the Responses API's
        `usage.output_tokens_details.reasoning_tokens`): none when the reply has no
        reasoning, all while `</think>` never came, else those up to and including the
        token that completes `</think>`, found by bisecting on decoded prefixes (log2 n
        decodes, since a token's text is not known apart from its neighbours')."""
        text = decode(token_ids)
        reasoning, answer = self.split(text, finished=True, thinking=thinking)
        if answer == text:
            return 0
        if not answer:
            return len(token_ids)
        without, with_end = 0, len(token_ids)  # `</think>` is in decode(ids[:with_end]) only
        while with_end - without > 1:
            middle = (without + with_end) // 2
            if END in decode(token_ids[:middle]):
                with_end = middle
            else:
                without = middle
        return with_end


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    reasoning_without_start = False


REASONING_PARSERS = {p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose from {sorted(REASONING_PARSERS)}"
        )
    return REASONING_PARSERS[name]()


class ReasoningStream:
    """One streamed choice: each delta's new reasoning and new answer text."""

    def __init__(self, parser: ReasoningParser, thinking: bool | None = None):
        self.parser = parser
        self.thinking = thinking
        self.text = ""
        self.sent_reasoning = 0
        self.sent_answer = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, new answer text) this delta brings."""
        self.text += delta
        reasoning, answer = self.parser.split(self.text, finished, self.thinking)
        new_reasoning = reasoning[self.sent_reasoning :]
        new_answer = answer[self.sent_answer :]
        self.sent_reasoning, self.sent_answer = len(reasoning), len(answer)
        return new_reasoning, new_answer


class ReplyStream:
    """One streamed choice through the reasoning parser, then the tool parser: each
    delta's new reasoning, content and tool calls."""

    def __init__(
        self,
        reasoning_parser: ReasoningParser | None,
        tool_parser: ToolParser | None,
        thinking: bool | None = None,
    ):
        self.reasoning = ReasoningStream(reasoning_parser, thinking) if reasoning_parser else None
        self.tools = ToolCallStream(tool_parser) if tool_parser else None

    @property
    def called(self) -> bool:
        """Whether the reply made tool calls, all complete."""
        return self.tools is not None and self.tools.complete

    def feed(self, text: str, finished: bool) -> list[DeltaMessage]:
        deltas = []
        answer = text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.feed(text, finished)
            if reasoning:
                deltas.append(DeltaMessage(reasoning_content=reasoning))
        if self.tools is not None:
            deltas += self.tools.feed(answer, finished)
        elif answer:
            deltas.append(DeltaMessage(content=answer))
        return deltas
