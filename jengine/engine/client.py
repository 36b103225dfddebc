"""Clients of the engine core: how the front end talks to it.

Where it sits: `LLMEngine` and `AsyncLLM` hold one client; the client hides whether the
engine core runs in this process (`InprocClient`) or in its own process behind ZeroMQ
(`SyncMPClient` for `LLMEngine`, `AsyncMPClient` for the asyncio server, both in
jengine/engine/mp_clients.py over the `MPClient` here).

Every client offers the same calls: `add_request`, `abort_requests`, `get_output`
(runs or waits for one step's outputs) and `call_utility(name, *args)` for the few
engine-core methods the front end may call (`num_free_blocks`, `update_weights`, ...);
the async client has the same names with an `_async` suffix.

The MP clients own the engine processes: they bind a ROUTER (requests out) and a PULL
(outputs in) socket on private ipc paths, start the process (one per data-parallel
replica) with `spawn`, and `wait_for_ready` takes each `EngineCoreReady` handshake (the
owner's own start-up runs in between, beside the engines' start). A thread watches
each process sentinel, so if the engine dies every pending and later call raises
`EngineDeadError` instead of hanging; if one of several replicas dies, only its requests
fail (`LostRequests`) and the others carry on. Data-parallel routing is
jengine/engine/load_balancer.py's.

This module never imports jax (the API process imports it); the engine process reaches
jax through `engine_process.run_engine_core`, which imports jengine.engine.core_proc only
in the child.
"""

import atexit
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from jengine.config import EngineConfig
from jengine.engine.engine_process import run_engine_core, sigint_ignored_by_children
from jengine.engine.load_balancer import DataParallelBalancer, combine_ready
from jengine.protocol import (
    ENGINE_STOP_SIGNAL,
    UTILITY_METHODS,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    UtilityOutput,
    UtilityRequest,
)

logger = logging.getLogger(__name__)


