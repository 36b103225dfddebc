"""Structured outputs through `LLM`, on a random-weight model (its free output is noise)
and on the bundled model: every JSON-schema output validates (nested objects, arrays with
min/max items, enums, numeric bounds, required and optional fields, string patterns,
`anyOf`, `$ref`), every regex output full-matches, every choice is one of the choices,
every grammar output parses — with constrained and free requests in the same steps,
chunked prefill, preemption, n = 3 and seeded sampling at temperature 1. Free greedy
requests come out exactly as they do alone; nothing compiles after warmup; bad
constraints are a ValueError before anything runs."""

import json
import re

import jsonschema
import pytest

from jengine import LLM, SamplingParams, StructuredOutputsParams
from jengine.models.default import BUNDLED_MODEL_PATH
from tests.engine.engine_helpers import TIGHT_ENGINE_ARGS
from tests.entrypoints.tiny_model import make_tiny_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "nickname": {"type": "string", "maxLength": 6},  # optional
        "tags": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "contact": {"anyOf": [{"$ref": "#/$defs/phone"}, {"type": "null"}]},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "contact"],
    "additionalProperties": False,
    "$defs": {"phone": {"type": "string", "pattern": "^\\+[0-9]{6,9}$"}},
}
REGEX = r"[a-z]{3}-[0-9]{2,4}"
CHOICES = ["yes", "no", "maybe later"]
# Sums and products of small numbers, nested at most once: a finite language.
GRAMMAR = r"""
root ::= term (op term){0,3}
term ::= num | "(" num (op num){1,3} ")"
op ::= "+" | "*"
num ::= [0-9]{1,3}
"""
_NUM = r"[0-9]{1,3}"
_TERM = rf"(?:{_NUM}|\({_NUM}(?:[+*]{_NUM}){{1,3}}\))"
GRAMMAR_LANGUAGE = re.compile(rf"{_TERM}(?:[+*]{_TERM}){{0,3}}")

CONSTRAINTS = {
    "json": StructuredOutputsParams(json=PERSON),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}
# (Any JSON object, `json_object=True`, has no length bound: a model of noise, or the
# bundled model greedy, may write one string forever. The SmolLM2 tests check it.)


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert GRAMMAR_LANGUAGE.fullmatch(text), text


@pytest.fixture(scope="module", params=["random", "bundled"])
def llm(request, tmp_path_factory):
    if request.param == "random":
        path = make_tiny_model(str(tmp_path_factory.mktemp("tiny_model_so")))
    else:
        path = BUNDLED_MODEL_PATH
    # The bundled model was trained on 256 positions: its max_model_len can be no longer.
    return LLM(path, **{**TIGHT_ENGINE_ARGS, "max_model_len": 256})


PROMPTS = [
    "Describe a person.",
    "Here is a much longer prompt, long enough that its prefill is chunked over steps. " * 2,
    "Answer:",
]


def test_every_constrained_output_is_valid(llm):
    prompts, params, kinds = [], [], []
    for i, (kind, constraint) in enumerate(CONSTRAINTS.items()):
        for j, temperature in enumerate((0.0, 1.0)):
            prompts.append(PROMPTS[(i + j) % len(PROMPTS)])
            params.append(
                SamplingParams(
                    temperature=temperature,
                    seed=100 + i,
                    n=3 if temperature else 1,
                    max_tokens=240,
                    structured_outputs=constraint,
                )
            )
            kinds.append(kind)
    for i in range(4):  # free requests in the same steps
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        kinds.append(None)
    core = llm.engine_core
    preemptions_before = core.num_preemptions
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for kind, output in zip(kinds, outputs, strict=True):
        for completion in output.outputs:
            if kind is None:
                assert len(completion.token_ids) == 40
                continue
            check(kind, completion.text)
            assert completion.finish_reason == "stop", (kind, completion.text)
        if kind is not None and len(output.outputs) == 3:
            assert len({c.text for c in output.outputs}) > 1 or kind == "choice"
    assert core.num_preemptions > preemptions_before, "no preemption was forced"
    assert core.compiles_after_warmup() == 0
    assert core.num_free_blocks() == core.runner.num_blocks - 1


def test_seeded_constrained_sampling_repeats(llm):
    params = SamplingParams(
        temperature=1.0, seed=7, max_tokens=240, structured_outputs=CONSTRAINTS["json"]
    )
    first, second = (llm.generate("Who?", params, use_tqdm=False)[0] for _ in range(2))
    assert first.outputs[0].text == second.outputs[0].text
    check("json", first.outputs[0].text)


def test_free_greedy_requests_ignore_constrained_neighbours(llm):
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    constrained = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=c)
        for s, c in enumerate(CONSTRAINTS.values())
    ]
    mixed = llm.generate(
        PROMPTS + ["Noise."] * len(constrained), [free] * 3 + constrained, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (dict(json={"type": "objekt"}), "structured_outputs.json"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(regex="[a-"), "structured_outputs.regex"),
        (dict(grammar="root ::= (("), "structured_outputs.grammar"),
    ],
)
def test_bad_constraints_are_refused_before_anything_runs(llm, constraint, message):
    core = llm.engine_core
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["Fine.", "Bad."], [SamplingParams(max_tokens=8), params], use_tqdm=False)
    assert not core.has_unfinished_requests()
    assert core.num_free_blocks() == core.runner.num_blocks - 1


def test_a_finished_constraint_ends_the_request_before_min_tokens(llm):
    """A grammar that is complete lets nothing but EOS follow, which min_tokens holds back:
    the request ends with the complete output (it failed, blaming the vocabulary)."""
    for constraint in (dict(choice=["yes", "no"]), dict(regex="[0-9]{2}")):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=20,
            min_tokens=10,
            structured_outputs=StructuredOutputsParams(**constraint),
        )
        output = llm.generate("Answer:", params, use_tqdm=False)[0].outputs[0]
        assert output.finish_reason == "stop", output
        assert output.text in ("yes", "no") or re.fullmatch("[0-9]{2}", output.text), output
        # Ended at once: no token past the grammar's end (forced ones, where the argmax of
        # nothing allowed happened to be EOS, as on the bundled model).
        assert len(output.token_ids) < params.min_tokens, output


def test_a_constraint_names_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


def test_constraint_starts_after_the_reasoning_ends(llm):
    """With `reasoning_end` the model writes freely until that text, then the constraint
    holds for the rest (the answer after `</think>`, over HTTP with --reasoning-parser)."""
    free = llm.generate("Answer:", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    marker = tokenizer.decode(free[0].outputs[0].token_ids[:3])  # ends on a token boundary
    params = SamplingParams(
        temperature=0.0,
        max_tokens=60,
        structured_outputs=StructuredOutputsParams(regex=REGEX, reasoning_end=marker),
    )
    text = llm.generate("Answer:", params, use_tqdm=False)[0].outputs[0].text
    assert text.startswith(marker) and re.fullmatch(REGEX, text[len(marker) :]), text
