"""Multi-step decoding (`num_scheduler_steps`) changes nothing a request sees: the same
tokens, logprobs (1e-5) and finish reasons as single steps, with async scheduling on and
off, for every sampling feature, n > 1, structured outputs beside free requests, chunked
prefill, prefix hits and preemption; a stop inside the K tokens emits nothing past it;
an abort while a multi-step decode is in flight frees its blocks; nothing compiles after
warmup. Each test also shows that multi-step decodes ran (which steps must run single:
tests/core/test_multi_step_scheduling.py).

The engines run the tiny model with a real tokenizer, a 24-token budget and 24 blocks of
16 tokens for 8 running requests (tests/engine/engine_helpers.py, TIGHT_ENGINE_ARGS).
"""

from collections import Counter

import pytest

from jengine import LLM, SamplingParams
from jengine.engine.arg_utils import EngineArgs
from jengine.sampling_params import StructuredOutputsParams
from tests.engine.engine_helpers import (
    TIGHT_ENGINE_ARGS,
    assert_engines_clean,
    assert_same_outputs,
    every_feature_batch,
)
from tests.engine.step_kinds import count_step_kinds
from tests.entrypoints.tiny_model import make_tiny_model

NUM_STEPS = 4
MODES = {  # name: (num_scheduler_steps, async_scheduling)
    "single": (1, False),
    "multi": (NUM_STEPS, True),
    "multi-sync": (NUM_STEPS, False),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny_model_multi_step")))
    engines = {
        name: LLM(path, num_scheduler_steps=k, async_scheduling=on, **TIGHT_ENGINE_ARGS)
        for name, (k, on) in MODES.items()
    }
    for llm in engines.values():
        llm.step_kinds = count_step_kinds(llm)
    return engines


def run_all(engines, prompts, params) -> dict[str, list]:
    """Every engine's outputs, after clearing its step counts."""
    for llm in engines.values():
        llm.step_kinds.clear()
    return {name: llm.generate(prompts, params, use_tqdm=False) for name, llm in engines.items()}


def assert_same(outputs: dict[str, list]) -> None:
    for name in ("multi", "multi-sync"):
        assert_same_outputs(outputs[name], outputs["single"], f"with {name}-step decoding")


def assert_multi_steps_ran(engines) -> None:
    for name in ("multi", "multi-sync"):
        kinds = engines[name].step_kinds
        assert set(kinds) <= {1, NUM_STEPS} and kinds[NUM_STEPS] > 0, (name, kinds)
    assert set(engines["single"].step_kinds) == {1}


def test_every_sampling_feature_under_chunking_prefix_hits_and_preemption(engines):
    prompts, params = every_feature_batch(seed=1)
    outputs = run_all(engines, prompts, params)
    assert_same(outputs)
    assert_multi_steps_ran(engines)
    assert engines["multi"].engine_core.num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in outputs["multi"])
    assert_engines_clean(engines)


def test_a_few_requests_decode_in_multi_steps_from_their_first_token(engines):
    """Nothing waits: after the prefill every step is a multi-step decode, also for
    max_tokens that are no multiple of K (the tokens past it are dropped) and min_tokens
    up to max_tokens."""
    prompts = ["The sea is", "Once upon a time", "Numbers: 1 2 3"]
    params = [
        SamplingParams(temperature=0, max_tokens=23, logprobs=2),
        SamplingParams(temperature=0.9, seed=3, max_tokens=18, frequency_penalty=0.5),
        # EOS masked to the end: min_tokens is never crossed among the tokens emitted.
        SamplingParams(temperature=1.0, seed=4, top_k=5, max_tokens=26, min_tokens=26),
    ]
    outputs = run_all(engines, prompts, params)
    assert_same(outputs)
    assert [len(o.outputs[0].token_ids) for o in outputs["multi"]] == [23, 18, 26]
    # 1 prefill step, then 25 tokens in multi-step decodes of 4 (the async engine has one
    # more step: the empty one that collects the last).
    assert engines["multi-sync"].step_kinds == Counter({1: 1, NUM_STEPS: 7})
    assert_engines_clean(engines)


