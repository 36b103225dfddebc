"""The jax boundary: the scheduler (jengine.core), the cross-process messages, the engine
clients and the whole API-server side import without loading jax.

Each check runs in a fresh interpreter, since this test process has long imported jax.
"""

import json
import subprocess
import sys

import pytest

# Packages whose every module must be jax-free, and single modules besides.
JAX_FREE_PACKAGES = ["jengine.core", "jengine.entrypoints.openai"]
JAX_FREE_MODULES = [
    "jengine",
    "jengine.config",
    "jengine.protocol",
    "jengine.request",
    "jengine.outputs",
    "jengine.sampling_params",
    "jengine.beam_search",
    "jengine.engine.arg_utils",
    "jengine.engine.client",
    "jengine.engine.engine_process",
    "jengine.engine.async_llm",
    "jengine.engine.llm_engine",
    "jengine.engine.input_processor",
    "jengine.engine.output_processor",
    "jengine.entrypoints.cli",
    "jengine.models",
    "jengine.models.default",
]

PROBE = """
import importlib, json, pkgutil, sys
modules = list(sys.argv[2:])
for package in json.loads(sys.argv[1]):
    pkg = importlib.import_module(package)
    modules += [m.name for m in pkgutil.walk_packages(pkg.__path__, package + ".")]
for name in modules:
    importlib.import_module(name)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax"))
    if loaded:
        print(json.dumps({"module": name, "loaded": loaded[:5]}))
        sys.exit(1)
print(json.dumps({"modules": modules}))
"""


def test_front_end_modules_do_not_import_jax():
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(JAX_FREE_PACKAGES), *JAX_FREE_MODULES],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1]) if result.stdout else {}
    if result.returncode != 0:
        pytest.fail(
            f"importing {report.get('module')} loaded {report.get('loaded')}\n{result.stderr}"
        )
    # The walk found the serving modules, so the check covered them.
    assert "jengine.entrypoints.openai.api_server" in report["modules"]
    assert "jengine.core.scheduler" in report["modules"]
