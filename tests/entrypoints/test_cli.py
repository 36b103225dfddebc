"""`jengine generate` and `jengine serve` as a user runs them (subprocesses)."""

import re
import socket
import subprocess
import sys

from tests.entrypoints.remote_server import ENGINE_FLAGS

CLI = [sys.executable, "-m", "jengine.entrypoints.cli"]


def run(args, timeout=300, stdin=""):
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, input=stdin
    )


def test_generate_streamed_and_not(tiny_model):
    """The prompt as an argument or piped in (vLLM users pipe text into one-shot commands)."""
    flags = ["--model", tiny_model, "--max-tokens", "12", "--temperature", "0", *ENGINE_FLAGS]
    plain = run(["generate", "The quick brown fox", *flags])
    assert plain.returncode == 0, plain.stderr[-3000:]
    streamed = run(["generate", "-", *flags, "--stream"], stdin="The quick brown fox\n")
    assert streamed.returncode == 0, streamed.stderr[-3000:]
    assert plain.stdout == streamed.stdout and plain.stdout.strip()
    empty = run(["generate", *flags], stdin="")
    assert empty.returncode != 0 and "error: the prompt is empty" in empty.stderr


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


def test_generate_logs_only_what_a_user_needs(tiny_model):
    """A first run says model, dtype, attention, KV capacity and ready time, and nothing
    the user must learn to ignore: not transformers' advice that PyTorch is missing (the
    command keeps torch out even where it is installed, as here), nor JAX probing for a
    TPU."""
    code = "import sys; from jengine.entrypoints.cli import main; main(sys.argv[1:])"
    args = ["generate", "The quick brown fox", "--model", tiny_model, "--max-tokens", "4",
            "--temperature", "0", *ENGINE_FLAGS]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert all(re.match(r"INFO \S+ \S+ jengine\.", line) for line in lines), lines
    log = "\n".join(lines)
    assert re.search(rf"model {re.escape(tiny_model)}: LlamaForCausalLM, float32", log)
    assert re.search(r"attention: \w+", log) and "KV cache: " in log and "ready in" in log