def test_a_stop_inside_the_steps_emits_nothing_past_it(engines):
    """Stop token, stop string, EOS right after min_tokens, each inside a multi-step
    decode: the tokens sampled past the stop are dropped, never emitted."""
    prompt = "Tell me about the sea"
    free = engines["single"].generate(prompt, SamplingParams(temperature=0, max_tokens=20))
    tokens, text = free[0].outputs[0].token_ids, free[0].outputs[0].text
    eos = engines["single"].get_tokenizer().eos_token_id
    params = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tokens[6]]),
        SamplingParams(temperature=0, max_tokens=20, stop=[text[8:12]]),
        # EOS forced once min_tokens allows it: the 7th token. Steps that would cross
        # min_tokens run single (the masked ids change at it).
        SamplingParams(temperature=0, max_tokens=20, min_tokens=6, logit_bias={eos: 100.0}),
    ]
    outputs = run_all(engines, [prompt] * 3, params)
    assert_same(outputs)
    by_token, by_string, by_eos = (o.outputs[0] for o in outputs["multi"])
    first_stop = tokens.index(tokens[6])
    assert by_token.token_ids == tokens[: first_stop + 1]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", tokens[6])
    assert by_string.finish_reason == "stop" and by_string.text == text[: text.index(text[8:12])]
    assert by_eos.token_ids == by_eos.token_ids[:6] + [eos] and by_eos.finish_reason == "stop"
    assert_multi_steps_ran(engines)
    assert_engines_clean(engines)


def test_constrained_requests_decode_single_beside_free_ones(engines):
    prompts = [f"Request {i}: answer" for i in range(4)]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=30,
            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,8}( [a-z]{2,6}){2}\."),
        ),
        SamplingParams(temperature=0, max_tokens=30),
        SamplingParams(
            temperature=1.0,
            seed=5,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
        ),
        SamplingParams(temperature=0, max_tokens=60, logprobs=2),
    ]
    outputs = run_all(engines, prompts, params)
    assert_same(outputs)
    assert outputs["multi"][2].outputs[0].text in ("yes", "no", "maybe so")
    # Multi-step decodes ran once the constrained requests had ended, not before.
    assert_multi_steps_ran(engines)
    assert_engines_clean(engines)


def test_an_abort_while_a_multi_step_decode_is_in_flight_frees_its_blocks(engines):
    llm = engines["multi"]
    engine, core = llm.llm_engine, llm.engine_core
    llm.step_kinds.clear()
    params = SamplingParams(temperature=0, max_tokens=50)
    for i in range(4):
        engine.add_request(f"abort-{i}", {"prompt": f"Abort me {i} " * 8}, params)
    while llm.step_kinds[NUM_STEPS] == 0:
        engine.step()
    assert core._in_flight[0].num_decode_steps == NUM_STEPS  # on the device now
    engine.abort_request([f"abort-{i}" for i in range(4)])
    assert core.num_free_blocks() == core.runner.num_blocks - 1
    assert not engine.has_unfinished_requests()
    # The dropped step is collected by the next one, and nothing of it leaks into later
    # requests.
    outputs = run_all(engines, ["After the abort"], SamplingParams(temperature=0, max_tokens=12))
    assert_same(outputs)
    assert_engines_clean(engines)


def test_a_multi_step_decode_is_one_program(engines):
    from jengine.runner.prepared_step import PreparedStep
    from jengine.runner.step import SampleOutputs

    runner = engines["multi"].engine_core.runner
    shape = runner.buckets.shape_for(2, 2, 1)
    (program,) = runner.lower_step(PreparedStep.padding(shape, num_steps=NUM_STEPS))
    # (cache, sampling state, the sampler's outputs of every step)
    sampled = program.out_info[2]
    assert isinstance(sampled, SampleOutputs)
    assert sampled.sampled.shape == (NUM_STEPS, shape.num_reqs)
    assert runner.compiles_after_warmup == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_scheduler_steps=0), "num_scheduler_steps must be between 1 and 64"),
        (dict(num_scheduler_steps=65), "num_scheduler_steps must be between 1 and 64"),
        (
            dict(num_scheduler_steps=4, speculative_config={"method": "ngram"}),
            "combines with neither speculative decoding",
        ),
    ],
)
def test_what_multi_step_decoding_refuses(engines, kwargs, message):
    path = engines["single"].llm_engine.config.model.model
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=path, **kwargs).create_engine_config()
