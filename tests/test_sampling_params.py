"""SamplingParams: vLLM defaults, normalization, clear errors, msgspec round-trip."""

import msgspec
import pytest

from jengine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None
    assert not p.ignore_eos and p.skip_special_tokens and p.detokenize
    assert not p.is_greedy


def test_normalization():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2)
    assert greedy.is_greedy
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: float("inf")}}, "logit_bias"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),  # it wrapped onto seed 0
        ({"seed": -(2**63) - 1}, "seed"),
        # Wrong types: a TypeError of a comparison once, naming no field.
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": "1"}, "top_p"),
        ({"presence_penalty": None}, "presence_penalty"),
        # vLLM's: stop strings are matched on text that detokenize=False never makes
        # (they were ignored).
        ({"stop": ["["], "detokenize": False}, "stop"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
    ],
)
def test_bad_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_msgpack_round_trip_and_clone():
    p = SamplingParams(
        n=2,
        temperature=0.7,
        top_k=40,
        stop=["\n"],
        stop_token_ids=[7],
        logit_bias={3: -1.5},
        seed=11,
        max_tokens=None,
        logprobs=3,
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams)
    assert decoded == p
    # Validation also guards decoding.
    bad = msgspec.msgpack.encode({"top_p": 0.0})
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.msgpack.decode(bad, type=SamplingParams)
    c = p.clone()
    c.stop.append("x")
    assert c != p and p.stop == ["\n"]
