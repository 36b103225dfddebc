"""The two multi-process clients of the engine core: `SyncMPClient` (threads, for
`LLMEngine`) and `AsyncMPClient` (asyncio, for the API server's `AsyncLLM`).

Where it sits: both are `MPClient`s (jengine/engine/client.py: the engine processes, the
sockets, routing over data-parallel replicas, the death watch); here is only how each
receives outputs and waits for answers. Jax-free, like the rest of the front end.
"""

import asyncio
import queue
import threading
from concurrent.futures import Future

import zmq.asyncio

from jengine.config import EngineConfig
from jengine.engine.client import EngineDeadError, EngineReplica, LostRequests, MPClient, resolve
from jengine.engine.load_balancer import combine_utility_results
from jengine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
)


class SyncMPClient(MPClient):
    """Blocking client for `LLMEngine`: `get_output()` waits for the next step's outputs.

    A background thread receives from the PULL socket, resolves utility futures and queues
    step outputs; requests are sent from the caller's thread (under a lock: ZMQ sockets
    are not thread-safe).
    """

    def __init__(self, config: EngineConfig, startup_timeout: float | None = None):
        self._outputs: queue.Queue = queue.Queue()
        self._pending: dict[int, tuple[EngineReplica, Future]] = {}
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
                _, future = self._pending.pop(message.call_id, (None, None))
                if future is not None:
                    resolve(future, message)
            else:
                self._outputs.put_nowait(message)

    def _on_engine_dead(self) -> None:
        self._outputs.put_nowait(self.dead_error())
        self._fail_pending(None)

    def _on_replica_dead(self, replica: EngineReplica, lost: LostRequests) -> None:
        self._outputs.put_nowait(lost)
        self._fail_pending(replica)

    def _fail_pending(self, replica: EngineReplica | None) -> None:
        for call_id, (target, future) in list(self._pending.items()):
            if replica is None or target is replica:
                self._pending.pop(call_id, None)
                future.set_exception(target.dead_error())

    def _send(self, replica: EngineReplica, request_type: EngineCoreRequestType, message) -> None:
        if replica.dead:
            raise replica.dead_error()
        with self._send_lock:
            self.input_socket.send_multipart(
                self._encode_request(replica, request_type, message), copy=False
            )

    def add_request(self, sequences: list[EngineCoreRequest]) -> None:
        """Send the sequences of one request (one, or its n > 1 fan-out) to one replica."""
        replica = self._replica_for(sequences)
        for sequence in sequences:
            self._send(replica, EngineCoreRequestType.ADD, sequence)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.engine_dead:
            for replica, ids in self._replicas_holding(request_ids):
                self._send(replica, EngineCoreRequestType.ABORT, ids)

    def get_output(self) -> EngineCoreOutputs | LostRequests:
        output = self._outputs.get()
        if isinstance(output, EngineDeadError):
            self._outputs.put_nowait(output)  # every later call fails the same way
            raise output
        return output

    def call_utility(self, name: str, *args):
        """Call `name` on every live replica; their answers combined into one."""
        futures = []
        live = self._live_replicas()
        for replica in live:
            call = self._new_utility_request(name, args)
            future: Future = Future()
            self._pending[call.call_id] = (replica, future)
            self._send(replica, EngineCoreRequestType.UTILITY, call)
            futures.append(future)
        results = [future.result() for future in futures]
        return combine_utility_results(name, results, self._replica_indices(live))

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
        self._pending: dict[int, tuple[EngineReplica, asyncio.Future]] = {}
        self._output_task: asyncio.Task | None = None
        self._lost_before_start: list[tuple[EngineReplica, LostRequests]] = []
        super().__init__(config, startup_timeout)

    def _ensure_started(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        self._async_input = zmq.asyncio.Socket.from_socket(self.input_socket)
        self._async_output = zmq.asyncio.Socket.from_socket(self.output_socket)
        self._output_task = self._loop.create_task(self._run_output_task())
        for replica, lost in self._lost_before_start:
            self._on_replica_dead_in_loop(replica, lost)
        if self.engine_dead:
            self._on_engine_dead_in_loop()

    async def _run_output_task(self) -> None:
        while True:
            frames = await self._async_output.recv_multipart(copy=False)
            message = self._decode_output(frames)
            if isinstance(message, UtilityOutput):
                _, future = self._pending.pop(message.call_id, (None, None))
                if future is not None and not future.done():
                    resolve(future, message)
            else:
                self._outputs.put_nowait(message)

    # Called on a watch thread: hand over to the loop (if it has started).

    def _on_engine_dead(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._on_engine_dead_in_loop)

    def _on_replica_dead(self, replica: EngineReplica, lost: LostRequests) -> None:
        loop = self._loop
        if loop is None:
            self._lost_before_start.append((replica, lost))
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._on_replica_dead_in_loop, replica, lost)

    def _on_engine_dead_in_loop(self) -> None:
        self._outputs.put_nowait(self.dead_error())
        self._fail_pending(None)

    def _on_replica_dead_in_loop(self, replica: EngineReplica, lost: LostRequests) -> None:
        self._outputs.put_nowait(lost)
        self._fail_pending(replica)

    def _fail_pending(self, replica: EngineReplica | None) -> None:
        for call_id, (target, future) in list(self._pending.items()):
            if (replica is None or target is replica) and not future.done():
                self._pending.pop(call_id)
                future.set_exception(target.dead_error())

    async def _send(
        self, replica: EngineReplica, request_type: EngineCoreRequestType, message
    ) -> None:
        self._ensure_started()
        if replica.dead:
            raise replica.dead_error()
        await self._async_input.send_multipart(
            self._encode_request(replica, request_type, message), copy=False
        )

    async def add_request_async(self, sequences: list[EngineCoreRequest]) -> None:
        """Send the sequences of one request (one, or its n > 1 fan-out) to one replica."""
        replica = self._replica_for(sequences)
        for sequence in sequences:
            await self._send(replica, EngineCoreRequestType.ADD, sequence)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.engine_dead:
            for replica, ids in self._replicas_holding(request_ids):
                await self._send(replica, EngineCoreRequestType.ABORT, ids)

    async def get_output_async(self) -> EngineCoreOutputs | LostRequests:
        self._ensure_started()
        output = await self._outputs.get()
        if isinstance(output, EngineDeadError):
            self._outputs.put_nowait(output)
            raise output
        return output

    async def call_utility_async(self, name: str, *args, timeout: float | None = None):
        """Call `name` on every live replica; their answers combined into one."""
        self._ensure_started()
        calls, futures = [], []
        live = self._live_replicas()
        try:
            for replica in live:
                call = self._new_utility_request(name, args)
                future = self._loop.create_future()
                self._pending[call.call_id] = (replica, future)
                calls.append(call.call_id)
                futures.append(future)
                await self._send(replica, EngineCoreRequestType.UTILITY, call)
            results = await asyncio.wait_for(asyncio.gather(*futures), timeout)
            return combine_utility_results(name, results, self._replica_indices(live))
        finally:
            for call_id in calls:
                self._pending.pop(call_id, None)

    def _stop_io(self) -> None:
        if self._output_task is not None and not self._output_task.done():
            self._output_task.cancel()
