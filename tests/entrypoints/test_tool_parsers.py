"""Tool-call and reasoning parsers on hand-written model outputs: plain text, one call,
several calls, malformed JSON left as text, each parser's own format; and streamed in
arbitrary fragment boundaries, the deltas join into exactly the full response."""

import json
import random

import pytest

from jengine.entrypoints.openai.reasoning_parsers import (
    ReasoningStream,
    ReplyStream,
    get_reasoning_parser,
)
from jengine.entrypoints.openai.tool_parsers import (
    FirstCallOnly,
    NamedToolCallParser,
    RequiredToolCallParser,
    ToolCallStream,
    get_tool_parser,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
HERMES = {
    "plain": ("The weather is fine.", "The weather is fine.", []),
    "one call": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>',
        None,
        [("get_weather", WEATHER)],
    ),
    "text then two calls": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        "{}}\n</tool_call>",
        "Let me check.\n\n",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    "malformed": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
        [],
    ),
    "unclosed at the end": (
        '<tool_call>{"name": "get_time", "arguments": {}}',
        None,
        [("get_time", {})],
    ),
    "a marker look-alike": ("Use <tool> tags.", "Use <tool> tags.", []),
}
OTHERS = {
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
         [("get_weather", WEATHER)]),
        ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
         '"parameters": {"city": "Paris", "unit": "celsius"}}', None,
         [("get_time", {}), ("get_weather", WEATHER)]),
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        ('{"name": "get_weather", "parameters": {', '{"name": "get_weather", "parameters": {', []),
        # A `;` inside a string is part of it; one may end the list.
        ('{"name": "sql", "parameters": {"query": "SELECT 1; SELECT 2"}};', None,
         [("sql", {"query": "SELECT 1; SELECT 2"})]),
        ('{"name": "get_time", "parameters": {}} and more',
         '{"name": "get_time", "parameters": {}} and more', []),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
         '"celsius"}}]', None, [("get_weather", WEATHER)]),
        ("Sunny.", "Sunny.", []),
        ("[TOOL_CALLS] [{oops}]", "[TOOL_CALLS] [{oops}]", []),
        ('Let me look. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "Let me look. ",
         [("get_time", {})]),
        # Tokenizers v11 and later: a name, then its arguments, after each marker.
        ('[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time{}',
         None, [("get_weather", WEATHER), ("get_time", {})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None,
         [("get_weather", WEATHER)]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": Paris}',
         '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}', []),
    ],
}  # fmt: skip


def cases():
    for name, case in HERMES.items():
        yield pytest.param("hermes", *case, id=f"hermes-{name}")
    for parser, items in OTHERS.items():
        for i, case in enumerate(items):
            yield pytest.param(parser, *case, id=f"{parser}-{i}")


def as_pairs(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def streamed(parser, text: str, seed: int) -> tuple[str | None, list[tuple[str, dict]]]:
    """Feed `text` in random fragments; join the deltas as a client would."""
    rng = random.Random(seed)
    stream = ToolCallStream(parser)
    deltas, start = [], 0
    while start < len(text):
        end = min(len(text), start + rng.randint(1, 7))
        deltas += stream.feed(text[start:end], finished=end == len(text))
        start = end
    content = "".join(d.content or "" for d in deltas) or None
    calls: dict[int, list] = {}
    for delta in deltas:
        for call in delta.tool_calls or []:
            if call.id is not None:  # the first chunk of a call: index, id and name
                assert call.function.name and call.function.arguments == ""
                calls[call.index] = [call.function.name, ""]
            else:
                calls[call.index][1] += call.function.arguments
    return content, [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())]


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), cases())
def test_parsers_whole_and_streamed(parser_name, text, content, calls):
    parser = get_tool_parser(parser_name)
    got_content, tool_calls, complete = parser.extract(text)
    assert got_content == content and complete == bool(calls)
    assert as_pairs(tool_calls) == calls
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in tool_calls)
    for seed in range(5):
        assert streamed(parser, text, seed) == (content, calls)


def test_forced_tool_choice_outputs():
    required = RequiredToolCallParser(["get_weather", "get_time"])
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]'
    content, calls, complete = required.extract(text)
    assert content is None and complete and as_pairs(calls) == [("get_weather", WEATHER)]
    assert streamed(required, text, 0) == (None, [("get_weather", WEATHER)])
    named = NamedToolCallParser("get_weather")
    content, calls, complete = named.extract(json.dumps(WEATHER))
    assert content is None and complete and as_pairs(calls) == [("get_weather", WEATHER)]


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (
            RequiredToolCallParser(["get_weather", "get_time"]),
            '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
            '{"name":"get_time","parameters":{ "zone" : "UTC\\"}" }}]',
        ),
        (NamedToolCallParser("get_weather"), ' {"city": "Paris",  "unit": "celsius"} '),
    ],
)
def test_forced_calls_stream_their_arguments_as_they_are_written(parser, text):
    """A forced call's name goes out as soon as it is written and its arguments as they
    grow, not all at the end; joined, they are the full response's arguments, which are
    the text the model wrote."""
    stream = ToolCallStream(parser)
    arguments: dict[int, str] = {}
    for end in range(1, len(text) + 1):
        for delta in stream.feed(text[end - 1 : end], finished=end == len(text)):
            for call in delta.tool_calls or []:
                arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
        if end == len(text) // 2:
            assert arguments[0], "nothing streamed by half way"
    _, calls, complete = parser.extract(text)
    assert complete and stream.complete
    assert [arguments[i] for i in sorted(arguments)] == [c.function.arguments for c in calls]
    assert all(c.function.arguments in text for c in calls)


