"""Multi-host SPMD on one machine: two processes on 127.0.0.1 joined by `jax.distributed`
(gloo collectives), 2 CPU devices each, one TP=4 mesh across them. Host 0 schedules, host
1 follows (`jengine serve --host-rank 1`); the tokens and logprobs equal those of one
process with 4 devices, through `LLM` and through `jengine serve` on host 0; host 1
exits cleanly when host 0 stops, and at once when host 0 fails."""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import openai
import pytest

from tests.entrypoints.remote_server import (
    ENGINE_FLAGS,
    MODEL_NAME,
    SERVER_ARGS,
    RemoteServer,
    engine_flags,
    free_port,
    log_excerpt,
)
from tests.entrypoints.tiny_model import make_tiny_model
from tests.runner.multi_host_check import LIMITS, MAX_TOKENS, PROMPTS

TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
# The serving tests' engine flags with multi_host_check's limits (the last flag wins).
FLAGS = [*ENGINE_FLAGS, *engine_flags(LIMITS)]


def multi_host_flags(address: str, rank: int) -> list[str]:
    return [
        "--tensor-parallel-size", "4", "--num-hosts", "2", "--host-rank", str(rank),
        "--coordinator-address", address,
    ]  # fmt: skip


def run_check(*args: str, devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.runner.multi_host_check", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Follower:
    """Host 1: `jengine serve MODEL ... --host-rank 1`, log to a file."""

    def __init__(self, model: str, address: str, *extra: str, env: dict | None = None):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="jengine-host1-", suffix=".log")  # noqa: SIM115
        cmd = [
            sys.executable, "-m", "jengine.entrypoints.cli", "serve", model, *FLAGS,
            *multi_host_flags(address, 1), *extra,
        ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1", **TWO_DEVICES, **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_for_exit(self, timeout: float) -> int | None:
        """Its exit code; None if it still ran after `timeout` (it is killed then)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.seek(0)
            self.text = self.log.read()
            self.log.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_model_multi_host")))


@pytest.fixture(scope="module")
def reference(tiny_model) -> dict:
    return run_check(tiny_model, devices=4)


def assert_same_generation(result: dict, reference: dict) -> None:
    assert result["tokens"] == reference["tokens"]
    for ours, theirs in zip(result["logprobs"], reference["logprobs"], strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_two_hosts_generate_what_one_host_does(tiny_model, reference):
    address = f"127.0.0.1:{free_port()}"
    follower = Follower(tiny_model, address)
    result = run_check(tiny_model, address, devices=2)
    assert follower.wait_for_exit(60) == 0, log_excerpt(follower.text)
    assert "following host 0's steps" in follower.text
    assert result["devices"] == 4 and result["compiles_after_warmup"] == 0
    assert_same_generation(result, reference)
    assert result["again_tokens"] == reference["tokens"]
    assert result["cached_tokens"][0] >= 64  # the long prompt hit the prefix cache


def test_two_host_server(tiny_model, reference):
    address = f"127.0.0.1:{free_port()}"
    follower = Follower(tiny_model, address)
    args = [*SERVER_ARGS, *engine_flags(LIMITS), *multi_host_flags(address, 0)]
    try:
        server = RemoteServer(tiny_model, args, env=TWO_DEVICES)
    except (RuntimeError, TimeoutError) as e:  # host 0's log alone may not say why
        follower.wait_for_exit(0)
        raise AssertionError(f"{e}\nhost 1's log:\n{log_excerpt(follower.text)}") from None
    with server:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none", max_retries=0)
        choices = client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1
        ).choices
    assert [c.text for c in choices] == reference["texts"]
    for choice, logprobs in zip(choices, reference["logprobs"], strict=True):
        np.testing.assert_allclose(choice.logprobs.token_logprobs, logprobs, atol=1e-4, rtol=0)
    # The server's engine told host 1 to stop as it shut down.
    assert follower.wait_for_exit(60) == 0, log_excerpt(follower.text)


def test_a_host_failing_at_start_up_ends_every_host_at_once(tiny_model):
    """Host 0, given another tensor-parallel size than host 1, fails after the hosts have
    joined: its engine exits with its own error, which the server prints (not jax's abort
    after the 5-minute shutdown barrier, which waits for a host 1 stuck in a collective
    host 0 never joins), and host 1 ends with it."""
    address = f"127.0.0.1:{free_port()}"
    follower = Follower(tiny_model, address)
    args = [*SERVER_ARGS, *engine_flags(LIMITS), *multi_host_flags(address, 0)]
    args[args.index("--tensor-parallel-size") + 1] = "2"
    with pytest.raises(RuntimeError) as failure:
        RemoteServer(tiny_model, args, env=TWO_DEVICES)
    message = str(failure.value)
    assert "error: tensor_parallel_size must be the number of devices of all hosts" in message
    assert follower.wait_for_exit(30) not in (None, 0), log_excerpt(follower.text)


def test_a_host_alone_or_misnumbered_says_so(tiny_model):
    """A host whose others never join exits after JENGINE_HOST_JOIN_TIMEOUT naming the
    wait (it waited 5 minutes in silence, then jax aborted as though a host had died); a
    --host-rank past --num-hosts is the CLI's one line (it was a traceback)."""
    alone = Follower(tiny_model, f"127.0.0.1:{free_port()}", env={"JENGINE_HOST_JOIN_TIMEOUT": "3"})
    assert alone.wait_for_exit(60) not in (None, 0), log_excerpt(alone.text)
    assert "not all 2 hosts joined the coordinator" in alone.text, log_excerpt(alone.text)
    misnumbered = Follower(tiny_model, f"127.0.0.1:{free_port()}", "--host-rank", "2")
    assert misnumbered.wait_for_exit(60) not in (None, 0), log_excerpt(misnumbered.text)
    assert "error: host_rank must be in [0, num_hosts=2), got 2" in misnumbered.text
    assert "Traceback" not in misnumbered.text, log_excerpt(misnumbered.text)
