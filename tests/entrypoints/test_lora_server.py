"""`jengine serve --enable-lora --lora-modules ...` through the official openai client: a
request's `model` selects an adapter (and the response names it), /v1/models lists the
adapters with their parent, adapters are loaded and unloaded at runtime
(`--allow-runtime-lora-updating`), and an unknown adapter is a 404 in OpenAI's body. The
served completions are those of the in-process engine with the same adapters (whose
equality with PEFT tests/engine/test_lora_engine.py shows)."""

import os
import re

import httpx2
import openai
import pytest

from tests.entrypoints.remote_server import MODEL_NAME, SERVER_ARGS, RemoteServer
from tests.entrypoints.tiny_model import ENGINE_ARGS
from tests.models.lora_files import ADAPTERS, write_adapter

PROMPTS = ["Once upon a time", "The scheduler kept a list"]
LORA_ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-adapters")
    paths = {}
    for seed, name in enumerate(("attn-r4", "mlp-r8")):
        paths[name] = str(root / name)
        write_adapter(tiny_model, paths[name], *ADAPTERS[name], seed=seed)
    return paths


def _texts(client, model: str) -> list[str]:
    choices = client.completions.create(
        model=model, prompt=PROMPTS, max_tokens=12, temperature=0.0,
        extra_body={"ignore_eos": True},
    ).choices  # fmt: skip
    return [c.text for c in choices]


def test_adapters_selected_by_model_loaded_and_unloaded(tiny_model, adapters):
    from jengine import LLM, SamplingParams
    from jengine.lora_request import LoRARequest

    llm = LLM(tiny_model, **ENGINE_ARGS, **LORA_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = {
        name: [
            o.outputs[0].text
            for o in llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)
        ]
        for name, lora in (
            (MODEL_NAME, None),
            ("attn-r4", LoRARequest("attn-r4", 1, adapters["attn-r4"])),
            ("mlp-r8", LoRARequest("mlp-r8", 2, adapters["mlp-r8"])),
        )
    }
    assert len({tuple(texts) for texts in expected.values()}) == 3  # the adapters matter
    flags = [
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"attn-r4={adapters['attn-r4']}", "--allow-runtime-lora-updating",
    ]  # fmt: skip
    with RemoteServer(tiny_model, [*SERVER_ARGS, *flags]) as server:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none", max_retries=0)
        models = {m.id: m for m in client.models.list().data}
        assert models["attn-r4"].parent == MODEL_NAME
        assert models["attn-r4"].root == adapters["attn-r4"]
        assert getattr(models[MODEL_NAME], "parent", None) is None
        assert _texts(client, "attn-r4") == expected["attn-r4"]
        assert _texts(client, MODEL_NAME) == expected[MODEL_NAME]
        response = client.completions.create(model="attn-r4", prompt=PROMPTS[0], max_tokens=2)
        assert response.model == "attn-r4"
        with pytest.raises(openai.NotFoundError, match="The model `mlp-r8` does not exist"):
            _texts(client, "mlp-r8")

        def post(route: str, **body) -> httpx2.Response:
            return httpx2.post(server.url_for("v1", route), json=body, timeout=60)

        loaded = post("load_lora_adapter", lora_name="mlp-r8", lora_path=adapters["mlp-r8"])
        assert loaded.status_code == 200, loaded.text
        assert _texts(client, "mlp-r8") == expected["mlp-r8"]
        chat = client.chat.completions.create(
            model="mlp-r8", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.model == "mlp-r8"
        again = post("load_lora_adapter", lora_name="mlp-r8", lora_path=adapters["mlp-r8"])
        assert again.status_code == 400 and "exists already" in again.json()["error"]["message"]
        not_an_adapter = os.path.dirname(adapters["mlp-r8"])
        bad = post("load_lora_adapter", lora_name="bad", lora_path=not_an_adapter)
        assert bad.status_code == 400, bad.text
        assert "no adapter_config.json" in bad.json()["error"]["message"]
        assert "bad" not in {m.id for m in client.models.list().data}
        unloaded = post("unload_lora_adapter", lora_name="mlp-r8")
        assert unloaded.status_code == 200, unloaded.text
        with pytest.raises(openai.NotFoundError):
            _texts(client, "mlp-r8")
        gone = post("unload_lora_adapter", lora_name="mlp-r8")
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
        # The adapter still loaded serves on.
        assert _texts(client, "attn-r4") == expected["attn-r4"]
        # vLLM's lora_requests_info: steps ran with attn-r4 running (its two prompts at
        # once), and the series set last (at the idle steps) names no adapter.
        text = httpx2.get(server.url_for("metrics"), timeout=60).text
        series = dict(re.findall(r"^jengine:lora_requests_info\{(.*)\} (\S+)$", text, re.M))
        assert 'max_lora="2",running_lora_adapters="attn-r4",waiting_lora_adapters=""' in series
        assert 'running_lora_adapters="mlp-r8"' in " ".join(series)
        latest = max(series, key=lambda labels: float(series[labels]))
        assert latest == 'max_lora="2",running_lora_adapters="",waiting_lora_adapters=""'


def test_lora_modules_flag_forms():
    from jengine.lora_request import parse_lora_modules

    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == {"a": "/x", "b": "/y"}
    for bad in ("a", "=/x", '{"name": "b"}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])
