"""Async scheduling changes nothing a request sees: the same tokens, logprobs (1e-5) and
finish reasons as with `--no-async-scheduling`, for every sampling feature, structured
outputs, `allowed_token_ids` and `bad_words`, chunked prefill, prefix hits and preemption
in one batch; a request that stops emits nothing past its stop; an abort while its step is
in flight frees its blocks; and neither mode compiles after warmup.

Both engines run the tiny model with a real tokenizer (stop strings, grammars), a 24-token
budget (long prompts are chunked) and 24 blocks of 16 tokens for 8 running requests
(preemption).
"""

import pytest

from jengine import LLM, SamplingParams
from jengine.sampling_params import StructuredOutputsParams
from tests.engine.engine_helpers import (
    TIGHT_ENGINE_ARGS,
    assert_engines_clean,
    assert_same_outputs,
    every_feature_batch,
)
from tests.entrypoints.tiny_model import make_tiny_model

MODES = {"async": True, "sync": False}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny_model_async")))
    return {name: LLM(path, async_scheduling=on, **TIGHT_ENGINE_ARGS) for name, on in MODES.items()}


def both(engines, prompts, params) -> dict[str, list]:
    return {name: llm.generate(prompts, params, use_tqdm=False) for name, llm in engines.items()}


def assert_same(outputs: dict[str, list]) -> None:
    assert_same_outputs(outputs["async"], outputs["sync"], "with async scheduling")


def test_the_engines_run_in_the_modes_they_were_asked_for(engines):
    assert engines["async"].engine_core.async_scheduling
    assert not engines["sync"].engine_core.async_scheduling


def test_every_sampling_feature_under_chunking_prefix_hits_and_preemption(engines):
    prompts, params = every_feature_batch(seed=0)
    outputs = both(engines, prompts, params)
    assert_same(outputs)
    assert engines["async"].engine_core.num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in outputs["async"])
    assert_engines_clean(engines)


def test_structured_outputs_mixed_with_free_requests(engines):
    prompts = [f"Request {i}: answer" for i in range(6)]
    constrained = [
        StructuredOutputsParams(regex=r"[a-z]{3,8}( [a-z]{2,6}){2}\."),
        StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
        StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                      "required": ["n"], "additionalProperties": False}),
    ]  # fmt: skip
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=constrained[0]),
        SamplingParams(temperature=0, max_tokens=30),
        SamplingParams(temperature=1.0, seed=5, max_tokens=20, structured_outputs=constrained[1]),
        SamplingParams(temperature=1.0, seed=6, max_tokens=25),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=constrained[2]),
        SamplingParams(temperature=0, max_tokens=35, logprobs=2),
    ]
    outputs = both(engines, prompts, params)
    assert_same(outputs)
    assert outputs["async"][2].outputs[0].text in ("yes", "no", "maybe so")
    assert_engines_clean(engines)


def _contains(tokens: list[int], part: list[int]) -> int:
    """The index just past the first occurrence of `part` in `tokens`, or -1."""
    for end in range(len(part), len(tokens) + 1):
        if tokens[end - len(part) : end] == part:
            return end
    return -1


def test_allowed_token_ids_and_bad_words(engines):
    """The token lists mask as vLLM's do, in both modes: allowed_token_ids picks what a
    +100 logit bias on the same ids picks (EOS is not among them: the request runs to
    max_tokens); a bad word's tokens never follow the ones before them; free neighbours
    are untouched."""
    prompt = "Tell me about the sea"
    free = SamplingParams(temperature=0, max_tokens=30)
    [base] = engines["sync"].generate(prompt, free, use_tqdm=False)
    base_ids = list(base.outputs[0].token_ids)
    allowed = sorted(set(base_ids))[:5]
    processor = engines["sync"].llm_engine.input_processor
    for word in base.outputs[0].text.split():  # a word whose tokens the free output has
        banning = SamplingParams(temperature=0, max_tokens=30, bad_words=[word])
        processor.validate_params(banning)
        if any(_contains(base_ids, seq) > 0 for seq in banning.bad_words_token_ids):
            break
    else:
        pytest.fail("no word of the free output is spelled as it tokenizes alone")
    unspellable = SamplingParams(bad_words=["\u0093"])  # the ASCII vocabulary has no token
    processor.validate_params(unspellable)
    assert unspellable.bad_words_token_ids == []
    params = [
        SamplingParams(temperature=0, max_tokens=30, allowed_token_ids=allowed),
        SamplingParams(temperature=0, max_tokens=30, logit_bias={t: 100.0 for t in allowed}),
        banning,
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=30, allowed_token_ids=allowed),
        free,
    ]
    outputs = both(engines, [prompt] * len(params), params)
    assert_same(outputs)
    only, biased, banned, sampled, untouched = outputs["async"]
    assert only.outputs[0].token_ids == biased.outputs[0].token_ids
    assert only.outputs[0].finish_reason == "length"
    for completion in sampled.outputs:
        assert set(completion.token_ids) <= set(allowed)
    banned_ids = list(banned.outputs[0].token_ids)
    assert all(_contains(banned_ids, seq) == -1 for seq in banning.bad_words_token_ids)
    first = min(e for seq in banning.bad_words_token_ids if (e := _contains(base_ids, seq)) > 0)
    assert banned_ids[: first - 1] == base_ids[: first - 1]  # the same up to the ban
    assert banned_ids[first - 1] != base_ids[first - 1]
    assert untouched.outputs[0].token_ids == base.outputs[0].token_ids
    assert_engines_clean(engines)