def raw_pairs(calls) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in calls]


FIRST = '{"name": "get_time", "parameters": {"zone": "UTC"}}'


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('[{"name": "get_weather", "parameters": {"ci', [("get_weather", '{"ci')]),
        ('[{"name": "get_weather", "parameters": {"city":', [("get_weather", '{"city":')]),
        ('[{"name": "get_weather", "param', [("get_weather", "")]),
        ('[{"name": "get_w', [("get_weather", "")]),  # only one tool name fits
        ('[{"name": "get_', [("get_", "")]),  # two fit: as written
        ('[{"na', []),
        ("[", []),
        (f"[{FIRST}, ", [("get_time", '{"zone": "UTC"}')]),
        (
            f'[{FIRST}, {{"name": "get_weather", "parameters": {{"city": "a}}b\\"',
            [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "a}b\\"')],
        ),
    ],
)
def test_a_forced_call_cut_short_is_still_a_call(text, calls):
    """A reply cut by max_tokens (or a stop string) under tool_choice "required": the calls
    as far as they got, never the raw JSON as content; streamed the same."""
    required = RequiredToolCallParser(["get_weather", "get_time"])
    content, tool_calls, complete = required.extract(text)
    assert content in (None, "") and raw_pairs(tool_calls) == calls
    # Unless every call it holds is whole, its finish_reason stays what cut it.
    assert complete == (calls == [("get_time", '{"zone": "UTC"}')])
    stream = ToolCallStream(required)
    deltas = stream.feed(text[:5], False) + stream.feed(text[5:], True)
    assert not any(d.content for d in deltas)
    names = [c.function.name for d in deltas for c in d.tool_calls or [] if c.function.name]
    assert names == [name for name, _ in calls]


