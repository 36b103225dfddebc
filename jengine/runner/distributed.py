"""Multi-host SPMD: `jax.distributed` start-up and the step broadcast from host 0.

Where it sits: with `--num-hosts N`, every host runs one engine process over its local
devices, and the tensor-parallel mesh of the ModelRunner spans the devices of all hosts
(multi-controller JAX: every process calls the same jitted step on the same inputs).
Host 0's EngineCore schedules; before each step it sends the `SchedulerOutput` through a
`StepBroadcaster`, and the other hosts (`EngineCore.run_follower`) receive it and run
`ModelRunner.execute` on it, so their runners hold the same state and issue the same
collectives in the same order.

What it promises:
- `initialize(parallel)` calls `jax.distributed.initialize` before any backend starts,
  with gloo collectives on CPU;
- every byte crosses hosts in a collective XLA emits (a sum over a host-sharded array,
  compiled once, for a fixed chunk size): no sockets of our own;
- while host 0 is idle a keep-alive goes out every second, so a follower waiting in a
  collective never reaches the collective timeout; steps and keep-alives are sent under
  one lock, which the step holds until its device work is done, so every host sees the
  same sequence of collectives;
- a host that fails ends at once (`exit_now`), and so, within seconds, do the others;
- warmup's dummy steps, the first collectives of most programs, start on every host
  together (`wait_for_every_host`), however long each took to compile.
"""

import enum
import logging
import os
import sys
import threading
from typing import NoReturn

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jengine.config import ParallelConfig
from jengine.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

# How long the hosts wait for each other to join (JENGINE_HOST_JOIN_TIMEOUT, seconds); then
# each exits naming the cause (jax's own timeout, later, would abort the process as though
# another host had died).
JOIN_TIMEOUT_SECONDS = 300.0
CHUNK_BYTES = 1 << 14  # one broadcast carries a decode step's SchedulerOutput whole
KEEP_ALIVE_SECONDS = 1.0


def initialize(parallel: ParallelConfig) -> None:
    """Join the hosts (blocks until all `num_hosts` have joined the coordinator)."""
    # The CPU backend has no collectives across processes unless told to use gloo (the
    # setting touches nothing but the CPU backend).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Its SIGTERM handler would take the engine's own (which stops the followers first).
    jax.config.update("jax_enable_preemption_service", False)
    timeout = float(os.environ.get("JENGINE_HOST_JOIN_TIMEOUT", JOIN_TIMEOUT_SECONDS))
    logger.info(
        "joining %d hosts as host %d (coordinator %s): waiting up to %.0f s for the others",
        parallel.num_hosts,
        parallel.host_rank,
        parallel.coordinator_address,
        timeout,
    )
    joined = threading.Event()

    def give_up() -> None:
        if not joined.wait(timeout):
            logger.error(
                "host %d: not all %d hosts joined the coordinator %s within %.0f s (is each "
                "started with --num-hosts %d, its own --host-rank and this "
                "--coordinator-address?)",
                parallel.host_rank,
                parallel.num_hosts,
                parallel.coordinator_address,
                timeout,
                parallel.num_hosts,
            )
            exit_now(1)

    threading.Thread(target=give_up, name="JoinTimeout", daemon=True).start()
    jax.distributed.initialize(
        parallel.coordinator_address,
        num_processes=parallel.num_hosts,
        process_id=parallel.host_rank,
        initialization_timeout=int(timeout) + 60,
    )
    joined.set()
    logger.info(
        "%d devices over %d hosts, %d here", jax.device_count(), jax.process_count(),
        jax.local_device_count(),
    )  # fmt: skip
    if parallel.tensor_parallel_size != jax.device_count():
        raise ValueError(
            f"tensor_parallel_size must be the number of devices of all hosts together "
            f"({jax.device_count()}) with num_hosts > 1, got {parallel.tensor_parallel_size}"
        )


def wait_for_every_host(name: str, timeout_seconds: float = 1800.0) -> None:
    """Block until every host has reached the point `name` (nothing to wait for on one).

    Through the coordination service, not a collective: the first run of a collective sets
    up a gloo context, which waits only 30 s for the other hosts, and hosts compiling
    warmup's programs side by side drift further apart than that under load (a CI run:
    host 0 reached warmup's first dummy step 30 s before host 1 and failed with "Gloo
    context initialization failed: DEADLINE_EXCEEDED").
    """
    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed  # the client `initialize` started

    jax_distributed.global_state.client.wait_at_barrier(name, int(timeout_seconds * 1000))


