"""`jengine generate`, `jengine chat` and `jengine serve` as a user runs them (subprocesses)."""

import ctypes
import importlib
import os
import platform
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from jengine.entrypoints.cli import _converse, main, make_parser
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
    # A bad sampling flag fails before the model loads (it once loaded it first).
    for command in ("generate", "chat"):
        bad = run([command, "Hi", *flags, "--top-p", "0"])
        assert bad.returncode != 0 and "error: top_p must be" in bad.stderr, bad.stderr[-2000:]
        assert "engine ready" not in bad.stderr


def test_input_that_is_not_utf8_is_named(tiny_model):
    """Bytes that are not UTF-8 on standard input: the first one named, before the model
    loads (it was "a lone UTF-16 surrogate at character 7", which no user typed)."""
    for command in ("generate", "chat"):
        result = subprocess.run(
            [*CLI, command, "--model", tiny_model], input=b"ROMEO: \xff\xfe caf\xe9\n",
            capture_output=True, timeout=120, env={**os.environ, "LC_ALL": "C.UTF-8"},
        )  # fmt: skip
        assert result.returncode != 0
        assert "is not valid UTF-8: byte 0xff at byte 7" in result.stderr.decode()


def test_chat_as_a_conversation(tiny_model):
    """`jengine chat -i`: each line is a turn; `/clear` starts over, so the last turn's
    reply is the one-shot reply to the same message (greedy), and the turns between held
    the history (below)."""
    flags = ["--model", tiny_model, "--max-tokens", "8", *ENGINE_FLAGS]
    one_shot = run(["chat", "Hello there", *flags])
    assert one_shot.returncode == 0, one_shot.stderr[-3000:]
    turns = "Hello there\nAnd then?\n/clear\nHello there\n"
    talk = run(["chat", "-i", *flags], stdin=turns)
    assert talk.returncode == 0, talk.stderr[-3000:]
    reply = one_shot.stdout
    assert talk.stdout.startswith(reply) and talk.stdout.endswith(reply)
    assert len(talk.stdout) > 2 * len(reply)


def test_chat_samples_as_the_model_recommends(tiny_model, tmp_path):
    """`jengine chat` is greedy unless the model recommends sampling: `--generation-config`
    (or the checkpoint's generation_config.json) is taken, as by `generate` (chat's own
    defaults of 0 once overrode it)."""
    (tmp_path / "generation_config.json").write_text('{"temperature": 5.0}')
    flags = ["Hello there", "--model", tiny_model, "--max-tokens", "12", *ENGINE_FLAGS]
    recommended = ["--generation-config", str(tmp_path)]
    replies = {run(["chat", *flags, *recommended, "--seed", seed]).stdout for seed in "12"}
    assert len(replies) == 2
    greedy = {run(["chat", *flags, "--seed", seed]).stdout for seed in "12"}
    assert len(greedy) == 1


