"""Clients of the engine core: how the front end talks to it.

Where it sits: `LLMEngine` and `AsyncLLM` hold one client; the client hides whether the
engine core runs in this process (`InprocClient`) or in its own process behind ZeroMQ
(`SyncMPClient` for `LLMEngine`, `AsyncMPClient` for the asyncio server).

Every client offers the same calls: `add_request`, `abort_requests`, `get_output`
(runs or waits for one step's outputs) and `call_utility(name, *args)` for the few
engine-core methods the front end may call (`num_free_blocks`, `update_weights`, ...);
the async client has the same names with an `_async` suffix.

The MP clients own the engine process: they bind a ROUTER (requests out) and a PULL
(outputs in) socket on private ipc paths, start the process with `spawn`, and wait for
its `EngineCoreReady` handshake. A thread watches the process sentinel, so if the engine
dies every pending and later call raises `EngineDeadError` instead of hanging.

This module never imports jax (the API process imports it); the engine process reaches
jax through `run_engine_core`, which imports jengine.engine.core only in the child.
"""

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import tempfile
import threading
import uuid
from concurrent.futures import Future

import msgspec
import zmq
import zmq.asyncio

from jengine.config import EngineConfig
from jengine.logger import init_logging
from jengine.protocol import (
    UTILITY_METHODS,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
    UtilityRequest,
)

logger = logging.getLogger(__name__)


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


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing sent to it will be answered."""


def run_engine_core(*args) -> None:
    """Spawn target of the engine process. Lives here, in a jax-free module, because the
    child imports the target's module first; jax loads only inside this call."""
    init_logging(prefix=f"[engine-core {os.getpid()}] ")
    from jengine.engine.core import EngineCoreProc

    EngineCoreProc.run_engine_core(*args)


class MPClient:
    """What the sync and async clients share: start-up, handshake, death watch, shutdown."""

    def __init__(self, config: EngineConfig, startup_timeout: float | None = None):
        self.config = config
        self.engine_dead = False
        self._shutting_down = False
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._utility_decoder = msgspec.msgpack.Decoder(UtilityOutput)
        self._call_ids = itertools.count()
        self._socket_dir = tempfile.mkdtemp(prefix="jengine-")
        input_address = f"ipc://{self._socket_dir}/input"
        output_address = f"ipc://{self._socket_dir}/output"
        self._zmq = zmq.Context()
        self.input_socket = self._zmq.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.bind(input_address)
        self.output_socket = self._zmq.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(output_address)
        self.identity = uuid.uuid4().bytes
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(config, input_address, output_address, self.identity),
            name="EngineCore",
            daemon=True,
        )
        try:
            self.proc.start()
            logger.info("started the engine-core process (pid %d)", self.proc.pid)
            self.ready = self._wait_for_ready(startup_timeout)
        except BaseException:
            self._shutting_down = True
            self._stop_process()
            self._close()
            raise
        self.engine_pid = self.proc.pid
        threading.Thread(target=self._watch_engine, name="EngineCoreWatch", daemon=True).start()

    def _wait_for_ready(self, timeout: float | None) -> EngineCoreReady:
        waited = 0.0
        while not self.input_socket.poll(500):
            waited += 0.5
            if not self.proc.is_alive():
                raise RuntimeError(
                    f"the engine-core process failed to start (exit code {self.proc.exitcode});"
                    " its log above says why"
                )
            if timeout is not None and waited >= timeout:
                raise TimeoutError(f"the engine core was not ready after {timeout:.0f}s")
        identity, payload = self.input_socket.recv_multipart()
        assert identity == self.identity
        return msgspec.msgpack.decode(payload, type=EngineCoreReady)

    def _watch_engine(self) -> None:
        multiprocessing.connection.wait([self.proc.sentinel])
        if self._shutting_down:
            return
        self.engine_dead = True
        logger.error(
            "the engine-core process (pid %d) died with exit code %s",
            self.proc.pid,
            self.proc.exitcode,
        )
        self._on_engine_dead()

    def _on_engine_dead(self) -> None:
        raise NotImplementedError

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(
            f"the engine-core process (pid {self.proc.pid}) died "
            f"(exit code {self.proc.exitcode}); see the server log"
        )

    def _encode_request(self, request_type: EngineCoreRequestType, message) -> tuple:
        return (self.identity, bytes((request_type,)), self._encoder.encode(message))

    def _decode_output(self, frames):
        kind, payload = frames
        if EngineCoreOutputType(kind.bytes[0]) == EngineCoreOutputType.UTILITY:
            return self._utility_decoder.decode(payload.buffer)
        return self._outputs_decoder.decode(payload.buffer)

    def _new_utility_request(self, name: str, args) -> UtilityRequest:
        if name not in UTILITY_METHODS:
            raise ValueError(f"unknown engine-core utility {name!r}")
        return UtilityRequest(next(self._call_ids), name, list(args))

    def shutdown(self) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        self._stop_io()
        self._stop_process()
        self._close()

    def _stop_process(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)

    def _stop_io(self) -> None:
        pass

    def _close(self) -> None:
        self._zmq.destroy(linger=0)
        shutil.rmtree(self._socket_dir, ignore_errors=True)


