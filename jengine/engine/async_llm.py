"""AsyncLLM: the asyncio engine the API server drives; `generate()` streams RequestOutputs
(`encode()`: an embedding engine's EmbeddingRequestOutput).

Where it sits: OpenAI serving layer -> AsyncLLM -> AsyncMPClient -> (ZMQ) -> EngineCoreProc.
Prompts are tokenized and validated here (InputProcessor) and outputs detokenized here
(OutputProcessor), in the API process, which never imports jax.

Promises:
- one output-handler task pulls every `EngineCoreOutputs`, runs the OutputProcessor, puts
  each RequestOutput in its request's collector (one pending item, however slowly the
  request is read: output_collector.py), aborts in the engine core the sequences a stop
  string ended, and feeds the stat loggers;
- a failure while building one request's output ends that request with the error; the
  others carry on;
- a `generate()` that is cancelled or closed early (client disconnect) aborts its request,
  so its KV blocks go back to the pool;
- if the engine process dies, every running and later `generate()` raises
  `EngineDeadError` (and `errored` is True) instead of hanging; with data-parallel
  replicas, one replica dying fails only the requests it held.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Iterable

from jengine.config import EngineConfig
from jengine.engine.arg_utils import EngineArgs
from jengine.engine.client import EngineDeadError, LostRequests
from jengine.engine.input_processor import InputProcessor, PromptType
from jengine.engine.mp_clients import AsyncMPClient
from jengine.engine.output_collector import RequestOutputCollector
from jengine.engine.output_processor import OutputProcessor, RequestError
from jengine.engine.stats import LoggingStatLogger, StatLoggerBase, StatsTracker
from jengine.engine.tokenizer import load_tokenizer
from jengine.fault_injection import FaultInjector
from jengine.generation_config import sampling_defaults
from jengine.lora_request import LoRARequest
from jengine.outputs import EmbeddingRequestOutput, RequestOutput
from jengine.pooling import PoolingParams
from jengine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_LOG_STATS_INTERVAL = 10.0


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        *,
        log_stats: bool = True,
        stat_loggers: Iterable[StatLoggerBase] = (),
        log_stats_interval: float = DEFAULT_LOG_STATS_INTERVAL,
        startup_timeout: float | None = None,
        engine_core: AsyncMPClient | None = None,
    ):
        """`engine_core`: a client whose processes the caller already started (`jengine
        serve` starts them before it imports the server); by default, started here."""
        self.config = config
        self.engine_core = engine_core or AsyncMPClient(config, startup_timeout)
        try:  # the tokenizer loads while the engine process starts
            self.tokenizer = load_tokenizer(config)
            self.sampling_defaults = sampling_defaults(config.model)
            ready = self.engine_core.wait_for_ready()
        except BaseException:
            self.engine_core.shutdown()
            raise
        self.vocab_size = ready.vocab_size
        self.num_blocks = ready.num_blocks
        self.max_model_len = config.scheduler.max_model_len
        self.input_processor = InputProcessor.from_config(config, self.tokenizer, ready.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer, FaultInjector.from_env())
        self.stats = StatsTracker(count_lora=config.lora is not None)
        self.stat_loggers: list[StatLoggerBase] = list(stat_loggers)
        if log_stats:
            self.stat_loggers.append(LoggingStatLogger())
        self.log_stats_interval = log_stats_interval
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._tasks: list[asyncio.Task] = []
        self._dead_error: BaseException | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs) -> "AsyncLLM":
        return cls(engine_args.create_engine_config(), **kwargs)

    # -- state ----------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._dead_error is not None or self.engine_core.engine_dead

    @property
    def num_unfinished_requests(self) -> int:
        """Sequences sent to the engine and not yet finished (none once it died: each has
        had its error)."""
        if self.errored:
            return 0
        return self.output_processor.get_num_unfinished_requests()

    @property
    def engine_pid(self) -> int:
        return self.engine_core.engine_pid

    def dead_error(self) -> BaseException:
        return self._dead_error or self.engine_core.dead_error()

    def get_tokenizer(self):
        return self.tokenizer

    async def get_engine_stats(self, timeout: float | None = 5.0) -> dict:
        """Gauges straight from the engine core (free KV blocks, queue sizes, compiles)."""
        return await self.engine_core.call_utility_async("get_stats", timeout=timeout)

    # -- requests -------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        *,
        priority: int = 0,
        output_kind: RequestOutputKind | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Validate, register and send one request; returns where its outputs land.
        Raises ValueError for bad input and EngineDeadError if the engine is gone."""
        if self.errored:
            raise self.dead_error()
        self._ensure_background_tasks()
        text, request = self.input_processor.process(
            request_id, prompt, params, priority, lora_request=lora_request
        )
        # Raises ValueError, before anything is sent, if the id is in use.
        sequences = self.output_processor.add_request(request, text, output_kind)
        collector = RequestOutputCollector(self.output_processor.parents[request_id].output_kind)
        self._collectors[request_id] = collector
        try:
            await self.engine_core.add_request_async(sequences)
        except BaseException:
            await self.abort(request_id)
            raise
        return collector

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
        output_kind: RequestOutputKind | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the RequestOutputs of one request until it finishes.

        Closing or cancelling the generator early aborts the request in the engine core.
        """
        collector = None
        try:
            collector = await self.add_request(
                request_id,
                prompt,
                sampling_params,
                priority=priority,
                output_kind=output_kind,
                lora_request=lora_request,
            )
            finished = False
            while not finished:
                output = await collector.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if collector is not None:
                await self.abort(request_id)
            raise
        except BaseException:
            if collector is not None and not self.errored:
                await self.abort(request_id)
            raise

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """An embedding engine's one output for `prompt` (vLLM's `AsyncLLM.encode`)."""
        async for output in self.generate(
            prompt,
            pooling_params,
            request_id,
            priority=priority,
            output_kind=RequestOutputKind.FINAL_ONLY,
            lora_request=lora_request,
        ):
            yield output

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Have every engine core read (and check) a LoRA adapter's folder now."""
        return await self.engine_core.call_utility_async("add_lora", lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self.engine_core.call_utility_async("remove_lora", lora_int_id)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Forget requests (by the id given to generate) and stop them in the engine core."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted = self.stats.aborted(request_ids, self.output_processor)
        core_ids = self.output_processor.abort_requests(request_ids)
        if aborted.finished_requests:
            for stat_logger in self.stat_loggers:
                stat_logger.record(None, aborted)
        for rid in request_ids:
            self._collectors.pop(rid, None)
        self.stats.forget(core_ids)
        if core_ids and not self.errored:
            with contextlib.suppress(EngineDeadError):
                await self.engine_core.abort_requests_async(core_ids)
            logger.debug("aborted %s", ", ".join(request_ids))

    async def abort_all(self, error: BaseException) -> None:
        """End every unfinished request with `error` (its `generate` raises it) and stop
        them in the engine core."""
        request_ids = list(self._collectors)
        for request_id in request_ids:
            self._collectors[request_id].put(error)
        await self.abort(request_ids)

    # -- background tasks -----------------------------------------------------------------

    def _ensure_background_tasks(self) -> None:
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._run_output_handler(), name="output_handler"))
        if self.stat_loggers and self.log_stats_interval > 0:
            self._tasks.append(loop.create_task(self._run_stats_logging(), name="log_stats"))

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                if isinstance(outputs, LostRequests):
                    await self._fail_lost_requests(outputs)
                    continue
                observation = self.stats.observe(outputs, self.output_processor)
                processed = self.output_processor.process_outputs(outputs.outputs)
                iteration_stats = observation.finish()
                for output in processed.request_outputs:
                    collector = self._collectors.get(output.request_id)
                    if collector is not None:
                        collector.put(output)
                    if output.finished:
                        self._collectors.pop(output.request_id, None)
                for request_id, error in processed.failed.items():
                    if isinstance(error, RequestError):
                        logger.warning("request %s failed: %s", request_id, error)
                    else:
                        logger.error(
                            "building the output of request %s failed: %r", request_id, error
                        )
                    collector = self._collectors.pop(request_id, None)
                    if collector is not None:
                        collector.put(error)
                if processed.reqs_to_abort:
                    self.stats.forget(processed.reqs_to_abort)  # failed ones never finish
                    await self.engine_core.abort_requests_async(processed.reqs_to_abort)
                for stat_logger in self.stat_loggers:
                    stat_logger.record(outputs.scheduler_stats, iteration_stats)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            if not isinstance(e, EngineDeadError):
                logger.exception("the output handler failed")
                e = EngineDeadError(f"the output handler failed: {e!r}")
            self._dead_error = e
            for collector in self._collectors.values():
                collector.put(e)
            self._collectors.clear()
            for stat_logger in self.stat_loggers:
                stat_logger.record_engine_dead(len(self.output_processor.request_states))

    async def _fail_lost_requests(self, lost: LostRequests) -> None:
        """A data-parallel replica died: its requests end with its error (503 over
        HTTP); every other request carries on."""
        states = self.output_processor.request_states
        request_ids = {states[rid].parent.request_id for rid in lost.request_ids if rid in states}
        for request_id in request_ids:
            collector = self._collectors.get(request_id)
            if collector is not None:
                collector.put(lost.error)
        await self.abort(request_ids)

    async def _run_stats_logging(self) -> None:
        while True:
            await asyncio.sleep(self.log_stats_interval)
            for stat_logger in self.stat_loggers:
                try:
                    stat_logger.log()
                except Exception:
                    logger.exception("stat logger %r failed", stat_logger)

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.engine_core.shutdown()
