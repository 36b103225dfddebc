"""The models a request's `model` may name: the served model under its names, and the LoRA
adapters served beside it (vLLM's OpenAIServingModels).

Where it sits: `build_app` makes one from `--served-model-name` and `--lora-modules`; every
serving class checks a request's `model` with it (an unknown name is a 404) and gets the
`LoRARequest` the engine runs the request with; GET /v1/models lists it; the runtime
endpoints POST /v1/load_lora_adapter and /v1/unload_lora_adapter (only with
`--allow-runtime-lora-updating`, as vLLM gates them) change it. Jax-free: it lives in the
API-server process; the engine core reads an adapter's folder the first time a request
names it (a load reads it at once, so a bad folder is a 400 there).

Promises: each adapter name gets its own `lora_int_id`, never reused in this server's
life, so a name loaded again after an unload is a new adapter to the engine (its old
prefix-cache blocks are never matched); names are unique across the base model's names
and the adapters'.
"""

import itertools

from pydantic import Field

from jengine.entrypoints.openai.protocol import OpenAIError, RequestModel
from jengine.entrypoints.openai.protocol_tokenization import ModelCard, ModelList
from jengine.lora_request import LoRARequest


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's field; the name decides


class ServingModels:
    def __init__(
        self,
        base_names: list[str],
        model_path: str | None,
        max_model_len: int,
        lora_modules: dict[str, str] | None = None,
    ):
        self.base_names = base_names
        self.model_path = model_path
        self.max_model_len = max_model_len
        self._ids = itertools.count(1)
        self.loras: dict[str, LoRARequest] = {}
        for name, path in (lora_modules or {}).items():
            self._add(name, path)

    @property
    def base_name(self) -> str:
        return self.base_names[0]

    def _add(self, name: str, path: str) -> LoRARequest:
        if name in self.base_names or name in self.loras:
            raise OpenAIError(f"The model `{name}` exists already.", param="lora_name")
        lora = LoRARequest(name, next(self._ids), path)
        self.loras[name] = lora
        return lora

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); a 404 for an unknown name."""
        if model is None or model in self.base_names:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")
        return lora

    def response_name(self, model: str | None) -> str:
        """The `model` a response names: the adapter's, else the served model's first."""
        return model if model in self.loras else self.base_name

    def model_list(self) -> ModelList:
        cards = [
            ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)
            for name in self.base_names
        ]
        cards += [
            ModelCard(
                id=name,
                root=lora.lora_path,
                parent=self.base_name,
                max_model_len=self.max_model_len,
            )
            for name, lora in self.loras.items()
        ]
        return ModelList(data=cards)

    # -- runtime updates --------------------------------------------------------------------

    async def load(self, engine, name: str, path: str) -> LoRARequest:
        """Register `name` and have the engine read its folder now (a 400 naming why it
        cannot be served, and nothing registered)."""
        lora = self._add(name, path)
        try:
            await engine.add_lora(lora)
        except Exception as e:
            del self.loras[name]
            raise OpenAIError(f"Loading LoRA adapter {name!r} failed: {_reason(e)}") from None
        return lora

    async def unload(self, engine, name: str) -> None:
        lora = self.loras.get(name)
        if lora is None:
            raise OpenAIError(f"The LoRA adapter `{name}` does not exist.", 404, "lora_name")
        try:
            await engine.remove_lora(lora.lora_int_id)
        except Exception as e:
            raise OpenAIError(
                f"Unloading LoRA adapter {name!r} failed: {_reason(e)}", param="lora_name"
            ) from None
        del self.loras[name]


def _reason(error: Exception) -> str:
    # The engine core's failures come back as "ValueError: <message>".
    return str(error).removeprefix("ValueError: ")
