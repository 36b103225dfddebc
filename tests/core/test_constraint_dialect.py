"""A regex's `\\d` and `\\w` are ASCII, and a JSON schema's objects that list their properties
allow no others unless they say so (xgrammar's reading, vLLM's default): the rewrites
themselves, then what llguidance's matcher accepts under SmolLM2's byte-level vocabulary,
whose tokens spell digits and letters of every script."""

import pytest
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer

from jengine.core.constraint_dialect import ascii_shorthands, closed_objects
from jengine.core.structured_output import grammar_for
from jengine.engine.tokenizer import gguf_tokenizer
from jengine.models.checkpoint import installed_smollm2
from jengine.sampling_params import StructuredOutputsParams

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.mark.parametrize(
    "regex, expected",
    [
        (r"\d{4}-\d{2}", "[0-9]{4}-[0-9]{2}"),
        (r"\w+\W\D", "[0-9A-Za-z_]+[^0-9A-Za-z_][^0-9]"),
        (r"[^\d_]", "[^[0-9]_]"),  # nested inside a class
        (r"\\d\\\d", r"\\d\\[0-9]"),  # an escaped backslash, then a real \d
        (r"\s\p{L}\.\x41\u00e9", r"\s\p{L}\.\x41\u00e9"),  # other escapes as written
        ("trailing\\", "trailing\\"),
    ],
)
def test_ascii_shorthands(regex, expected):
    assert ascii_shorthands(regex) == expected


def test_closed_objects_closes_only_objects_that_list_properties():
    schema = {
        "type": "object",
        "properties": {
            "point": POINT,
            "open": {**POINT, "additionalProperties": True},
            "any": {"type": "object"},
            "none": {"type": "object", "properties": {}},  # a tool without parameters
            "list": {"type": "array", "items": POINT},
            "either": {"anyOf": [POINT, {"type": "null"}]},
            "unlike": {"not": POINT},
        },
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["point"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["any"]
    assert props["none"]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["unlike"] == {"not": POINT}  # closing under `not` would widen it
    assert "additionalProperties" not in schema and "additionalProperties" not in POINT


def test_the_parts_of_an_all_of_stay_open():
    schema = {
        "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"y": {"type": "integer"}}}],
        "$defs": {"base": POINT, "other": POINT},
    }
    closed = closed_objects(schema)
    assert "additionalProperties" not in closed["allOf"][1]
    assert "additionalProperties" not in closed["$defs"]["base"]
    assert closed["$defs"]["other"]["additionalProperties"] is False


@pytest.fixture(scope="module")
def accepts():
    tokenizer = gguf_tokenizer(installed_smollm2())
    vocabulary = from_tokenizer(tokenizer)

    def accepts(params: StructuredOutputsParams, text: str) -> bool:
        matcher = LLMatcher(vocabulary, grammar_for(params))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    return accepts


@pytest.mark.parametrize(
    "regex, text, allowed",
    [
        (r"\d{4}-\d{2}-\d{2}", "2024-06-01", True),
        (r"\d{4}-\d{2}-\d{2}", "২০২৪-০৬-০১", False),  # Bengali digits
        (r"\d\d", "🯸1", False),  # a segmented digit, which SmolLM2 wrote
        (r"\w+", "word_42", True),
        (r"\w+", "Łódź", False),
        (r"[^\d]", "১", True),
        (r"\s", "\u3000", True),  # \s stays Unicode, as in JavaScript
    ],
)
def test_the_matcher_reads_shorthands_as_ascii(accepts, regex, text, allowed):
    assert accepts(StructuredOutputsParams(regex=regex), text) is allowed


def test_the_matcher_refuses_keys_a_schema_does_not_list(accepts):
    closed = StructuredOutputsParams(json=POINT)
    assert accepts(closed, '{"x": 1}')
    assert not accepts(closed, '{"x": 1, "y": 2}')
    assert accepts(StructuredOutputsParams(json={**POINT, "additionalProperties": True}),
                   '{"x": 1, "y": 2}')  # fmt: skip
    assert accepts(StructuredOutputsParams(json={"type": "object"}), '{"y": 2}')
    assert accepts(StructuredOutputsParams(json_object=True), '{"y": 2}')


# What adds properties up (found outside the suite: each was refused as unsatisfiable, the
# parent closed against properties its `$ref` or its branches bring).
TAGGED = {
    "type": "object",
    "properties": {"kind": {"enum": ["a", "b"]}},
    "required": ["kind"],
    "anyOf": [
        {"properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["x"]},
        {"properties": {"kind": {"const": "b"}, "y": {"type": "string"}}, "required": ["y"]},
    ],
}
EXTENDED = {
    "$defs": {"base": POINT},
    "$ref": "#/$defs/base",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
}
REQUIRED_UNLISTED = {"properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}


@pytest.mark.parametrize(
    "schema, text, allowed",
    [
        (TAGGED, '{"kind": "a", "x": 1}', True),
        (TAGGED, '{"kind": "b", "y": "s"}', True),
        (TAGGED, '{"kind": "a", "y": "s"}', False),  # a's branch lists no y
        (TAGGED, '{"kind": "a", "x": 1, "z": 0}', False),  # each branch stays closed
        ({**TAGGED, "oneOf": TAGGED["anyOf"], "anyOf": None}, '{"kind": "b", "y": "s"}', True),
        (EXTENDED, '{"x": 1, "name": "n"}', True),
        (REQUIRED_UNLISTED, '{"a": 1, "b": 2}', True),
        (REQUIRED_UNLISTED, '{"a": 1, "b": 2, "c": 3}', False),
    ],
)  # fmt: skip
def test_properties_that_add_up_are_not_refused(accepts, schema, text, allowed):
    schema = {k: v for k, v in schema.items() if v is not None}
    assert accepts(StructuredOutputsParams(json=schema), text) is allowed
