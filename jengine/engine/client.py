"""Clients of the engine core: how the front end talks to it.

Where it sits: `LLMEngine` (and later `AsyncLLM`) hold one client; the client hides
whether the engine core runs in this process (`InprocClient`) or in its own process
behind ZeroMQ.

Every client offers the same calls: `add_request`, `abort_requests`, `get_output`
(runs or waits for one step's outputs) and `call_utility(name, *args)` for the few
engine-core methods the front end may call (`num_free_blocks`, `update_weights`, ...).
"""

from jengine.core.outputs import EngineCoreOutputs
from jengine.engine.protocol import EngineCoreRequest

UTILITY_METHODS = (
    "num_free_blocks",
    "compiles_after_warmup",
    "update_weights",
    "has_unfinished_requests",
)


class InprocClient:
    """The engine core in this process: `get_output` runs one step."""

    def __init__(self, engine_core):
        self.engine_core = engine_core

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, name: str, *args):
        if name not in UTILITY_METHODS:
            raise ValueError(f"unknown engine-core utility {name!r}")
        return getattr(self.engine_core, name)(*args)

    def shutdown(self) -> None:
        pass
