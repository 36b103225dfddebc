"""EngineCore: one step = schedule -> execute -> update. The heart of the engine process.

Where it sits: clients (jengine/engine/client.py) hand it `EngineCoreRequest`s and call
`step()`; it owns the Scheduler (host, no jax) and the ModelRunner (device). Nothing
here tokenizes or detokenizes: that is the front end's job.

Promises: at construction the model is loaded, the KV capacity is computed from the
memory budget and logged, and every step shape is compiled, so `step()` never compiles.

Across hosts (`--num-hosts`), host 0's step sends its SchedulerOutput to the other hosts
before running it, and the others (`run_follower`) run each one they receive: one SPMD
step over the devices of all hosts (jengine/runner/distributed.py).

`EngineCoreProc` is the same engine in its own process (started with `spawn` by the MP
clients): a busy loop on the main thread, one input thread (ZMQ DEALER -> decode ->
queue) and one output thread (queue -> encode -> ZMQ PUSH), so (de)serialization and
socket I/O overlap the device step.
"""

import gc
import logging
import os
import queue
import signal
import threading
import time
from functools import partial

import jax
import jax.numpy as jnp
import msgspec
import zmq
from flax import nnx

from jengine.config import EngineConfig
from jengine.core.scheduler import Scheduler
from jengine.core.structured_output import StructuredOutputManager
from jengine.models import load_model
from jengine.pallas_kernels.ragged_paged_attention import prepare as prepare_attention
from jengine.protocol import (
    UTILITY_METHODS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    UtilityOutput,
    UtilityRequest,
)
from jengine.request import Request, RequestStatus
from jengine.runner import distributed
from jengine.runner.compilation import enable_compilation_cache
from jengine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, model: nnx.Module | None = None, devices=None):
        """`model`: an in-memory model instead of `config.model.model`'s checkpoint;
        `devices`: the devices to run on (default: the first of `jax.devices()`)."""
        self.config = config
        self.broadcaster: distributed.StepBroadcaster | None = None
        if config.parallel.multi_host:
            distributed.initialize(config.parallel)  # before anything starts a backend
        if config.speculative is not None and config.speculative.method == "draft_model":
            raise ValueError("speculative decoding with a draft model is not available yet")
        if config.compilation.cache_dir:
            enable_compilation_cache(config.compilation.cache_dir)
        started = time.perf_counter()
        # The CPU attention kernel's first build overlaps loading the weights.
        prepare_attention(config.model.attention_impl)
        if model is None:
            model = load_model(config.model.model, config.model.dtype)
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
            seed=config.model.seed,
            attention_impl=config.model.attention_impl,
            tensor_parallel_size=config.parallel.tensor_parallel_size,
            devices=devices,
        )
        logger.info(
            "model %s: %s, %s, %.1fM parameters; attention: %s",
            config.model.model or "(in memory)",
            type(model).__name__,
            jnp.dtype(self.runner.dtype).name,
            sum(x.size for x in jax.tree.leaves(self.runner.params)) / 1e6,
            self.runner.attention_impl,
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
        )
        self.num_preemptions = 0  # since start, for tests and metrics
        self.num_requests_added = 0
        self.spec_decode_counts = dict(drafts=0, draft_tokens=0, accepted_tokens=0)
        if config.parallel.multi_host:
            self.broadcaster = distributed.StepBroadcaster()
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
        if self.broadcaster is None:
            runner_output = self.runner.execute(scheduler_output)
        else:
            with self.broadcaster.lock:  # the followers run the same step
                self.broadcaster.send_step(scheduler_output)
                runner_output = self.runner.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        stats = outputs.scheduler_stats
        if stats is not None:
            self.num_preemptions += stats.num_preemptions
            counts = self.spec_decode_counts
            counts["drafts"] += stats.spec_num_drafts
            counts["draft_tokens"] += stats.spec_num_draft_tokens
            counts["accepted_tokens"] += stats.spec_num_accepted_tokens
        return outputs

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
        # Cached prefixes were computed by the old weights.
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing forgotten) while a request holds blocks."""
        return self.scheduler.reset_prefix_cache()

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


def grammar_tokenizer(config: EngineConfig, vocab_size: int):
    """llguidance's view of the model's tokenizer, over the model's whole (padded)
    vocabulary; built when the first constrained request arrives (about a second)."""
    from llguidance.hf import from_tokenizer

    from jengine.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config)
    if tokenizer is None:
        raise ValueError("structured outputs need the model's tokenizer; none is configured")
    return from_tokenizer(tokenizer, n_vocab=vocab_size)


_PARENT_POLL_SECONDS = 1.0


class EngineCoreProc(EngineCore):
    """EngineCore behind ZeroMQ, in a process of its own.

    Messages in (DEALER, from the front end's ROUTER): [request type byte, msgpack payload].
    Messages out (PUSH, to the front end's PULL): [EngineCoreOutputType byte, payload].
    The first message in either direction is the `EngineCoreReady` handshake, sent once
    warmup is done. The process exits on SIGTERM or when its parent is gone.
    """

    def __init__(
        self,
        config: EngineConfig,
        input_address: str,
        output_address: str,
        identity: bytes,
        engine_index: int = 0,
    ):
        super().__init__(config)
        self.engine_index = engine_index  # which data-parallel replica this is
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self._parent_pid = os.getppid()
        self._stats_dirty = False
        self._zmq = zmq.Context()
        ready = EngineCoreReady(
            pid=os.getpid(),
            vocab_size=self.runner.config.vocab_size,
            num_blocks=self.runner.num_blocks,
            capacity_report=self.capacity_report,
            startup_seconds=self.startup_seconds,
        )
        for target, args in (
            (self._run_input_thread, (input_address, identity, ready)),
            (self._run_output_thread, (output_address,)),
        ):
            threading.Thread(target=target, args=args, daemon=True).start()

    # -- I/O threads ----------------------------------------------------------------------

    def _run_input_thread(self, address: str, identity: bytes, ready: EngineCoreReady) -> None:
        decoders = {
            EngineCoreRequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
            EngineCoreRequestType.UTILITY: msgspec.msgpack.Decoder(UtilityRequest),
        }
        sock = self._zmq.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(msgspec.msgpack.encode(ready))
        while True:
            type_frame, payload = sock.recv_multipart(copy=False)
            try:
                request_type = EngineCoreRequestType(type_frame.bytes[0])
                message = decoders[request_type].decode(payload.buffer)
            except (ValueError, msgspec.DecodeError) as e:
                # The front end validates everything it sends; this is a bug, not bad input.
                logger.error("dropped an undecodable engine-core message: %s", e)
                continue
            self.input_queue.put_nowait((request_type, message))

    def _run_output_thread(self, address: str) -> None:
        encoder = msgspec.msgpack.Encoder()
        sock = self._zmq.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        while True:
            kind, message = self.output_queue.get()
            sock.send_multipart((bytes((kind,)), encoder.encode(message)), copy=False)

    # -- busy loop (main thread) ----------------------------------------------------------

    def run_busy_loop(self) -> None:
        while True:
            self._process_input_queue()
            self._process_engine_step()

    def _process_input_queue(self) -> None:
        if not self.has_unfinished_requests():
            if self._stats_dirty:
                # Going idle (e.g. after aborts): publish fresh gauges, since no step will.
                self._send_outputs(
                    EngineCoreOutputs(
                        timestamp=time.monotonic(), scheduler_stats=self.scheduler.make_stats()
                    )
                )
                self._stats_dirty = False
            while True:
                try:
                    item = self.input_queue.get(timeout=_PARENT_POLL_SECONDS)
                    break
                except queue.Empty:
                    if os.getppid() != self._parent_pid:
                        logger.info("front-end process is gone; engine core exits")
                        raise SystemExit(0) from None
            self._handle_client_request(*item)
        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())

    def _process_engine_step(self) -> None:
        if not self.has_unfinished_requests():
            return
        outputs = self.step()
        self._stats_dirty = False
        if outputs.outputs or outputs.scheduler_stats is not None:
            self._send_outputs(outputs)

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        outputs.engine_index = self.engine_index
        self.output_queue.put_nowait((EngineCoreOutputType.OUTPUTS, outputs))

    def _handle_client_request(self, request_type: EngineCoreRequestType, message) -> None:
        if request_type != EngineCoreRequestType.UTILITY:
            self._stats_dirty = True
        if request_type == EngineCoreRequestType.ADD:
            try:
                self.add_request(message)
            except Exception as e:
                # Never let one bad request take the engine down: end it, keep serving.
                logger.error("rejected request %s: %s", message.request_id, e)
                self._send_outputs(
                    EngineCoreOutputs(
                        outputs=[
                            EngineCoreOutput(
                                message.request_id, [], finish_reason=FinishReason.ABORT
                            )
                        ],
                        timestamp=time.monotonic(),
                    )
                )
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(message)
        else:
            self.output_queue.put_nowait((EngineCoreOutputType.UTILITY, self._call(message)))

    def _call(self, call: UtilityRequest) -> UtilityOutput:
        if call.method not in UTILITY_METHODS:
            return UtilityOutput(call.call_id, failure_message=f"unknown utility {call.method!r}")
        try:
            return UtilityOutput(call.call_id, result=getattr(self, call.method)(*call.args))
        except Exception as e:
            logger.exception("utility %s failed", call.method)
            return UtilityOutput(call.call_id, failure_message=f"{type(e).__name__}: {e}")

    # -- process entry point --------------------------------------------------------------

    @staticmethod
    def run_engine_core(
        config: EngineConfig,
        input_address: str,
        output_address: str,
        identity: bytes,
        engine_index: int = 0,
    ) -> None:
        """Body of the engine process (reached through the jax-free spawn target in
        jengine/engine/client.py): build the engine, hand-shake, run until told to stop."""

        def on_signal(signum, frame):
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, on_signal)
        # Ctrl-C reaches the whole process group; the front end owns shutdown (it sends
        # SIGTERM), so the engine does not die under its in-flight requests first.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            engine = EngineCoreProc(config, input_address, output_address, identity, engine_index)
            # Everything built so far lives for the whole process: keep it out of GC scans.
            gc.collect()
            gc.freeze()
            try:
                engine.run_busy_loop()
            finally:
                engine.shutdown()
        except SystemExit:
            logger.debug("engine core exits")
        except BaseException:
            logger.exception("engine core failed")
            raise
