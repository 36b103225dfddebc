"""jengine installs under its own import names only: `models/` and `pallas_kernels/` are
`jengine.models` and `jengine.pallas_kernels`, so a user's own `models` package (what a JAX
research repo usually has) neither shadows ours nor is shadowed by it.
"""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from jengine.models.default import BUNDLED_MODEL_PATH

REPO = Path(__file__).resolve().parents[1]
# Small limits keep warmup to a handful of shapes.
LIMITS = ["--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]

USER_MODELS = '''"""A research repo's own models package: nothing jengine knows."""

OWNER = "user"


class ResNet:
    pass
'''

LLM_SCRIPT = """
from jengine import LLM, SamplingParams
from jengine.models.default import BUNDLED_MODEL_PATH
llm = LLM(BUNDLED_MODEL_PATH, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
text = llm.generate("ROMEO:", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
import models  # the user's own package is still theirs
assert models.OWNER == "user", models.__file__
print("generated:", repr(text))
"""


def _user_repo(tmp_path: Path) -> Path:
    for name in ("models", "pallas_kernels"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(USER_MODELS)
    return tmp_path


def _run(args, cwd: Path) -> subprocess.CompletedProcess:
    # PYTHONPATH=. is how such a repo puts its packages on the path.
    env = dict(os.environ, PYTHONPATH=str(cwd))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_llm_runs_beside_a_user_models_package(tmp_path):
    result = _run([sys.executable, "-c", LLM_SCRIPT], _user_repo(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "generated:" in result.stdout


def test_cli_runs_beside_a_user_models_package(tmp_path):
    jengine = shutil.which("jengine", path=os.path.dirname(sys.executable))
    assert jengine is not None, "the jengine console script is not installed"
    args = [jengine, "generate", "ROMEO:", "--max-tokens", "8", "--temperature", "0", *LIMITS,
            "--model", BUNDLED_MODEL_PATH]  # fmt: skip
    result = _run(args, _user_repo(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()


def test_every_package_folder_is_installed_under_jengine():
    """pyproject.toml lists the packages by hand (the two top-level folders are mapped
    under `jengine.`); a folder left out of the list would be missing from a wheel."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"jengine": REPO / "jengine"}
    roots |= {name: REPO / folder for name, folder in setuptools["package-dir"].items()}
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder)
            found.add(".".join([name, *relative.parts]))
    assert found == set(setuptools["packages"])
