"""EngineCoreProc: the engine core in a process of its own, behind ZeroMQ.

Where it sits: the MP clients (jengine/engine/client.py) spawn it through the jax-free
`engine_process.run_engine_core`; it is an `EngineCore` (jengine/engine/core.py) plus its I/O.

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
import sys
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from jengine.config import EngineConfig
from jengine.engine.core import EngineCore
from jengine.protocol import (
    ENGINE_STOP_SIGNAL,
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
from jengine.runner import distributed

logger = logging.getLogger(__name__)


class EngineCoreProc(EngineCore):
    """EngineCore behind ZeroMQ, in a process of its own.

    Messages in (DEALER, from the front end's ROUTER): [request type byte, msgpack payload].
    Messages out (PUSH, to the front end's PULL): [EngineCoreOutputType byte, payload].
    The first message in either direction is the `EngineCoreReady` handshake, sent once
    warmup is done. The process exits on `ENGINE_STOP_SIGNAL` from the front end, within
    a second of its parent going away, also while it still loads or compiles (SIGKILL
    included: engine_process.watch_parent turns that into SIGTERM, so no orphan keeps holding
    memory), and with an error when a step fails (see
    EngineCore); a SIGTERM while its parent lives is the front end's to handle.
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
            self._handle_client_request(*self.input_queue.get())
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
                                message.request_id,
                                [],
                                finish_reason=FinishReason.ERROR,
                                error=f"the engine rejected the request: {e}",
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
            if isinstance(e, ValueError):  # what the caller asked for cannot be done
                logger.warning("utility %s refused: %s", call.method, e)
            else:
                logger.exception("utility %s failed", call.method)
            return UtilityOutput(call.call_id, failure_message=f"{type(e).__name__}: {e}")

    # -- process entry point --------------------------------------------------------------

    @staticmethod
    def run_engine_core(
        config: EngineConfig,
        input_address: str,
        output_address: str,
        identity: bytes,
        engine_index: int,
        parent_pid: int,
    ) -> None:
        """Body of the engine process (reached through the jax-free spawn target in
        jengine/engine/engine_process.py, which watches `parent_pid`, the front end's): build the
        engine, hand-shake, run until told to stop."""

        ignore_stops = install_stop_handlers(parent_pid)
        try:
            try:
                engine = EngineCoreProc(
                    config, input_address, output_address, identity, engine_index
                )
            except ValueError as e:  # the configuration: the front end says why, in one line
                logger.error("engine core could not start: %s", e)
                # Told, the front end stops this engine: a stop raised in the exit's
                # clean-up printed a traceback or a C++ abort under the one line.
                ignore_stops()
                _report_start_failure(input_address, identity, str(e))
                if config.parallel.multi_host:
                    distributed.exit_now(1)  # the other hosts wait for this one: end them too
                raise SystemExit(1) from None
            # Everything built so far lives for the whole process: keep it out of GC scans.
            gc.collect()
            gc.freeze()
            try:
                engine.run_busy_loop()
            finally:
                engine.shutdown()
        except SystemExit as e:
            logger.debug("engine core exits")
            if e.code:
                raise
        except BaseException:
            logger.exception("engine core failed")
            if config.parallel.multi_host:
                distributed.exit_now(1)  # the other hosts wait for this one: end them too
            raise


def install_stop_handlers(parent_pid: int) -> Callable[[], None]:
    """Make ENGINE_STOP_SIGNAL end this engine process (SystemExit(0) on the main thread,
    at its current compile or step) and SIGTERM end it once orphaned; returns the function
    that ignores both from then on.

    The front end owns shutdown: it drains its requests, then sends ENGINE_STOP_SIGNAL,
    once. SIGTERM and Ctrl-C's SIGINT sent to the whole process group (systemd,
    `kill -- -PGID`) reach the engine too; while its parent lives it ignores them, so it
    does not die under the requests being drained."""
    stopping = False

    def ignore_stops():
        for stop in (ENGINE_STOP_SIGNAL, signal.SIGTERM):
            signal.signal(stop, signal.SIG_IGN)

    def on_stop(signum, frame):
        nonlocal stopping
        stopping = True
        ignore_stops()  # once: a second must not interrupt the exit (jax's clean-up)
        raise SystemExit(0)

    def on_sigterm(signum, frame):
        if os.getppid() != parent_pid:  # orphaned (see engine_process.watch_parent)
            on_stop(signum, frame)

    def on_unraisable(unraisable):
        # Python runs a signal handler wherever the main thread is; in a finalizer (a
        # `__del__`, a weakref callback: jax runs them all through warmup) the SystemExit
        # is printed and dropped, and the engine went on to warm up and serve, deaf to the
        # one stop its front end sends. Send the stop again a moment later: raised here, it
        # would run (and be dropped) at once; then it lands once the main thread is past
        # the finalizer (or in the next one, and comes back here).
        if stopping and unraisable.exc_type is SystemExit:
            signal.signal(ENGINE_STOP_SIGNAL, on_stop)
            threading.Timer(0.01, os.kill, (os.getpid(), ENGINE_STOP_SIGNAL)).start()
        else:
            sys.__unraisablehook__(unraisable)

    signal.signal(ENGINE_STOP_SIGNAL, on_stop)
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.unraisablehook = on_unraisable
    return ignore_stops


def _report_start_failure(input_address: str, identity: bytes, error: str) -> None:
    """Tell the front end waiting for this engine why it will not be ready."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 5000)  # delivered before the process exits
    sock.connect(input_address)
    failed = EngineCoreReady(pid=os.getpid(), vocab_size=0, num_blocks=0, error=error)
    sock.send(msgspec.msgpack.encode(failed))
    sock.close()
    context.term()
