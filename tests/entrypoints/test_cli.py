"""`jengine generate` and `jengine serve` as a user runs them (subprocesses)."""

import socket
import subprocess
import sys

from tests.entrypoints.conftest import ENGINE_FLAGS

CLI = [sys.executable, "-m", "jengine.entrypoints.cli"]


def run(args, timeout=300):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_generate_streamed_and_not(tiny_model):
    args = ["generate", "The quick brown fox", "--model", tiny_model, "--max-tokens", "12",
            "--temperature", "0", *ENGINE_FLAGS]  # fmt: skip
    plain = run(args)
    assert plain.returncode == 0, plain.stderr[-3000:]
    streamed = run([*args, "--stream"])
    assert streamed.returncode == 0, streamed.stderr[-3000:]
    assert plain.stdout == streamed.stdout and plain.stdout.strip()


def test_serve_fails_fast_and_clearly():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = run(["serve", "/no/such/model", "--host", "127.0.0.1", "--port", port], 60)
        assert result.returncode != 0 and "cannot listen" in result.stderr
    result = run(["serve", "/no/such/model", "--port", "0"], 60)
    assert result.returncode != 0 and "is not a directory" in result.stderr
    assert "Traceback" not in result.stderr
    help_text = run(["serve", "--help"], 60).stdout
    for flag in ("--served-model-name", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--block-size", "--dtype", "--api-key"):  # fmt: skip
        assert flag in help_text
