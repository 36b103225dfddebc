"""LoRARequest: which LoRA adapter a request runs with (vLLM's class of the same name).

Where it sits: the user passes one to `LLM.generate(..., lora_request=...)`, or the OpenAI
server makes one from a request's `model` when it names an adapter; it travels with the
request across the ZMQ boundary (`EngineCoreRequest`), into the scheduler's `Request` (the
adapter is part of its block hashes, and a step holds at most `max_loras` adapters) and to
the model runner, whose `LoRASlots` puts the adapter in a device slot.

What it promises: `lora_int_id` (> 0) names the adapter inside the engine: requests with
the same id share the adapter's slot and its prefix-cache blocks, so one id must always
mean the same weights (the engine refuses a second, different path under a loaded id).
`lora_path` is a PEFT folder the engine core reads the first time it sees the id; it may
be empty for an adapter added in memory (`LLM.add_lora`). A plain-typed msgspec Struct.
"""

from __future__ import annotations

import json

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True, array_like=True):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


def parse_lora_modules(values: list[str] | None) -> dict[str, str]:
    """`--lora-modules` values: `name=path`, or vLLM's JSON form
    `{"name": ..., "path": ...}`; -> name -> path."""
    modules = {}
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"--lora-modules {value!r}: JSON needs a name and a path"
                ) from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path")
        modules[name] = path
    return modules
