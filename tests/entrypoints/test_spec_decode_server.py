"""`jengine serve --speculative-config ...` (n-gram, and a draft model: another random
model on the same tokenizer): the flag reaches the engine, completions equal those of an
engine without speculation, and /metrics counts the drafts."""

import json

import httpx2
import openai
import pytest

from tests.entrypoints.remote_server import MODEL_NAME, SERVER_ARGS, RemoteServer, metric
from tests.entrypoints.tiny_model import ENGINE_ARGS, make_tiny_model

# Repeated words: prompt lookup has something to propose.
PROMPTS = ["the cat and the dog and the cat and the", "one two one two one two one"]


@pytest.fixture(params=["ngram", "draft_model"])
def spec(request, tmp_path) -> str:
    if request.param == "ngram":
        ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        return json.dumps({**ngram, "num_speculative_tokens": 3})
    draft = make_tiny_model(str(tmp_path / "draft"), seed=1)
    return json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 3})


def test_speculative_serving(tiny_model, spec):
    from jengine import LLM, SamplingParams

    llm = LLM(tiny_model, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with RemoteServer(tiny_model, [*SERVER_ARGS, "--speculative-config", spec]) as server:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none", max_retries=0)
        choices = client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS, max_tokens=40, temperature=0.0,
            extra_body={"ignore_eos": True},
        ).choices  # fmt: skip
        assert [c.text for c in choices] == expected
        text = httpx2.get(server.url_for("metrics"), timeout=30).text
        assert metric(text, "jengine:spec_decode_num_draft_tokens_total") > 0
        assert metric(text, "jengine:spec_decode_num_drafts_total") > 0
        assert metric(text, "jengine:compiles_after_warmup") == 0