def exit_now(exit_code: int) -> NoReturn:
    """End this host's process without jax's exit-time shutdown barrier (after logging why).

    That barrier waits for every host to shut down (5 minutes, then it aborts), but a host
    that failed leaves the others inside collectives it will never join: none would come.
    Exiting closes this host's gloo connections (and, on host 0, the coordination
    service), which fails the other hosts' collectives within a second, so they end too."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


class MessageKind(enum.IntEnum):
    STEP = 0
    KEEP_ALIVE = 1
    STOP = 2


class StepBroadcaster:
    """Host 0 sends each step's SchedulerOutput; every other host receives it."""

    def __init__(self):
        self.is_source = jax.process_index() == 0
        devices = [
            [d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())
        ]
        mesh = Mesh(np.array(devices), ("hosts", "local"))
        # Row p of the [hosts, CHUNK] array lives on host p; only host 0's row is nonzero,
        # so the sum over rows is host 0's bytes, on every device.
        self._rows = NamedSharding(mesh, P("hosts"))
        self._sum = jax.jit(
            lambda rows: jnp.sum(rows, axis=0, dtype=jnp.uint8),
            out_shardings=NamedSharding(mesh, P()),
        )
        self._zeros = np.zeros((1, CHUNK_BYTES), np.uint8)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_array)
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput, dec_hook=_decode_array)
        # Held by host 0 from sending a step until its device work is done.
        self.lock = threading.Lock()
        self._busy = threading.Event()
        self._stopped = threading.Event()
        self._exchange(self._zeros)  # compile now, on every host at the same point

    def _exchange(self, row: np.ndarray) -> np.ndarray:
        rows = jax.make_array_from_process_local_data(self._rows, row)
        return np.asarray(self._sum(rows))

    def _broadcast(self, payload: bytes | None) -> bytes:
        """Host 0 passes the bytes, the others None; every host returns them."""
        header = 4
        if payload is not None:
            data = len(payload).to_bytes(header, "little") + payload
        chunks = []
        offset = 0
        total = None
        while total is None or offset < total:
            row = self._zeros
            if payload is not None:
                row = np.zeros((1, CHUNK_BYTES), np.uint8)
                piece = data[offset : offset + CHUNK_BYTES]
                row[0, : len(piece)] = np.frombuffer(piece, np.uint8)
            chunk = self._exchange(row)
            if total is None:
                total = header + int.from_bytes(chunk[:header].tobytes(), "little")
            chunks.append(chunk[: min(CHUNK_BYTES, total - offset)])
            offset += CHUNK_BYTES
        return np.concatenate(chunks).tobytes()[header:]

    # -- host 0 ---------------------------------------------------------------------------

    def send_step(self, scheduler_output: SchedulerOutput) -> None:
        """Call with `lock` held, and keep it until the step's device work is done."""
        self._busy.set()
        self._broadcast(bytes((MessageKind.STEP,)) + self._encoder.encode(scheduler_output))

    def start_keep_alive(self) -> None:
        threading.Thread(target=self._run_keep_alive, name="StepKeepAlive", daemon=True).start()

    def _run_keep_alive(self) -> None:
        while not self._stopped.wait(KEEP_ALIVE_SECONDS):
            if self._busy.is_set():
                self._busy.clear()  # a step went out within the last interval
                continue
            with self.lock:
                if not self._stopped.is_set():
                    self._broadcast(bytes((MessageKind.KEEP_ALIVE,)))

    def stop(self) -> None:
        """Tell the followers to exit (host 0, at shutdown)."""
        with self.lock:
            if not self._stopped.is_set():
                self._stopped.set()
                self._broadcast(bytes((MessageKind.STOP,)))

    # -- the other hosts ------------------------------------------------------------------

    def receive(self) -> SchedulerOutput | None:
        """The next step from host 0; None when host 0 stops."""
        while True:
            message = self._broadcast(None)
            kind = MessageKind(message[0])
            if kind == MessageKind.STEP:
                return self._decoder.decode(message[1:])
            if kind == MessageKind.STOP:
                return None


def _encode_array(value):
    """The grammar bitmask in a SchedulerOutput: (shape, int32 bytes)."""
    if isinstance(value, np.ndarray):
        return (list(value.shape), value.astype(np.int32).tobytes())
    raise NotImplementedError(f"cannot send {type(value).__name__}")


def _decode_array(kind, value):
    if kind is np.ndarray:
        shape, data = value
        return np.frombuffer(data, np.int32).reshape(shape)
    raise NotImplementedError(f"cannot receive {kind}")
