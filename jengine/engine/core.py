"""EngineCore: one step = schedule -> execute -> update. The heart of the engine process.

Where it sits: clients (jengine/engine/client.py) hand it `EngineCoreRequest`s and call
`step()`; it owns the Scheduler (host, no jax) and the ModelRunner (device). Nothing
here tokenizes or detokenizes: that is the front end's job.

Promises: at construction the model is loaded, the KV capacity is computed from the
memory budget and logged, and every step shape is compiled, so `step()` never compiles.
"""

import logging
import time

from flax import nnx

from jengine.config import EngineConfig
from jengine.core.outputs import EngineCoreOutputs
from jengine.core.scheduler import Scheduler
from jengine.engine.protocol import EngineCoreRequest
from jengine.request import Request, RequestStatus
from jengine.runner.model_runner import ModelRunner, enable_compilation_cache
from models import load_model

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, model: nnx.Module | None = None):
        self.config = config
        enable_compilation_cache()
        started = time.perf_counter()
        if model is None:
            model = load_model(config.model.model, config.model.dtype)
        sched = config.scheduler
        self.runner = ModelRunner(
            model,
            block_size=config.cache.block_size,
            max_model_len=sched.max_model_len,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            kv_cache_memory_bytes=config.cache.kv_cache_memory_bytes,
            gpu_memory_utilization=config.cache.gpu_memory_utilization,
            num_blocks=config.cache.num_gpu_blocks,
            seed=config.model.seed,
            attention_impl=config.model.attention_impl,
        )
        self.capacity_report = self.runner.capacity_report()
        logger.info(self.capacity_report)
        self.scheduler = Scheduler(sched, config.cache, self.runner.num_blocks)
        self.num_preemptions = 0  # since start, for tests and metrics
        num_shapes = self.runner.warmup()
        self.startup_seconds = time.perf_counter() - started
        logger.info(
            "warmup compiled %d step shapes; engine ready in %.1fs",
            num_shapes,
            self.startup_seconds,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request(
                request.request_id,
                request.prompt_token_ids,
                request.sampling_params,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time or None,
                priority=request.priority,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if outputs.scheduler_stats is not None:
            self.num_preemptions += outputs.scheduler_stats.num_preemptions
        return outputs

    # -- utilities the front end may call --------------------------------------------------

    def update_weights(self, params) -> None:
        self.runner.update_weights(params)
        # Cached prefixes were computed by the old weights.
        self.scheduler.reset_prefix_cache()

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.num_free_blocks

    def compiles_after_warmup(self) -> int:
        return self.runner.compiles_after_warmup
