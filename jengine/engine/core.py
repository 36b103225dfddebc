"""EngineCore: one step = schedule -> execute -> update. The heart of the engine process.

Where it sits: clients (jengine/engine/client.py) hand it `EngineCoreRequest`s and call
`step()`; it owns the Scheduler (host, no jax) and the ModelRunner (device). Nothing
here tokenizes or detokenizes: that is the front end's job.

Promises: at construction the model is loaded, the KV capacity is computed from the
memory budget and logged, and every step shape is compiled, so `step()` never compiles.
A step that raises is logged with the ids of the requests it ran, and the exception goes
on up: the runner's state (the donated KV cache, the persistent batch) may be half
updated, so the engine does not run another step on it (EngineCoreProc's process exits
and the server answers 503).

Async scheduling (on unless `--no-async-scheduling`, or speculative decoding, whose drafts
are proposed from tokens on the host): `step()` schedules and dispatches step N+1, then
collects step N and returns its outputs, so the host's scheduling, input preparation and
output processing overlap the device's work. The scheduler counts each in-flight token as
a placeholder; a request that stops at step N has its token of step N+1 dropped (never
emitted), and its blocks are freed while that step may still run: the device runs steps
in order, so a later step that reuses them writes after it.

Across hosts (`--num-hosts`), host 0's step sends its SchedulerOutput to the other hosts
before running it, and the others (`run_follower`) run each one they receive: one SPMD
step over the devices of all hosts (jengine/runner/distributed.py).

`EngineCoreProc` (jengine/engine/core_proc.py) is the same engine in its own process.
"""