class SyncMPClient(MPClient):
    """Blocking client for `LLMEngine`: `get_output()` waits for the next step's outputs.

    A background thread receives from the PULL socket, resolves utility futures and queues
    step outputs; requests are sent from the caller's thread (under a lock: ZMQ sockets
    are not thread-safe).
    """

    def __init__(self, config: EngineConfig, startup_timeout: float | None = None):
        self._outputs: queue.Queue = queue.Queue()
        self._pending: dict[int, Future] = {}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        super().__init__(config, startup_timeout)
        self._output_thread = threading.Thread(
            target=self._run_output_thread, name="EngineCoreOutputs", daemon=True
        )
        self._output_thread.start()

    def _run_output_thread(self) -> None:
        while not self._stop.is_set():
            if not self.output_socket.poll(100):
                continue
            message = self._decode_output(self.output_socket.recv_multipart(copy=False))
            if isinstance(message, UtilityOutput):
                future = self._pending.pop(message.call_id, None)
                if future is not None:
                    _resolve(future, message)
            else:
                self._outputs.put_nowait(message)

    def _on_engine_dead(self) -> None:
        error = self.dead_error()
        self._outputs.put_nowait(error)
        for call_id in list(self._pending):
            future = self._pending.pop(call_id, None)
            if future is not None:
                future.set_exception(error)

    def _send(self, request_type: EngineCoreRequestType, message) -> None:
        if self.engine_dead:
            raise self.dead_error()
        with self._send_lock:
            self.input_socket.send_multipart(
                self._encode_request(request_type, message), copy=False
            )

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.engine_dead:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        output = self._outputs.get()
        if isinstance(output, EngineDeadError):
            self._outputs.put_nowait(output)  # every later call fails the same way
            raise output
        return output

    def call_utility(self, name: str, *args):
        call = self._new_utility_request(name, args)
        future: Future = Future()
        self._pending[call.call_id] = future
        self._send(EngineCoreRequestType.UTILITY, call)
        return future.result()

    def _stop_io(self) -> None:
        self._stop.set()
        if self._output_thread.is_alive():
            self._output_thread.join(5)


class AsyncMPClient(MPClient):
    """asyncio client for `AsyncLLM`. Its sockets turn into zmq.asyncio sockets (and its
    output task starts) on first use inside the running event loop."""

    def __init__(self, config: EngineConfig, startup_timeout: float | None = None):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._output_task: asyncio.Task | None = None
        super().__init__(config, startup_timeout)

    def _ensure_started(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        self._async_input = zmq.asyncio.Socket.from_socket(self.input_socket)
        self._async_output = zmq.asyncio.Socket.from_socket(self.output_socket)
        self._output_task = self._loop.create_task(self._run_output_task())
        if self.engine_dead:
            self._on_engine_dead_in_loop()

    async def _run_output_task(self) -> None:
        while True:
            frames = await self._async_output.recv_multipart(copy=False)
            message = self._decode_output(frames)
            if isinstance(message, UtilityOutput):
                future = self._pending.pop(message.call_id, None)
                if future is not None and not future.done():
                    _resolve(future, message)
            else:
                self._outputs.put_nowait(message)

    def _on_engine_dead(self) -> None:
        # Called on the watch thread; hand over to the loop (if it has started).
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._on_engine_dead_in_loop)

    def _on_engine_dead_in_loop(self) -> None:
        error = self.dead_error()
        self._outputs.put_nowait(error)
        for call_id in list(self._pending):
            future = self._pending.pop(call_id)
            if not future.done():
                future.set_exception(error)

    async def _send(self, request_type: EngineCoreRequestType, message) -> None:
        self._ensure_started()
        if self.engine_dead:
            raise self.dead_error()
        await self._async_input.send_multipart(
            self._encode_request(request_type, message), copy=False
        )

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.engine_dead:
            await self._send(EngineCoreRequestType.ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_started()
        output = await self._outputs.get()
        if isinstance(output, EngineDeadError):
            self._outputs.put_nowait(output)
            raise output
        return output

    async def call_utility_async(self, name: str, *args, timeout: float | None = None):
        call = self._new_utility_request(name, args)
        self._ensure_started()
        future = self._loop.create_future()
        self._pending[call.call_id] = future
        try:
            await self._send(EngineCoreRequestType.UTILITY, call)
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(call.call_id, None)

    def _stop_io(self) -> None:
        if self._output_task is not None and not self._output_task.done():
            self._output_task.cancel()


def _resolve(future, message: UtilityOutput) -> None:
    if message.failure_message is not None:
        future.set_exception(RuntimeError(message.failure_message))
    else:
        future.set_result(message.result)