def test_a_conversation_keeps_its_history(monkeypatch, capsys):
    """What each turn is answered with: the system prompt, every earlier turn and reply,
    then the new turn; a refused turn (too long) says why and leaves no trace; `/clear`
    forgets; `/exit` ends."""
    seen = []

    def reply(messages):
        seen.append(messages)
        if messages[-1]["content"] == "too long":
            raise ValueError("prompt has 9000 tokens")
        return f"reply {len(seen)}"

    lines = iter(["too long", "", "second", "/clear", "third", "/exit", "never read"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    system = [{"role": "system", "content": "Be brief."}]
    _converse(reply, system, first="first")
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    answer = lambda text: {"role": "assistant", "content": text}  # noqa: E731
    assert seen == [
        [*system, user("first")],
        [*system, user("first"), answer("reply 1"), user("too long")],
        [*system, user("first"), answer("reply 1"), user("second")],
        [*system, user("third")],
    ]
    assert "error: prompt has 9000 tokens" in capsys.readouterr().err


def test_ctrl_c_at_the_prompt_ends_the_conversation(tiny_model):
    """Ctrl-C at `jengine chat`'s `> ` prompt ends it at once, whichever thread the
    kernel hands the SIGINT to: here one of the engine's own (under load a thread of
    XLA's took it, and the prompt waited for Enter)."""
    terminal, chat_side = os.openpty()
    chat = subprocess.Popen(
        [*CLI, "chat", "--model", tiny_model, *ENGINE_FLAGS],
        stdin=chat_side, stdout=chat_side, stderr=chat_side,
    )  # fmt: skip
    os.close(chat_side)
    try:
        shown, deadline = b"", time.monotonic() + 120
        while not shown.endswith(b"> ") and time.monotonic() < deadline:
            if select.select([terminal], [], [], 1)[0]:
                shown += os.read(terminal, 4096)
        assert shown.endswith(b"> "), shown[-2000:]
        _interrupt_a_thread_other_than_the_main_one(chat.pid)
        assert chat.wait(timeout=20) == 0
    finally:
        chat.kill()
        os.close(terminal)


def _interrupt_a_thread_other_than_the_main_one(pid: int) -> None:
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            blocked = next(line for line in f if line.startswith("SigBlk:")).split()[1]
        if tid != pid and not int(blocked, 16) & (1 << (signal.SIGINT - 1)):
            tgkill = {"x86_64": 234, "aarch64": 131}[platform.machine()]
            assert ctypes.CDLL(None, use_errno=True).syscall(tgkill, pid, tid, signal.SIGINT) == 0
            return
    raise AssertionError("every other thread blocks SIGINT")


def test_serve_fails_fast_and_clearly(tiny_model):
    result = run(["serve", "/no/such/model", "--port", "99999"], 60)
    assert result.returncode != 0 and "a port is 0-65535, got 99999" in result.stderr
    # A configuration the engine process finds wrong: its words, in one line.
    result = run(["serve", tiny_model, *ENGINE_FLAGS, "--port", "0", "--tensor-parallel-size", "3"])
    assert result.returncode != 0
    assert "error: tensor_parallel_size=3 does not divide the 4 attention heads" in result.stderr
    assert "Traceback" not in result.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = run(["serve", "/no/such/model", "--host", "127.0.0.1", "--port", port], 60)
        assert result.returncode != 0 and "cannot listen" in result.stderr
    result = run(["serve", "/no/such/model", "--port", "0"], 60)
    assert result.returncode != 0 and "is not a directory" in result.stderr
    # An adapter folder without its config: before the engine starts (it was after warmup,
    # under the engine's traceback).
    lora = ["--enable-lora", "--lora-modules", f"x={tiny_model}/none"]
    result = run(["serve", tiny_model, *ENGINE_FLAGS, "--port", "0", *lora], 60)
    assert result.returncode != 0 and "x: " in result.stderr
    assert "has no adapter_config.json" in result.stderr and "engine" not in result.stderr
    assert "Traceback" not in result.stderr
    help_text = run(["serve", "--help"], 60).stdout
    for flag in ("--served-model-name", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--block-size", "--dtype", "--api-key"):  # fmt: skip
        assert flag in help_text
    # Each was a traceback (a hub lookup, an OSError), or taken: one line now.
    for flags, error in (
        (["--tokenizer", "/no/such/tokenizer"], "tokenizer '/no/such/tokenizer' is not a folder"),
        (["--compilation-cache-dir", "/proc/nope"], "compilation_cache_dir: cannot create"),
        (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be"),
    ):
        result = run(["generate", "Hi", "--model", tiny_model, *ENGINE_FLAGS, *flags], 120)
        assert result.returncode == 1 and f"error: {error}" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert run(["--version"], 60).stdout.startswith("jengine ")


@pytest.mark.parametrize(
    ("flag", "value", "error"),
    [
        # Each was taken: 413 for every request, /health included; 429 with room for
        # "-1 queued"; "waiting up to -1s"; stats silently off; origins matched as
        # substrings of one string.
        ("--max-request-body-bytes", "-1", "must be above 0, got -1"),
        ("--max-queued-requests", "-1", "must be at least 0, got -1"),
        ("--shutdown-timeout", "-1", "must be at least 0, got -1"),
        ("--log-stats-interval", "0", "must be above 0, got 0"),
        ("--allowed-origins", '"https://app.example"', "a JSON list of strings"),
        ("--allowed-origins", "https://app.example", "a JSON list of strings"),
        ("--max-queued-requests", "many", "invalid int value: 'many'"),
    ],
)
def test_serve_flags_out_of_range_are_refused(capsys, flag, value, error):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", flag, value])
    assert error in capsys.readouterr().err


def test_help_names_every_flags_default(capsys):
    """Each flag with a default says it in --help (--port, --seed, --block-size,
    --enable-prefix-caching... said nothing), the command's own where it sets one."""
    expected = {
        "serve": ["--port PORT           default: 8000", "--seed SEED           default: 0",
                  "tokens per KV-cache block (default: 16)", "requests running at once "
                  "(default: 128)"],
        "generate": ["requests running at once (default: 1)",
                     "--max-tokens MAX_TOKENS default: 64"],
    }  # fmt: skip
    for command, phrases in expected.items():
        with pytest.raises(SystemExit):
            make_parser().parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for phrase in phrases:
            assert " ".join(phrase.split()) in text, (command, phrase)
        assert "(default: None)" not in text and "default: False" not in text


def test_ctrl_c_in_a_one_shot_command_exits_quietly(monkeypatch, capsys):
    """Ctrl-C during `jengine generate` (loading, compiling or streaming): exit 130, as a
    shell reports SIGINT, without the traceback it printed."""
    from jengine.entrypoints import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    with pytest.raises(SystemExit) as exited:
        main(["generate", "Hi"])
    assert exited.value.code == 130 and "Traceback" not in capsys.readouterr().err


def test_bench_names_its_benchmarks_and_describes_each_whole(capsys):
    with pytest.raises(SystemExit, match="name a benchmark: throughput, latency"):
        main(["bench"])  # it said `options`, which is optional, was missing too
    with pytest.raises(SystemExit):  # before the model loads (it failed after, unexplained)
        main(["bench", "prefix", "--num-requests", "-3"])
    assert "--num-requests: must be at least 1, got -3" in capsys.readouterr().err
    for name in ("latency", "overhead"):
        with pytest.raises(SystemExit):
            main(["bench", name, "--help"])
        module = importlib.import_module(f"jengine.bench.{name}")
        first_paragraph = " ".join(module.__doc__.split("\n\n")[0].split())
        assert first_paragraph in " ".join(capsys.readouterr().out.split())  # not its first line


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
