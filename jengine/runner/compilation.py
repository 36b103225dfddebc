"""Compilation: the persistent cache, the compile counter and ahead-of-time warmup compiles.

Where it sits: `EngineCore` calls `enable_compilation_cache` before building the runner
when its config names a cache directory. `ModelRunner` owns a `CompileCounter` and wraps
every `execute` in `counter.counting()`; `ModelRunner.warmup` hands its programs to
`compile_ahead_of_time` before running the dummy steps that load them.

Promises:
- `enable_compilation_cache(path)` is process-wide (jax has one setting) and caches every
  executable, however small or fast to compile; processes may share the folder;
- `CompileCounter.count` is the number of XLA compiles that happened inside `counting()`
  (after warmup, that should stay 0); compiles elsewhere in the process are not counted.
  jax keeps its listeners forever, so the listener holds the counter weakly: a dropped
  engine is not kept alive by it;
- `compile_ahead_of_time` only fills the persistent cache: without one it does nothing,
  since an executable compiled ahead of time is not reused by a later jitted call;
- `StaticJit` binds a step function's leading arguments (graphdef, attention
  implementation, ...) as static: a second engine over an equal model in the same process
  reuses the first one's traces and executables (a `partial` would be a new function to
  jax, traced, lowered and compiled again).
"""

import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import jax

logger = logging.getLogger(__name__)

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def enable_compilation_cache(path: str) -> str:
    """Persist compiled executables on disk so a second start is fast. Process-wide (jax
    has one setting), so the engine calls it only when its config asks for it. Processes
    may share the folder: an entry another process is still writing fails jax's check
    when read (a warning, and a compile), never loads half an executable. (No size
    limit: with one, jax reads every entry's access time at each write, and fails every
    write while any entry lacks one, as those written without a limit do.)"""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation_cache_dir: cannot create {path!r}: {e.strerror}") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class CompileCounter:
    """Counts the XLA compiles that happen inside `counting()`; warns of each once
    `warmed_up` is set (before that, in an engine without warmup, they are expected)."""

    def __init__(self):
        self.count = 0
        self.warmed_up = False
        self._active = False
        # jax keeps listeners forever: hold the counter weakly so it (and whoever owns it)
        # can be freed.
        on_event = weakref.WeakMethod(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(
            lambda *args, **kwargs: (method := on_event()) and method(*args, **kwargs)
        )

    @contextmanager
    def counting(self) -> Iterator[None]:
        self._active = True
        try:
            yield
        finally:
            self._active = False

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        # The listener is process-wide: count only compiles inside `counting()`.
        if not (self._active and event == COMPILE_EVENT):
            return
        self.count += 1
        if self.warmed_up:
            logger.warning("XLA compile after warmup (%.2fs)", duration)
        else:
            logger.debug("compiled a step program on first use (%.2fs)", duration)


class StaticJit:
    """`fn` jitted with its leading arguments `bound` and static; called (and lowered)
    with the rest. `donate_argnums` count from the first argument after `bound`."""

    def __init__(self, fn, *bound, donate_argnums: tuple[int, ...] = ()):
        # One module-level function jitted, with `fn` a static argument too: jax's trace
        # cache is keyed by the function, so equal engines share traces.
        self._bound = (fn, *map(_HashedOnce, bound))
        self._jitted = jax.jit(
            _call_bound,
            static_argnums=tuple(range(len(self._bound))),
            donate_argnums=tuple(len(self._bound) + i for i in donate_argnums),
        )

    def __call__(self, *args):
        return self._jitted(*self._bound, *args)

    def lower(self, *args):
        return self._jitted.lower(*self._bound, *args)


def _call_bound(fn, *args):
    return fn(*(a.value if isinstance(a, _HashedOnce) else a for a in args))


class _HashedOnce:
    """A static argument whose hash is computed once: jax hashes static arguments on every
    call, and hashing a model's graphdef costs ~0.1 ms, twice a step. Equal to another
    when the arguments are equal, so equal engines still share traces."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _HashedOnce) and (
            self.value is other.value or self.value == other.value
        )


def compile_ahead_of_time(programs: Sequence[tuple]) -> None:
    """Compile `(jitted_fn, *args)` programs on a thread pool into the persistent cache.

    XLA compiles outside the GIL, one program per core; the sequential dummy steps of
    warmup then only load the executables. Does nothing without a persistent cache.
    """
    if not jax.config.jax_compilation_cache_dir:
        return
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda p: p[0].lower(*p[1:]).compile(), programs))
