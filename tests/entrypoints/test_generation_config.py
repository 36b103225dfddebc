"""The checkpoint's recommended sampling (generation_config.json), as vLLM's
`--generation-config` reads it: the defaults of every request field left unset, in
`LLM.generate` and through `jengine serve`; a request's own values win; "vllm" ignores the
file; values equal to transformers' own defaults are not recommendations."""

import json
import shutil

import openai
import pytest

from jengine import LLM, SamplingParams
from jengine.config import ModelConfig
from jengine.generation_config import sampling_defaults
from tests.entrypoints.remote_server import MODEL_NAME, SERVER_ARGS, RemoteServer
from tests.entrypoints.tiny_model import ENGINE_ARGS

PROMPT = "The quick brown fox"
# top_k 1 makes any temperature greedy: what a default request samples is then known.
# max_new_tokens is the length of a request that sets none (vLLM reads it as max_tokens).
RECOMMENDED = {"temperature": 0.7, "top_k": 1, "top_p": 1.0, "repetition_penalty": 1.0,
               "max_new_tokens": 10}  # fmt: skip


@pytest.fixture(scope="module")
def recommending_model(tiny_model, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(tiny_model, path)
    with open(path / "generation_config.json") as f:
        config = json.load(f)
    with open(path / "generation_config.json", "w") as f:
        json.dump({**config, **RECOMMENDED, "do_sample": True}, f)
    return str(path)


def test_only_recommendations_are_read(recommending_model, tiny_model, tmp_path):
    # top_p 1.0 and repetition_penalty 1.0 are transformers' defaults: no advice.
    recommended = {"temperature": 0.7, "top_k": 1, "max_tokens": 10}
    assert sampling_defaults(ModelConfig(recommending_model)) == recommended
    assert sampling_defaults(ModelConfig(recommending_model, generation_config="vllm")) == {}
    assert sampling_defaults(ModelConfig(tiny_model)) == {}  # ids only, as save_pretrained
    elsewhere = ModelConfig(tiny_model, generation_config=recommending_model)
    assert sampling_defaults(elsewhere) == recommended
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        sampling_defaults(ModelConfig(tiny_model, generation_config=str(tmp_path)))


def test_llm_generate_samples_as_recommended(recommending_model):
    llm = LLM(recommending_model, **ENGINE_ARGS)
    assert llm.get_default_sampling_params().top_k == 1
    [unset] = llm.generate(PROMPT, use_tqdm=False)  # it was cut at 16, not 10
    assert (
        len(unset.outputs[0].token_ids) <= 10 and llm.get_default_sampling_params().max_tokens == 10
    )
    greedy = SamplingParams(temperature=0, max_tokens=12)
    expected = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    default = llm.get_default_sampling_params()
    default.max_tokens, default.seed = 12, 7
    assert llm.generate(PROMPT, default, use_tqdm=False)[0].outputs[0].token_ids == expected
    ignoring = LLM(recommending_model, generation_config="vllm", **ENGINE_ARGS)
    assert ignoring.get_default_sampling_params().top_k == 0


def test_the_server_fills_unset_fields_from_it(recommending_model):
    with RemoteServer(recommending_model, SERVER_ARGS) as server:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="x", max_retries=0)
        greedy = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0
        )
        for seed in (1, 2):
            # temperature 0.7 and top_k 1 from the file: greedy whatever the seed.
            out = client.completions.create(
                model=MODEL_NAME, prompt=PROMPT, max_tokens=12, seed=seed
            )
            assert out.choices[0].text == greedy.choices[0].text
        log = server.log_text()
        assert "sampling defaults from" in log and "top_k=1" in log
        # A chat request without max_tokens gets the recommended 10; its own value wins.
        messages = [{"role": "user", "content": PROMPT}]
        unset = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                               extra_body={"ignore_eos": True})  # fmt: skip
        assert unset.usage.completion_tokens == 10
        own = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12,
                                             extra_body={"ignore_eos": True})  # fmt: skip
        assert own.usage.completion_tokens == 12