import logging
import time
from contextlib import contextmanager
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jengine.config import EngineConfig
from jengine.core.sched_output import SchedulerOutput
from jengine.core.scheduler import Scheduler
from jengine.core.structured_output import StructuredOutputManager
from jengine.engine.tokenizer import grammar_tokenizer
from jengine.fault_injection import FaultInjector
from jengine.lora_request import LoRARequest
from jengine.models import load_model, resolve_model
from jengine.models.lora import LoRAAdapter
from jengine.pallas_kernels import prepare as prepare_kernels
from jengine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
)
from jengine.request import Request, RequestStatus
from jengine.runner import distributed
from jengine.runner.compilation import enable_compilation_cache
from jengine.runner.model_runner import ModelRunner
from jengine.runner.step_outputs import InFlightStep

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, model: nnx.Module | None = None, devices=None):
        """`model`: an in-memory model instead of `config.model.model`'s checkpoint;
        `devices`: the devices to run on (default: the first of `jax.devices()`)."""
        self.config = config
        self.broadcaster: distributed.StepBroadcaster | None = None
        self.faults = FaultInjector.from_env()
        if config.parallel.multi_host:
            distributed.initialize(config.parallel)  # before anything starts a backend
        if config.compilation.cache_dir:
            enable_compilation_cache(config.compilation.cache_dir)
        started = time.perf_counter()
        # The CPU kernels' first builds overlap loading the weights.
        prepare_kernels(config.model.attention_impl)
        if model is None:
            model = load_model(config.model.model, config.model.dtype, config.model.quantization)
        speculative = config.speculative
        draft_model = None
        if speculative is not None and speculative.method == "draft_model":
            draft_model = load_model(resolve_model(speculative.model), config.model.dtype)
        scheduler_config = config.scheduler
        self.runner = ModelRunner(
            model,
            block_size=config.cache.block_size,
            max_model_len=scheduler_config.max_model_len,
            max_num_seqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            kv_cache_memory_bytes=config.cache.kv_cache_memory_bytes,
            gpu_memory_utilization=config.cache.gpu_memory_utilization,
            num_blocks=config.cache.num_gpu_blocks,
            kv_cache_dtype=config.cache.kv_cache_dtype,
            seed=config.model.seed,
            attention_impl=config.model.attention_impl,
            tensor_parallel_size=config.parallel.tensor_parallel_size,
            expert_parallel=config.parallel.enable_expert_parallel,
            devices=devices,
            draft_model=draft_model,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
            lora_config=config.lora,
            pooling_type=None if config.model.pooler is None else config.model.pooler.pooling_type,
            num_decode_steps=scheduler_config.num_scheduler_steps,
            max_logprobs=config.model.num_top_logprobs(model.config.vocab_size),
        )
        logger.info(
            "model %s: %s, %s, %.1fM parameters; attention: %s",
            config.model.model or "(in memory)",
            type(model).__name__,
            jnp.dtype(self.runner.dtype).name,
            sum(x.size for x in jax.tree.leaves(self.runner.params)) / 1e6,
            self.runner.attention_impl,
        )
        logger.info(self.runner.weights_report())
        pooler = config.model.pooler
        if pooler is not None:
            logger.info(
                "an embedding engine (--runner pooling): %s pooling, %s; prefix caching %s",
                pooler.pooling_type,
                "normalized" if pooler.normalize else "not normalized",
                "on" if config.cache.enable_prefix_caching else "off",
            )
        self.capacity_report = self.runner.capacity_report()
        logger.info(self.capacity_report)
        vocab_size = self.runner.config.vocab_size
        self.scheduler = Scheduler(
            scheduler_config,
            config.cache,
            self.runner.num_blocks,
            structured_output_manager=StructuredOutputManager(
                partial(grammar_tokenizer, config, vocab_size), vocab_size
            ),
            speculative_config=config.speculative,
            max_loras=config.lora.max_loras if config.lora else 0,
        )
        self.num_preemptions = 0  # since start, for tests and metrics
        self.num_requests_added = 0
        self.spec_decode_counts = dict(drafts=0, draft_tokens=0, accepted_tokens=0)
        if config.parallel.multi_host:
            self.broadcaster = distributed.StepBroadcaster()
        self.async_scheduling = scheduler_config.async_scheduling and speculative is None
        if scheduler_config.async_scheduling and speculative is not None:
            logger.info("async scheduling is off: speculative decoding proposes on the host")
        # The step dispatched but not collected yet (async scheduling).
        self._in_flight: tuple[SchedulerOutput, InFlightStep] | None = None
        self._held: list[Request] = []  # new requests reusing the id of one still in flight
        self._warmup(started)
        if self.broadcaster is not None and self.broadcaster.is_source:
            self.broadcaster.start_keep_alive()

    def _warmup(self, started: float) -> None:
        if not self.config.compilation.warmup:
            self.startup_seconds = time.perf_counter() - started
            logger.info(
                "no warmup: step shapes compile when first used; engine ready in %.1fs",
                self.startup_seconds,
            )
            return
        warmup_started = time.perf_counter()
        num_shapes = self.runner.warmup()
        self.startup_seconds = time.perf_counter() - started
        logger.info(
            "warmup compiled %d step shapes in %.1fs; engine ready in %.1fs",
            num_shapes,
            time.perf_counter() - warmup_started,
            self.startup_seconds,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        self.num_requests_added += 1
        if request.lora_request is not None:  # read (and checked) the first time it is named
            self.add_lora(request.lora_request)
        new = Request(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time or None,
            priority=request.priority,
            lora_request=request.lora_request,
            cache_salt=request.cache_salt,
        )
        if not self._in_flight_names_ended(new.request_id):
            self.scheduler.add_request(new)
            return
        # The id of a request that ended (or was aborted) while a step of it is still in
        # flight: that step's token for the old request would be read, by the scheduler and
        # the persistent batch alike, as the new request's. The new one waits for that step
        # to be collected (the next `step`), checked now as the scheduler would check it.
        if any(held.request_id == new.request_id for held in self._held):
            raise ValueError(f"request id {new.request_id!r} is already in use")
        self.scheduler.check_request(new)
        self._held.append(new)

    def _in_flight_names_ended(self, request_id: str) -> bool:
        """Whether the step in flight ran a request `request_id` that has ended since."""
        return (
            self._in_flight is not None
            and request_id in self._in_flight[0].num_scheduled_tokens
            and request_id not in self.scheduler.requests
        )

    # -- LoRA adapters ----------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter | None = None) -> bool:
        """Register an adapter, read from `lora_request.lora_path` unless `adapter` (in
        memory) is given; False if that folder's adapter is registered already."""
        if not isinstance(lora_request, LoRARequest):  # a utility call's: its fields
            lora_request = LoRARequest(*lora_request)
        if self.runner.lora is None:
            raise ValueError(
                "this engine does not serve LoRA adapters (start it with --enable-lora)"
            )
        return self.runner.lora.add(lora_request, adapter, self._adapters_in_use())

    def _adapters_in_use(self) -> frozenset[int]:
        """The adapters of unfinished requests, which stay read on the host."""
        requests = [*self.scheduler.requests.values(), *self._held]
        return frozenset(r.lora_id for r in requests)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; a ValueError while a request still uses it."""
        if self.runner.lora is None:
            return False
        if lora_int_id in self._adapters_in_use():
            raise ValueError(
                f"the adapter (id {lora_int_id}) is in use by a request: remove it once "
                "its requests finish"
            )
        removed = self.runner.lora.remove(lora_int_id)
        if removed:
            self.scheduler.kv_cache_manager.forget_lora(lora_int_id)
        return removed

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if self._held:
            aborted = set(request_ids)
            self._held = [r for r in self._held if r.request_id not in aborted]

    def has_unfinished_requests(self) -> bool:
        # A step still in flight for requests that have all ended has nothing to report:
        # it is collected (and its tokens dropped) by the next step, whenever that comes.
        return self.scheduler.has_unfinished_requests() or bool(self._held)

    def step(self) -> EngineCoreOutputs:
        """One engine step: the outputs of the step this call collects (with async
        scheduling, the one dispatched by the call before; the first returns none)."""
        previous, self._in_flight = self._in_flight, None
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            with self._failing_step(scheduler_output):
                self._in_flight = (scheduler_output, self._dispatch(scheduler_output))
        if not self.async_scheduling:
            previous, self._in_flight = self._in_flight, None
        if previous is None:
            return EngineCoreOutputs()
        scheduler_output, in_flight = previous
        with self._failing_step(scheduler_output):
            runner_output = self.runner.collect(in_flight)
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._count(outputs)
        held, self._held = self._held, []
        for request in held:  # the step that ran their ids' old requests is collected
            self.scheduler.add_request(request)
        return outputs

    def _dispatch(self, scheduler_output: SchedulerOutput) -> InFlightStep:
        if self.faults is not None:
            self.faults.check("engine_step", scheduler_output.num_scheduled_tokens)
        if self.broadcaster is None:
            return self.runner.dispatch(scheduler_output)
        with self.broadcaster.lock:  # the followers run the same step
            self.broadcaster.send_step(scheduler_output)
            return self.runner.dispatch(scheduler_output)

    @contextmanager
    def _failing_step(self, scheduler_output: SchedulerOutput):
        try:
            yield
        except Exception:
            logger.error(
                "the engine step failed while running requests %s; its device state may be "
                "corrupt, so no further step runs",
                sorted(scheduler_output.num_scheduled_tokens),
            )
            raise

    def _count(self, outputs: EngineCoreOutputs) -> None:
        stats = outputs.scheduler_stats
        if stats is not None:
            self.num_preemptions += stats.num_preemptions
            counts = self.spec_decode_counts
            counts["drafts"] += stats.spec_num_drafts
            counts["draft_tokens"] += stats.spec_num_draft_tokens
            counts["accepted_tokens"] += stats.spec_num_accepted_tokens

    def run_follower(self) -> None:
        """Hosts other than 0: run host 0's steps until it stops."""
        assert self.broadcaster is not None and not self.broadcaster.is_source
        logger.info("following host 0's steps")
        while (scheduler_output := self.broadcaster.receive()) is not None:
            self.runner.execute(scheduler_output)
        logger.info("host 0 stopped; this host exits")

    def shutdown(self) -> None:
        """Release the followers, if any (host 0 of a multi-host engine)."""
        if self.broadcaster is not None and self.broadcaster.is_source:
            self.broadcaster.stop()

    # -- utilities the front end may call --------------------------------------------------

    def update_weights(self, params) -> None:
        if self.broadcaster is not None:
            raise ValueError("update_weights is not supported across hosts")
        self.runner.update_weights(params)
        # Cached prefixes were computed by the old weights, those of running requests too.
        self.scheduler.kv_cache_manager.reset_prefix_cache(in_use_too=True)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing forgotten) while a request holds blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.num_free_blocks

    def compiles_after_warmup(self) -> int:
        return self.runner.compiles_after_warmup

    def get_stats(self) -> dict:
        """Gauges of the engine right now (for /metrics and tests), as plain types."""
        scheduler = self.scheduler
        return {
            "num_running_reqs": len(scheduler.running),
            "num_waiting_reqs": len(scheduler.waiting),
            "num_free_blocks": self.num_free_blocks(),
            "num_blocks": self.runner.num_blocks,
            "kv_cache_usage": scheduler.kv_cache_manager.usage,
            "num_preemptions": self.num_preemptions,
            "num_requests_added": self.num_requests_added,
            **{f"spec_decode_{name}": count for name, count in self.spec_decode_counts.items()},
            "compiles_after_warmup": self.compiles_after_warmup(),
            "attention_impl": self.runner.attention_impl,
        }
