"""Security basics of `jengine serve`: CORS only for --allowed-origins; the engine's ZeroMQ
sockets are IPC paths in a private (0700) directory and the engine listens on no TCP
port; no pickle on any wire; chat templates run in Jinja's sandbox. (The API key on /v1,
/tokenize, /detokenize and /metrics, and model names never used as paths, are checked in
test_openai_server.py.)"""

import os
import re
import stat
from pathlib import Path

import httpx2
import jinja2.exceptions
import pytest

from jengine.engine.input_processor import InputProcessor
from jengine.engine.tokenizer import load_tokenizer_from
from tests.entrypoints.remote_server import SERVER_ARGS, RemoteServer

ALLOWED = "http://app.example"
REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tiny_model):
    args = [*SERVER_ARGS, "--allowed-origins", f'["{ALLOWED}"]']
    with RemoteServer(tiny_model, args) as remote:
        yield remote


def test_cors_only_for_allowed_origins(server):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    url = server.url_for("v1/completions")
    allowed = httpx2.options(url, headers={"Origin": ALLOWED, **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED
    other = httpx2.options(url, headers={"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    models = httpx2.get(server.url_for("v1/models"), headers={"Origin": ALLOWED})
    assert models.headers["access-control-allow-origin"] == ALLOWED


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if match := re.fullmatch(r"socket:\[(\d+)\]", target):
            inodes.add(match.group(1))
    return inodes


def test_engine_sockets_are_private_ipc_paths(server):
    engine_inodes = _socket_inodes(server.engine_pid)
    paths = []
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[6] in _socket_inodes(server.proc.pid) | engine_inodes and len(fields) > 7:
                paths.append(fields[7])
    ipc = [path for path in paths if "jengine-" in path]
    assert ipc, f"no ZeroMQ IPC socket found among {paths}"
    for directory in {os.path.dirname(path) for path in ipc}:
        info = os.stat(directory)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid(), directory
    # The engine process listens on no TCP port at all (ZeroMQ over IPC only).
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                listening = fields[3] == "0A"
                assert not (listening and fields[9] in engine_inodes), f"engine listens: {line}"


def test_no_pickle_on_any_wire():
    """Engine messages are msgpack (msgspec) with typed decoders; nothing in the package
    pickles, so nothing received can run code when decoded."""
    offenders = []
    for folder in ("jengine", "models", "pallas_kernels", "bench"):
        for path in (REPOSITORY / folder).rglob("*.py"):
            text = path.read_text()
            if re.search(r"^\s*(import|from)\s+(c?pickle|cloudpickle|dill)\b", text, re.M):
                offenders.append(str(path))
    assert not offenders
    wire = (REPOSITORY / "jengine/engine/core_proc.py").read_text()
    assert "msgspec.msgpack.Decoder(EngineCoreRequest)" in wire


def test_chat_templates_run_in_jinjas_sandbox(tiny_model):
    tokenizer = load_tokenizer_from(tiny_model)
    tokenizer.chat_template = (
        "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    processor = InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=128)
    with pytest.raises(ValueError, match="could not apply the chat template") as refused:
        processor.render_chat([{"role": "user", "content": "hi"}])
    assert isinstance(refused.value.__cause__, jinja2.exceptions.SecurityError)
