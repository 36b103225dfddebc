"""LLMEngine: the synchronous engine `LLM` drives, with vLLM's calls.

Where it sits: `LLM` (jengine/entrypoints/llm.py) -> LLMEngine -> client -> EngineCore.
`add_request` tokenizes and validates (InputProcessor), fans out n > 1 into n sequences
and registers them with the OutputProcessor; `step()` runs one engine-core step and
returns the RequestOutputs it produced. The engine core runs in this process
(`from_engine_core`) or in its own (`from_engine_args`, over ZeroMQ). The helpers here
(`load_tokenizer`, `eos_token_ids_of`, `fan_out`) are shared with AsyncLLM.
"""

import itertools
import json
import os

from transformers import AutoTokenizer

from jengine.config import EngineConfig
from jengine.engine.arg_utils import EngineArgs
from jengine.engine.client import InprocClient, SyncMPClient
from jengine.engine.input_processor import InputProcessor, PromptType
from jengine.engine.output_processor import OutputProcessor, RequestOutputKind
from jengine.engine.protocol import EngineCoreRequest
from jengine.outputs import RequestOutput
from jengine.sampling_params import SamplingParams

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(config: EngineConfig):
    """The HF tokenizer of the model folder, or None when it ships none (token ids only)."""
    path = config.model.tokenizer or config.model.model
    if path is None:
        return None
    if os.path.isdir(path) and not any(
        os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES
    ):
        return None
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids_of(path: str | None, tokenizer) -> list[int]:
    """EOS ids as HF generate sees them: generation_config.json, then config.json, then the
    tokenizer. Several ids (Llama 3, the bundled model's `<|end|>`) all end generation."""
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name) if path else None
        if file and os.path.isfile(file):
            with open(file) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return eos if isinstance(eos, list) else [eos]
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [tokenizer.eos_token_id]
    return []


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index` of an n > 1 request: n = 1, and a distinct seed if one was given."""
    child = params.clone()
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    return child


def fan_out(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """The engine-core sequences of one user request: itself for n == 1, else n children
    with ids `{index}_{request_id}` (sequence `index` is element `index`)."""
    params = request.sampling_params
    if params.n == 1:
        return [request]
    children = []
    for index in range(params.n):
        child = request.__copy__()
        child.request_id = f"{index}_{request.request_id}"
        child.sampling_params = child_params(params, index)
        children.append(child)
    return children


class LLMEngine:
    def __init__(self, config: EngineConfig, client, tokenizer, vocab_size: int):
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(
            tokenizer,
            config.scheduler.max_model_len,
            vocab_size,
            eos_token_ids=eos_token_ids_of(config.model.model, tokenizer),
        )
        self.output_processor = OutputProcessor(tokenizer)
        self._counter = itertools.count()

    @classmethod
    def from_engine_core(cls, config: EngineConfig, engine_core, tokenizer) -> "LLMEngine":
        return cls(
            config, InprocClient(engine_core), tokenizer, engine_core.runner.config.vocab_size
        )

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        """The engine core in its own process, behind a SyncMPClient (call `shutdown()`)."""
        config = engine_args.create_engine_config()
        client = SyncMPClient(config)
        try:
            return cls(config, client, load_tokenizer(config), client.ready.vocab_size)
        except BaseException:
            client.shutdown()
            raise

    def shutdown(self) -> None:
        self.client.shutdown()

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, request = self.input_processor.process(request_id, prompt, params, priority)
        for index, child in enumerate(fan_out(request)):
            self.output_processor.add_request(
                child, text, parent_id=request_id, index=index, output_kind=output_kind
            )
            self.client.add_request(child)

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.client.abort_requests(self.output_processor.abort_requests(request_ids))

    def step(self) -> list[RequestOutput]:
        outputs = self.client.get_output()
        request_outputs, reqs_to_abort = self.output_processor.process_outputs(outputs.outputs)
        self.client.abort_requests(reqs_to_abort)
        return request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def next_request_id(self) -> str:
        return str(next(self._counter))
