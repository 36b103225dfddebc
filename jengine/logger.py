"""Logging set-up for jengine's own processes: the `jengine` command and the engine-core
process it spawns.

Where it sits: `jengine.entrypoints.cli.main` calls `init_logging()` before anything else,
and the engine process's spawn target (`jengine.engine.engine_process.run_engine_core`)
calls it with its pid as a prefix. Library use (`LLM` in a user's program) configures nothing: the
user's logging set-up stays theirs.

What it promises: jengine's INFO lines (model, dtype, attention implementation, KV
capacity, ready time) and every WARNING or worse; not the INFO chatter of the libraries
underneath (JAX probing for a TPU on a CPU machine, absl), nor transformers' advice that
PyTorch is missing, which the engine does not need (it uses transformers' tokenizers only).
"""

import logging
import os

# Libraries whose INFO lines say nothing a jengine user must act on (httpx logs every
# request the benchmarks send).
_QUIET_LOGGERS = ("jax", "absl", "httpx", "httpx2")


def init_logging(prefix: str = "") -> None:
    # Inherited by the spawned engine process, which imports transformers too.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            format=f"%(levelname)s %(asctime)s {prefix}%(name)s: %(message)s",
        )
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
