"""Bad input gets a clear ValueError before anything runs; the engine carries on, no leaks."""

from dataclasses import replace

import numpy as np
import pytest

from jengine import SamplingParams
from jengine.engine.input_processor import InputProcessor
from tests.engine.engine_helpers import ENGINE_KWARGS, hf_greedy, random_prompts
from tests.models.checkpoints import VOCAB


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logprobs=-2), "logprobs"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_engine_carries_on(llm, checkpoint):
    good = random_prompts(1, seed=11)[0]
    max_len = ENGINE_KWARGS["max_model_len"]
    cases = [
        ({"prompt_token_ids": list(range(3, 3 + max_len + 1))}, "longer than the maximum"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [5, VOCAB + 3]}, "out of vocabulary"),
        ({"prompt_token_ids": [5, -1]}, "out of vocabulary"),
        ("some text", "tokenizer"),  # this checkpoint ships no tokenizer
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            # The bad prompt sits between good ones: nothing of the batch may run.
            llm.generate([{"prompt_token_ids": good}, prompt, {"prompt_token_ids": good}])
        assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate({"prompt_token_ids": good}, SamplingParams(logprobs=50))
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([{"prompt_token_ids": good}] * 2, [SamplingParams()] * 3)
    # An empty list is one of the wrong length too (it was taken as "none": the defaults).
    with pytest.raises(ValueError, match="got 0 sampling params for 2 prompts"):
        llm.generate([{"prompt_token_ids": good}] * 2, [])
    # min_tokens holds back a fixed number of ids (EOS among them): more is refused, not cut.
    stop_ids = list(range(10, 25))  # 15: with EOS, the most it holds back
    held = SamplingParams(temperature=0, min_tokens=4, max_tokens=8, stop_token_ids=stop_ids)
    held.logit_bias = {stop_ids[-1]: 100.0}
    [output] = llm.generate({"prompt_token_ids": good}, held)
    assert output.outputs[0].token_ids[-1] == stop_ids[-1]
    assert len(output.outputs[0].token_ids) == 5
    held.stop_token_ids = [*stop_ids, 25, 26]
    with pytest.raises(ValueError, match="min_tokens holds back at most 16 token ids"):
        llm.generate({"prompt_token_ids": good}, held)
    # First come, first served (the default) has no use for a priority: refused, as in vLLM.
    with pytest.raises(ValueError, match="priority 1 needs priority scheduling"):
        llm.generate([{"prompt_token_ids": good}] * 2, priority=[0, 1])
    # Arguments of the wrong kind name themselves (not an AttributeError from inside).
    with pytest.raises(TypeError, match="^prompts must be"):
        llm.generate(123)
    with pytest.raises(TypeError, match="^sampling_params must be a SamplingParams"):
        llm.generate({"prompt_token_ids": good}, {"max_tokens": 3})
    config = llm.llm_engine.config
    config = replace(config, scheduler=replace(config.scheduler, policy="priority"))
    prioritized = InputProcessor.from_config(config, None, VOCAB)
    prioritized.process("p", {"prompt_token_ids": good}, SamplingParams(), priority=-3)
    out = llm.generate({"prompt_token_ids": good}, SamplingParams(temperature=0, max_tokens=5))
    assert out[0].outputs[0].token_ids == hf_greedy(checkpoint[1], good, 5)
    # numpy ids in a prompt dict, as research code holds them (they were "out of vocabulary").
    greedy = SamplingParams(temperature=0, max_tokens=5)
    out = llm.generate({"prompt_token_ids": np.asarray(good)}, greedy)
    assert out[0].outputs[0].token_ids == hf_greedy(checkpoint[1], good, 5)
    assert llm.engine_core.num_free_blocks() == llm.engine_core.runner.num_blocks - 1


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    for i, prompt in enumerate(random_prompts(4, seed=12, low=30, high=60)):
        engine.add_request(
            f"abort-{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=50)
        )
    engine.step()
    engine.step()
    assert llm.engine_core.num_free_blocks() < llm.engine_core.runner.num_blocks - 1
    engine.abort_request([f"abort-{i}" for i in range(4)])
    assert not engine.has_unfinished_requests()
    engine.step()
    assert llm.engine_core.num_free_blocks() == llm.engine_core.runner.num_blocks - 1
