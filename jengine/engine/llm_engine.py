"""LLMEngine: the synchronous engine `LLM` drives, with vLLM's calls.

Where it sits: `LLM` (jengine/entrypoints/llm.py) -> LLMEngine -> client -> EngineCore.
`add_request` tokenizes and validates (InputProcessor) and registers the request with the
OutputProcessor, which fans n > 1 out into n sequences; `step()` runs one engine-core step
and returns the RequestOutputs it produced. The engine core runs in this process
(`from_engine_core`) or in its own (`from_engine_args`, over ZeroMQ). AsyncLLM is the same
front end over an asyncio client.
"""

import itertools

from jengine.config import EngineConfig
from jengine.engine.arg_utils import EngineArgs
from jengine.engine.client import InprocClient, LostRequests
from jengine.engine.input_processor import InputProcessor, PromptType
from jengine.engine.mp_clients import SyncMPClient
from jengine.engine.output_processor import OutputProcessor, RequestError
from jengine.engine.tokenizer import load_tokenizer
from jengine.generation_config import sampling_defaults
from jengine.lora_request import LoRARequest
from jengine.outputs import RequestOutput
from jengine.pooling import PoolingParams
from jengine.protocol import EngineCoreRequest
from jengine.sampling_params import RequestOutputKind, SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, client, tokenizer, vocab_size: int):
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.sampling_defaults = sampling_defaults(config.model)
        self.input_processor = InputProcessor.from_config(config, tokenizer, vocab_size)
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
            tokenizer = load_tokenizer(config)  # while the engine process starts
            return cls(config, client, tokenizer, client.wait_for_ready().vocab_size)
        except BaseException:
            client.shutdown()
            raise

    def shutdown(self) -> None:
        self.client.shutdown()

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        *,
        output_kind: RequestOutputKind | None = None,
    ) -> None:
        """Tokenize, validate and send one request (ValueError for bad input or an id in
        use); the arguments in vLLM's order (`arrival_time`: time.time() of its arrival)."""
        text, request = self.input_processor.process(
            request_id, prompt, params, priority, arrival_time, lora_request
        )
        self.add_processed_request(request, text, output_kind)

    def add_processed_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        output_kind: RequestOutputKind | None = None,
    ) -> None:
        """Send a request the input processor already made (so it is tokenized once)."""
        self.client.add_request(self.output_processor.add_request(request, prompt, output_kind))

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.client.abort_requests(self.output_processor.abort_requests(request_ids))

    def step(self) -> list[RequestOutput]:
        outputs = self.client.get_output()
        if isinstance(outputs, LostRequests):
            # Offline, a lost replica fails the whole run (a batch is all or nothing).
            raise outputs.error
        processed = self.output_processor.process_outputs(outputs.outputs)
        self.client.abort_requests(processed.reqs_to_abort)
        for request_id, error in processed.failed.items():
            # Offline, as a lost replica: the run fails, naming the request (it is already
            # forgotten and aborted, so the engine holds nothing of it).
            if isinstance(error, RequestError):
                raise type(error)(f"request {request_id}: {error}") from None
            raise RuntimeError(f"building the output of request {request_id} failed") from error
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def next_request_id(self) -> str:
        return str(next(self._counter))
