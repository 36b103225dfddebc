"""The engine process's first steps, and what its parent does so that they go well.

Where it sits: the MP clients (jengine/engine/client.py) start each engine process with
`spawn` and `run_engine_core` as its target, under `sigint_ignored_by_children`. The child
imports this module first, so it never imports jax: jax loads in `run_engine_core`,
through jengine.engine.core_proc. Promises: the child starts with SIGINT ignored (the
front end owns Ctrl-C), exits within a second of its parent going away (`watch_parent`,
even while it still imports, loads or compiles), and a data-parallel replica sees only
its own accelerators.
"""

import contextlib
import logging
import os
import shutil
import signal
import threading
import time

from jengine.config import EngineConfig
from jengine.logger import init_logging
from jengine.torch_free import keep_torch_out

logger = logging.getLogger(__name__)

_PARENT_POLL_SECONDS = 0.5


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    identity: bytes,
    engine_index: int,
    parent_pid: int,
) -> None:
    """Spawn target of the engine process (see the module docstring)."""
    # The front end's private socket folder (ipc://<folder>/input), removed if it dies.
    ipc = input_address.startswith("ipc://")
    socket_dir = os.path.dirname(input_address.removeprefix("ipc://")) if ipc else None
    threading.Thread(target=watch_parent, args=(parent_pid, socket_dir), daemon=True).start()
    keep_torch_out()
    data_parallel = config.parallel.data_parallel_size > 1
    prefix = f"replica {engine_index}" if data_parallel else "engine-core"
    init_logging(prefix=f"[{prefix} {os.getpid()}] ")
    if data_parallel:
        _claim_devices(engine_index, config.parallel.tensor_parallel_size)
    from jengine.engine.core_proc import EngineCoreProc

    EngineCoreProc.run_engine_core(
        config, input_address, output_address, identity, engine_index, parent_pid
    )


@contextlib.contextmanager
def sigint_ignored_by_children():
    """SIGINT ignored while a child starts, so it starts with SIGINT ignored (an ignored
    signal stays so across exec, and Python then installs no handler of its own): the
    front end owns Ctrl-C. The child ignored it only once it had imported jax, and a Ctrl-C
    in that second or two printed its KeyboardInterrupt traceback under the front end's
    clean exit. (Only the main thread may set handlers; elsewhere nothing changes.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        if previous is not None:  # (None: a handler set outside Python, which it cannot restore)
            signal.signal(signal.SIGINT, previous)


def watch_parent(parent_pid: int, socket_dir: str | None = None) -> None:
    """Exit once the front end (`parent_pid`, passed down: by the time the child could ask,
    its parent may be gone already) is gone. Polled (a reparented process has another
    ppid) from the child's first moment, so a front end killed while its engine still
    imports, loads or compiles leaves nothing behind: its `socket_dir` is removed (a
    SIGKILLed front end cannot), and the main thread, which may be in a step or a
    compile, is told by SIGTERM (the engine's handler exits when orphaned)."""
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_SECONDS)
    logger.info("front-end process is gone; engine core exits")
    if socket_dir is not None:
        shutil.rmtree(socket_dir, ignore_errors=True)
    os.kill(os.getpid(), signal.SIGTERM)


def _claim_devices(engine_index: int, devices_per_replica: int) -> None:
    """Give data-parallel replica `engine_index` its own accelerators before jax starts
    (on CPU every process has its own host devices and this changes nothing)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(1024)]
    first = engine_index * devices_per_replica
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[first : first + devices_per_replica])