class InprocClient:
    """The engine core in this process: `get_output` runs one step."""

    def __init__(self, engine_core):
        self.engine_core = engine_core

    def add_request(self, sequences: list[EngineCoreRequest]) -> None:
        for sequence in sequences:
            self.engine_core.add_request(sequence)

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
        self.engine_core.shutdown()


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing sent to it will be answered."""


@dataclass
class LostRequests:
    """Not an engine message: the client's notice, among the step outputs, that one
    data-parallel replica died and took these sequences with it (the others carry on)."""

    request_ids: list[str]
    error: EngineDeadError


@dataclass(eq=False)
class EngineReplica:
    """One engine-core process as the client sees it."""

    index: int
    name: str  # for messages: "the engine-core process" or "engine-core replica 1"
    identity: bytes
    proc: multiprocessing.Process
    ready: EngineCoreReady | None = None
    dead: bool = False

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(
            f"{self.name} (pid {self.proc.pid}) died (exit code {self.proc.exitcode}); "
            "see the server log"
        )


class MPClient:
    """What the sync and async clients share: start-up, handshake, routing over
    data-parallel replicas, death watch, shutdown.

    There are `data_parallel_size` engine processes (usually one), all on the same two
    sockets: the ROUTER addresses each by its identity, the PULL takes every replica's
    outputs (tagged with `engine_index`). With more than one, a `DataParallelBalancer`
    picks each request's replica and one replica's death fails only its requests.
    """

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
        num_replicas = config.parallel.data_parallel_size
        self.balancer = DataParallelBalancer(num_replicas) if num_replicas > 1 else None
        context = multiprocessing.get_context("spawn")
        self.replicas = []
        for index in range(num_replicas):
            identity = uuid.uuid4().bytes
            proc = context.Process(
                target=run_engine_core,
                args=(config, input_address, output_address, identity, index, os.getpid()),
                name=f"EngineCore-{index}" if self.balancer else "EngineCore",
                daemon=True,
            )
            name = f"engine-core replica {index}" if self.balancer else "the engine-core process"
            self.replicas.append(EngineReplica(index, name, identity, proc))
        try:
            for replica in self.replicas:
                with sigint_ignored_by_children():
                    replica.proc.start()
                logger.info("started %s (pid %d)", replica.name, replica.proc.pid)
        except BaseException:  # (before the subclass's I/O exists: not `shutdown()`)
            self._shutting_down = True
            self._stop_processes()
            self._close()
            raise
        self.engine_pid = self.replicas[0].proc.pid
        # A script that never calls shutdown() (vLLM's LLM needs none) stops its engines at
        # exit, before multiprocessing joins them: an engine ignores the SIGTERM that join
        # sends while its parent lives, so the script never exited.
        atexit.register(self.shutdown)
        self._startup_timeout = startup_timeout
        self.ready: EngineCoreReady | None = None

    def wait_for_ready(self) -> EngineCoreReady:
        """Wait for every replica's handshake (the first call; later ones return it).

        The constructor only starts the processes, so the owner can do its own start-up
        (the tokenizer, the server's imports) on one core while the engines import jax,
        load weights and warm up on the other. Stops the processes if the wait fails: a
        ValueError with the engine's words when what it was given is wrong (a checkpoint, a
        size that does not fit the model), a RuntimeError when it died."""
        if self.ready is not None:
            return self.ready
        try:
            self._wait_for_ready(self._startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        self.ready = combine_ready([replica.ready for replica in self.replicas])
        for replica in self.replicas:
            threading.Thread(
                target=self._watch_engine, args=(replica,), name="EngineCoreWatch", daemon=True
            ).start()
        return self.ready

    @property
    def engine_pids(self) -> list[int]:
        return [replica.proc.pid for replica in self.replicas]

    def _wait_for_ready(self, timeout: float | None) -> None:
        by_identity = {replica.identity: replica for replica in self.replicas}
        waited = 0.0
        while any(replica.ready is None for replica in self.replicas):
            if not self.input_socket.poll(500):
                waited += 0.5
                for replica in self.replicas:
                    if not replica.proc.is_alive():
                        raise RuntimeError(
                            f"the engine-core process failed to start (exit code "
                            f"{replica.proc.exitcode}); its log above says why"
                        )
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(f"the engine core was not ready after {timeout:.0f}s")
                continue
            identity, payload = self.input_socket.recv_multipart()
            ready = msgspec.msgpack.decode(payload, type=EngineCoreReady)
            if ready.error:
                raise ValueError(ready.error)
            by_identity[identity].ready = ready

    def _watch_engine(self, replica: EngineReplica) -> None:
        multiprocessing.connection.wait([replica.proc.sentinel])
        if self._shutting_down:
            return
        replica.proc.join(5)  # reaped, so its exit code is known
        replica.dead = True
        if all(r.dead for r in self.replicas):
            self.engine_dead = True
        if self.balancer is None:
            logger.error(
                "%s (pid %d) died with exit code %s",
                replica.name,
                replica.proc.pid,
                replica.proc.exitcode,
            )
            self._on_engine_dead()
            return
        lost = self.balancer.replica_died(replica.index)
        logger.error(
            "%s (pid %d) died with exit code %s; its %d unfinished requests fail, %s",
            replica.name,
            replica.proc.pid,
            replica.proc.exitcode,
            len(lost),
            "no replica is left" if self.engine_dead else "the other replicas carry on",
        )
        self._on_replica_dead(replica, LostRequests(lost, replica.dead_error()))
        if self.engine_dead:
            self._on_engine_dead()

    def _on_engine_dead(self) -> None:
        raise NotImplementedError

    def _on_replica_dead(self, replica: EngineReplica, lost: LostRequests) -> None:
        raise NotImplementedError

    def dead_error(self) -> EngineDeadError:
        if self.balancer is None:
            return self.replicas[0].dead_error()
        return EngineDeadError(
            f"every engine-core replica died (pids {self.engine_pids}); see the server log"
        )

    # -- where messages go ----------------------------------------------------------------

    def _replica_for(self, requests: list[EngineCoreRequest]) -> EngineReplica:
        if self.balancer is None:
            return self.replicas[0]
        index = self.balancer.route([request.request_id for request in requests])
        if index is None:
            raise self.dead_error()
        return self.replicas[index]

    def _replicas_holding(self, request_ids: list[str]) -> list[tuple[EngineReplica, list]]:
        if self.balancer is None:
            return [(self.replicas[0], request_ids)]
        return [
            (self.replicas[index], ids)
            for index, ids in self.balancer.take(request_ids).items()
            if not self.replicas[index].dead
        ]

    def _live_replicas(self) -> list[EngineReplica]:
        live = [replica for replica in self.replicas if not replica.dead]
        if not live:
            raise self.dead_error()
        return live

    def _replica_indices(self, replicas: list[EngineReplica]) -> list[int] | None:
        """Which replicas answered a utility call (None: one engine, not data-parallel)."""
        return [replica.index for replica in replicas] if self.balancer else None

    def _encode_request(self, replica: EngineReplica, request_type, message) -> tuple:
        return (replica.identity, bytes((request_type,)), self._encoder.encode(message))

    def _decode_output(self, frames):
        kind, payload = frames
        if EngineCoreOutputType(kind.bytes[0]) == EngineCoreOutputType.UTILITY:
            return self._utility_decoder.decode(payload.buffer)
        outputs = self._outputs_decoder.decode(payload.buffer)
        if self.balancer is not None:
            self.balancer.observe(outputs)
        return outputs

    def _new_utility_request(self, name: str, args) -> UtilityRequest:
        if name not in UTILITY_METHODS:
            raise ValueError(f"unknown engine-core utility {name!r}")
        return UtilityRequest(next(self._call_ids), name, list(args))

    # -- shutdown -------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        atexit.unregister(self.shutdown)
        # A second Ctrl-C lands in one of these (a join, mostly): the rest still runs. A
        # skipped stop left the engines running, ignoring multiprocessing's exit SIGTERM
        # (their parent lives) while its join waited on them for ever.
        try:
            self._stop_io()
        finally:
            try:
                self._stop_processes()
            finally:
                self._close()

    def _stop_processes(self) -> None:
        live = [r.proc for r in self.replicas if r.proc.pid is not None and r.proc.is_alive()]
        for proc in live:
            os.kill(proc.pid, ENGINE_STOP_SIGNAL)
        for proc in live:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def _stop_io(self) -> None:
        pass

    def _close(self) -> None:
        self._zmq.destroy(linger=0)
        shutil.rmtree(self._socket_dir, ignore_errors=True)


def resolve(future, message: UtilityOutput) -> None:
    if message.failure_message is not None:
        future.set_exception(RuntimeError(message.failure_message))
    else:
        future.set_result(message.result)