def test_a_named_call_cut_short_is_still_that_call():
    named = NamedToolCallParser("get_weather")
    content, calls, complete = named.extract('{"city": "Par')
    assert content is None and raw_pairs(calls) == [("get_weather", '{"city": "Par')]
    assert not complete


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = (
        'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    parser = FirstCallOnly(get_tool_parser("hermes"))
    assert parser.keeps_special_tokens
    content, calls, complete = parser.extract(two)
    assert (
        content == "Checking." and complete and as_pairs(calls) == [("get_weather", {"city": "A"})]
    )
    for seed in range(3):
        assert streamed(parser, two, seed) == ("Checking.", [("get_weather", {"city": "A"})])


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("nope")


REASONING = [
    ("qwen3", "<think>Paris is in France.</think>The capital is Paris.",
     "Paris is in France.", "The capital is Paris."),
    ("qwen3", "The capital is Paris.", "", "The capital is Paris."),
    ("qwen3", "<think>still thinking", "still thinking", ""),
    ("deepseek_r1", "Paris is in France.</think>The capital is Paris.",
     "Paris is in France.", "The capital is Paris."),
    ("deepseek_r1", "<think>Hmm.</think>Paris.", "Hmm.", "Paris."),
    ("deepseek_r1", "no end marker", "no end marker", ""),
    # Whitespace before `<think>` (dropped with it) or before a `<` that starts no `<think>`.
    ("deepseek_r1", "\n<think>abc</think>answer", "abc", "answer"),
    ("qwen3", "\n<think>abc</think>answer", "abc", "answer"),
    ("deepseek_r1", "\n<<<", "\n<<<", ""),
    ("qwen3", " \n<<<", "", " \n<<<"),
    ("qwen3", "\n", "", "\n"),
]  # fmt: skip


# What the prompt says decides where a reply starts (`thinking`, from `starts_thinking`).
REASONING_AFTER_A_PROMPT = [
    # Qwen3-2507's thinking template opens `<think>` itself: the reply only closes it.
    ("qwen3", True, "Paris is in France.</think>The capital is Paris.",
     "Paris is in France.", "The capital is Paris."),
    ("qwen3", True, "still thinking", "still thinking", ""),
    ("qwen3", False, "The capital is Paris.", "", "The capital is Paris."),
    # A template that closed the block (thinking off): deepseek_r1's reply is all answer.
    ("deepseek_r1", False, "The capital is Paris.", "", "The capital is Paris."),
    ("deepseek_r1", True, "Hmm.</think>Paris.", "Hmm.", "Paris."),
]  # fmt: skip


def _check_whole_and_streamed(name, text, reasoning, answer, thinking=None):
    parser = get_reasoning_parser(name)
    assert parser.split(text, True, thinking) == (reasoning, answer)
    chunkings = [[1, len(text)]]  # one character, then all the rest
    for seed in range(5):
        rng = random.Random(seed)
        chunkings.append([rng.randint(1, 4) for _ in text])
    for sizes in chunkings:
        stream, got, start = ReasoningStream(parser, thinking), ["", ""], 0
        for size in sizes:
            end = min(len(text), start + size)
            new_reasoning, new_answer = stream.feed(text[start:end], end == len(text))
            got[0] += new_reasoning
            got[1] += new_answer
            start = end
            if end == len(text):
                break
        assert tuple(got) == (reasoning, answer), sizes


@pytest.mark.parametrize(("name", "text", "reasoning", "answer"), REASONING)
def test_reasoning_parsers_whole_and_streamed(name, text, reasoning, answer):
    _check_whole_and_streamed(name, text, reasoning, answer)


@pytest.mark.parametrize(
    ("name", "thinking", "text", "reasoning", "answer"), REASONING_AFTER_A_PROMPT
)
def test_a_reply_is_split_where_its_prompt_left_the_thinking(
    name, thinking, text, reasoning, answer
):
    """A reply that starts inside a block its prompt opened is reasoning up to `</think>`
    for either parser; after a prompt that closed one, it is all answer."""
    _check_whole_and_streamed(name, text, reasoning, answer, thinking)


def test_reasoning_then_a_tool_call_in_one_stream():
    text = (
        '<think>The user wants weather.</think><tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    )
    stream = ReplyStream(get_reasoning_parser("qwen3"), get_tool_parser("hermes"))
    deltas = []
    for start in range(0, len(text), 5):
        deltas += stream.feed(text[start : start + 5], start + 5 >= len(text))
    assert "".join(d.reasoning_content or "" for d in deltas) == "The user wants weather."
    assert not any(d.content for d in deltas)
    assert stream.called


@pytest.mark.parametrize("kind", ["bundled", "sentencepiece-style"])
@pytest.mark.parametrize(("name", "text", "reasoning", "answer"), REASONING)
def test_reasoning_tokens_end_with_the_one_that_completes_the_end_marker(
    kind, name, text, reasoning, answer, tmp_path
):
    """The Responses API's reasoning_tokens, on real tokenizers' ids for each reply: the
    prefix that first decodes to `</think>`, all of a reply whose reasoning never ended,
    none of one without reasoning."""
    from jengine.engine.tokenizer import load_tokenizer_from
    from jengine.models.checkpoint import BUNDLED_MODEL_PATH
    from tests.engine.tokenizer_kinds import save_tokenizer

    folder = BUNDLED_MODEL_PATH if kind == "bundled" else save_tokenizer(kind, str(tmp_path))
    tokenizer = load_tokenizer_from(folder)
    ids = tokenizer.encode(text, add_special_tokens=False)
    decode = tokenizer.decode
    assert get_reasoning_parser(name).split(decode(ids), finished=True) == (reasoning, answer)
    count = get_reasoning_parser(name).num_reasoning_tokens(ids, decode)
    if not reasoning and answer == text:
        assert count == 0
    elif not answer:
        assert count == len(ids)
    else:
        assert 0 < count < len(ids)
        assert "</think>" in decode(ids[:count]) and "</think>" not in decode(ids[: count - 1])


@pytest.mark.parametrize(
    ("name", "prompt", "thinking"),
    [
        ("deepseek_r1", "<|User|>Hi<|Assistant|><think>\n", True),  # R1's template opens it
        ("deepseek_r1", "<|User|>Hi<|Assistant|>", True),  # the model thinks anyway
        ("qwen3", "<|im_start|>assistant\n<think>\n", True),
        ("qwen3", "<|im_start|>assistant\n", False),  # no <think>: all answer
        # Thinking off: the template closed the block (after an earlier turn's, too).
        ("qwen3", "<think>a</think>b<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("deepseek_r1", "<|Assistant|><think>\n\n</think>\n\n", False),
        # Only the prompt's end tells: markers in a user's message or an earlier turn say
        # nothing of this reply (they once decided it).
        (
            "qwen3",
            "<|im_start|>user\nWhat is a <think> tag?<|im_end|>\n<|im_start|>assistant\n",
            False,
        ),
        ("deepseek_r1", "<|User|>What does </think> mean?<|Assistant|>", True),
        ("deepseek_r1", "<|Assistant|><think>a</think>b<|User|>Hi<|Assistant|>", True),
    ],
)
def test_whether_a_reply_starts_thinking(name, prompt, thinking):
    """Where an output constraint starts: after `</think>` if the reply starts thinking,
    else at its first token (vLLM reads the prompt for a closed block too)."""
    assert get_reasoning_parser(name).starts_thinking(prompt) is thinking