def test_a_stop_emits_nothing_past_it(engines):
    """Stop token, stop string and EOS: with async scheduling the step after the stop is
    already running when the stop is seen; its token is dropped, never emitted."""
    prompt = "Tell me about the sea"
    free = engines["sync"].generate(prompt, SamplingParams(temperature=0, max_tokens=20))
    tokens, text = free[0].outputs[0].token_ids, free[0].outputs[0].text
    eos = engines["sync"].get_tokenizer().eos_token_id
    params = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tokens[5]]),
        SamplingParams(temperature=0, max_tokens=20, stop=[text[8:12]]),
        # EOS forced once min_tokens allows it: the 4th token.
        SamplingParams(temperature=0, max_tokens=20, min_tokens=3, logit_bias={eos: 100.0}),
    ]
    outputs = both(engines, [prompt] * 3, params)
    assert_same(outputs)
    by_token, by_string, by_eos = (o.outputs[0] for o in outputs["async"])
    first_stop = tokens.index(tokens[5])
    assert by_token.token_ids == tokens[: first_stop + 1]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", tokens[5])
    assert by_string.finish_reason == "stop" and by_string.text == text[: text.index(text[8:12])]
    assert by_eos.token_ids == by_eos.token_ids[:3] + [eos] and by_eos.finish_reason == "stop"
    assert_engines_clean(engines)


def test_an_abort_while_its_step_is_in_flight_frees_its_blocks(engines):
    llm = engines["async"]
    engine, core = llm.llm_engine, llm.engine_core
    params = SamplingParams(temperature=0, max_tokens=50)
    for i in range(4):
        engine.add_request(f"abort-{i}", {"prompt": f"Abort me {i} " * 8}, params)
    for _ in range(6):
        engine.step()
    assert core._in_flight is not None  # a step of these requests is on the device
    assert core.num_free_blocks() < core.runner.num_blocks - 1
    engine.abort_request([f"abort-{i}" for i in range(4)])
    assert core.num_free_blocks() == core.runner.num_blocks - 1
    assert not engine.has_unfinished_requests()
    # The dropped step is collected by the next one, and nothing of it leaks into later
    # requests.
    outputs = both(engines, ["After the abort"], SamplingParams(temperature=0, max_tokens=12))
    assert_same(outputs)
    assert_engines_clean(engines)


def test_an_id_used_again_while_a_step_of_its_old_request_is_in_flight(engines):
    """A request id used again as soon as its request stopped, or was aborted, while a step
    of the old request is still on the device: the new request gets the tokens it gets
    under a fresh id, never the old request's late token (which the persistent batch and
    the scheduler once took for the new request's first), and nothing leaks. (The engine
    core knows each registration by an id of its own, "again-<n>".)"""
    greedy = SamplingParams(temperature=0, max_tokens=12)
    [fresh] = engines["sync"].generate("Again and again", greedy, use_tqdm=False)
    [first] = engines["sync"].generate("First of all", greedy, use_tqdm=False)
    # A stop the scheduler cannot see coming (max_tokens it can): the step after it runs.
    stop = SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=[first.outputs[0].token_ids[4]]
    )
    engine, core = engines["async"].llm_engine, engines["async"].engine_core

    def run(prompt: str, params: SamplingParams) -> list[int]:
        engine.add_request("again", {"prompt": prompt}, params)
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        return finished[0].outputs[0].token_ids

    def old_step_in_flight() -> bool:
        return any(rid.startswith("again-") for rid in core._in_flight[0].num_scheduled_tokens)

    run("First of all", stop)
    assert old_step_in_flight()
    assert run("Again and again", greedy) == fresh.outputs[0].token_ids
    engine.add_request("again", {"prompt": "Abort me " * 4}, stop.clone())
    for _ in range(3):
        engine.step()
    engine.abort_request(["again"])
    assert old_step_in_flight()
    assert run("Again and again", greedy) == fresh.outputs[0].token_ids
    assert_engines_clean(engines)


def test_speculative_decoding_runs_synchronously(tmp_path_factory):
    """n-gram drafts are proposed from the tokens on the host: the engine says so and
    runs every step synchronously."""
    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny_model_spec")))
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    llm = LLM(path, speculative_config=spec, **TIGHT_ENGINE_ARGS)
    assert not llm.engine_core.async_scheduling
    output = llm.generate("one two one two one two", SamplingParams(temperature=0, max_tokens=8))
    assert len(output[0].outputs[0].token_ids) == 8


def test_a_decode_step_is_one_program_and_a_prefill_step_two(engines):
    """A decode step dispatches forward, head and sampler as one program (one dispatch a
    token); a step with a prefill chunk keeps the forward and the per-S sampling program.
    The equality tests above run both kinds."""
    from jengine.runner.prepared_step import PreparedStep
    from jengine.runner.step import SampleOutputs

    runner = engines["async"].engine_core.runner
    decode = runner.lower_step(PreparedStep.padding(runner.buckets.shape_for(2, 2, 1)))
    prefill = runner.lower_step(PreparedStep.padding(runner.buckets.shape_for(8, 2, 1)))
    assert len(decode) == 1 and len(prefill) == 2
    # The one program returns the sampler's outputs too: (cache, sampling state, hidden,
    # sampled tokens and logprobs).
    assert isinstance(decode[0].out_info[3], SampleOutputs)
    assert runner.compiles_after_warmup == 0
