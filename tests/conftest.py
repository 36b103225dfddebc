"""Session fixtures shared across test packages: one random-weight Llama checkpoint with
its transformers twin (the fidelity oracle), and `LLM`s over it under each attention setup
of the equality suite. And the order files run in under `pytest -n 2 --dist loadfile`
(the README's test command): the slowest first, so both workers finish together."""

import gc
from pathlib import Path

import jax
import pytest

from tests.engine.engine_helpers import ATTENTION_SETUPS, make_llm
from tests.models.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3_engine")
    hf_model = make_checkpoint("llama3", str(path))
    return str(path), hf_model


@pytest.fixture(scope="session", params=list(ATTENTION_SETUPS))
def attention_setup(request) -> str:
    """Runs a test once per attention setup (see ATTENTION_SETUPS)."""
    return request.param


@pytest.fixture(scope="session")
def llm(checkpoint, attention_setup):
    return make_llm(checkpoint[0], attention_setup)


def _memory_map_limit() -> int:
    path = Path("/proc/sys/vm/max_map_count")
    return int(path.read_text()) if path.exists() else 0


def _map_count() -> int:
    return Path("/proc/self/maps").read_text().count("\n")


def pytest_runtest_teardown(item, nextitem):
    """Frees jax's compiled executables once a worker holds many of the memory maps the
    kernel allows. Each engine's executables hold ~1,300-2,300 maps of JIT code, and jax
    keeps them while its caches live: a worker that had built ~50 engines reached Linux's
    65,530 and segfaulted in XLA's executable (de)serialization. Past half the limit they
    are freed between test files; past three quarters after any test, since
    tests/models/test_quantized_models.py alone adds ~40,000 (a worker that entered it just
    under half crashed in its last test). Freeing costs a re-trace, and an XLA compile,
    wherever a warmed engine is used again: a module's engines would then count compiles
    after warmup, so mid-file freeing waits until a crash is the alternative."""
    limit = _memory_map_limit()
    if not limit:
        return
    last_of_file = nextitem is None or nextitem.path != item.path
    maps = _map_count()
    if maps > limit * 3 // 4 or (last_of_file and maps > limit // 2):
        jax.clear_caches()
        gc.collect()


# The slowest test files, slowest first (`--durations` of the README's test command). A
# file that starts last while the other worker is idle adds its whole time to the run.
SLOWEST_FIRST = [
    "tests/engine/test_spec_decode.py",
    "tests/entrypoints/test_llm.py",
    "tests/models/test_smollm2.py",
    "tests/kernels/test_pallas_interpret.py",
    "tests/runner/test_tensor_parallel.py",
    "tests/runner/test_multi_host.py",
    "tests/engine/test_bundled_model.py",
    "tests/entrypoints/test_spec_decode_server.py",
    "tests/kernels/test_cpu_kernel.py",
    "tests/entrypoints/test_soak.py",
    "tests/entrypoints/test_smollm2_chat.py",
    "tests/test_install.py",
]
# Files that share a session fixture run in one worker, which then builds it once:
# test_bad_input.py uses test_llm.py's `llm` engines.
SAME_WORKER = {"tests/engine/test_bad_input.py": "tests/entrypoints/test_llm.py"}


def _work_unit(nodeid: str) -> str:
    file = nodeid.split("::", 1)[0]
    return SAME_WORKER.get(file, file)


@pytest.hookimpl(trylast=True)  # after pytest has grouped the items by fixture parameter
def pytest_collection_modifyitems(items):
    rank = {file: i for i, file in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(_work_unit(item.nodeid), len(rank)))


class _FileScheduling:
    """xdist's `--dist loadfile` with SAME_WORKER's files as one unit, and the units in
    collection order (xdist would put the files with the most tests first)."""

    @pytest.hookimpl
    def pytest_xdist_make_scheduler(self, config, log):
        from xdist.scheduler import LoadScopeScheduling

        class Scheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return _work_unit(nodeid)

        config.option.loadscopereorder = False
        return Scheduling(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") == "loadfile":
        config.pluginmanager.register(_FileScheduling())
