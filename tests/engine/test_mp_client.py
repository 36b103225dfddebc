"""The engine core in its own process behind ZeroMQ (SyncMPClient), driven by LLMEngine:
greedy tokens equal Hugging Face's, n > 1 fan-out, utilities, aborts returning blocks,
a clear error (not a hang) when the engine dies or fails to start, the front end's stop
taking even where Python drops exceptions or a second Ctrl-C cuts the shutdown short,
engine processes starting with SIGINT ignored, and msgspec round trips of the messages
that cross the boundary."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from jengine.engine.arg_utils import EngineArgs
from jengine.engine.client import EngineDeadError
from jengine.engine.engine_process import sigint_ignored_by_children
from jengine.engine.llm_engine import LLMEngine
from jengine.engine.mp_clients import SyncMPClient
from jengine.protocol import EngineCoreReady, UtilityOutput, UtilityRequest
from jengine.sampling_params import SamplingParams
from tests.engine.engine_helpers import ATTENTION_SETUPS
from tests.entrypoints.tiny_model import ENGINE_ARGS, make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_model_mp")))


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model, **ENGINE_ARGS))
    yield engine
    engine.shutdown()


def run_to_completion(engine: LLMEngine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def test_protocol_round_trips():
    for message in (
        UtilityRequest(3, "num_free_blocks"),
        UtilityRequest(4, "get_stats", [1, "x"]),
        UtilityOutput(3, result={"num_free_blocks": 7}),
        UtilityOutput(5, failure_message="boom"),
        EngineCoreReady(pid=1, vocab_size=384, num_blocks=256),
    ):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=type(message)) == (
            message
        )


def test_greedy_over_zmq_matches_transformers(engine, tiny_model):
    import torch
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model).eval()
    tokenizer = engine.tokenizer
    prompts = ["The quick brown fox", "Hello, world!", "To be, or not to be"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, params)
    engine.add_request("n2", prompts[0], SamplingParams(temperature=0.0, max_tokens=12, n=2))
    finished = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
            )[0, len(ids) :].tolist()
        completion = finished[f"g{i}"].outputs[0]
        assert completion.token_ids == expected
        assert completion.text == tokenizer.decode(expected)
    fanned = finished["n2"].outputs
    assert [c.index for c in fanned] == [0, 1]
    assert fanned[0].token_ids == fanned[1].token_ids == finished["g0"].outputs[0].token_ids


def test_utilities(engine):
    client = engine.client
    assert client.call_utility("num_free_blocks") == 255
    assert client.call_utility("compiles_after_warmup") == 0
    assert client.call_utility("has_unfinished_requests") is False
    stats = client.call_utility("get_stats")
    assert stats["num_blocks"] == 256 and stats["num_running_reqs"] == 0
    assert stats["attention_impl"] == ATTENTION_SETUPS["default-bs16"]["expected_attention"]
    assert client.ready.vocab_size == 384
    with pytest.raises(ValueError):
        client.call_utility("update_weights", {})  # in-process only
    with pytest.raises(ValueError):
        client.call_utility("step")


def test_abort_returns_blocks(engine):
    engine.add_request("long", "Hello", SamplingParams(max_tokens=100, ignore_eos=True))
    tokens = 0
    while tokens < 3:
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step())
    assert engine.client.call_utility("num_free_blocks") < 255
    engine.abort_request("long")
    assert not engine.has_unfinished_requests()
    # Requests are handled in order, so the abort is done before this answer is made.
    assert engine.client.call_utility("num_free_blocks") == 255


def test_engine_death_raises_instead_of_hanging(engine):
    client: SyncMPClient = engine.client
    engine.add_request("doomed", "Hello", SamplingParams(max_tokens=100, ignore_eos=True))
    os.kill(client.engine_pid, signal.SIGKILL)
    errors = []

    def drive():
        try:
            run_to_completion(engine)
        except EngineDeadError as e:
            errors.append(e)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive() and errors, "get_output hung after the engine died"
    with pytest.raises(EngineDeadError):
        client.call_utility("num_free_blocks")
    with pytest.raises(EngineDeadError):
        engine.add_request("late", "Hello", SamplingParams(max_tokens=2))


def test_startup_failure_is_reported(tiny_model, tmp_path):
    broken = tmp_path / "no_weights"
    broken.mkdir()
    for name in os.listdir(tiny_model):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_model, name), broken / name)
    config = EngineArgs(model=str(broken), **ENGINE_ARGS).create_engine_config()
    started = time.monotonic()
    # A problem with what it was given: the engine process's own words, as a ValueError.
    with pytest.raises(ValueError, match="has no \\*.safetensors weights"):
        SyncMPClient(config).wait_for_ready()
    assert time.monotonic() - started < 120


# The engine process's stop handling, with the stop arriving while Python runs a finalizer.
STOPPED_IN_A_FINALIZER = """
import os, time
from jengine.engine.core_proc import install_stop_handlers
from jengine.protocol import ENGINE_STOP_SIGNAL

install_stop_handlers(os.getppid())

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), ENGINE_STOP_SIGNAL)
        sum(range(1000))  # the handler runs here, inside the finalizer

Finalized()
time.sleep(5)
print("went on after the stop")
"""


def test_a_stop_landing_in_a_finalizer_still_stops_the_engine():
    """Python runs a signal handler wherever the main thread is; in a `__del__` or a
    weakref callback (jax runs many through warmup) the handler's SystemExit is printed
    ("Exception ignored in") and dropped. The engine then warmed up and served, deaf to the
    one stop its front end sends, until SIGKILLed 10 s later (a cold CI run saw it)."""
    started = time.monotonic()
    stopped = subprocess.run(
        [sys.executable, "-c", STOPPED_IN_A_FINALIZER], capture_output=True, text=True, timeout=60
    )
    assert stopped.returncode == 0, stopped.stderr
    assert "went on" not in stopped.stdout
    assert "Exception ignored" not in stopped.stderr
    assert time.monotonic() - started < 5


def test_a_shutdown_cut_short_still_stops_the_engines(tiny_model):
    """A second Ctrl-C landing in the shutdown's first part (the output thread's join) cut
    it short before the engines were told to stop: they ignored multiprocessing's exit
    SIGTERM (their parent lived), whose join then waited for ever, and the socket folder
    stayed in /tmp. Now the stop and the clean-up still run, and the interrupt goes on."""
    client = SyncMPClient(EngineArgs(model=tiny_model, **ENGINE_ARGS).create_engine_config())
    socket_dir = client._socket_dir

    stop_io = client._stop_io

    def interrupted():  # as if in its join, once the thread was told to stop
        stop_io()
        raise KeyboardInterrupt

    client._stop_io = interrupted
    with pytest.raises(KeyboardInterrupt):
        client.shutdown()
    process = client.replicas[0].proc
    process.join(30)
    assert not process.is_alive()
    assert not os.path.exists(socket_dir)


def test_engine_processes_start_with_sigint_ignored():
    """The front end owns Ctrl-C: a child started under `sigint_ignored_by_children` has
    SIGINT ignored from its first instruction (it ignored it only once it had imported
    jax, and a Ctrl-C before printed its traceback), and the parent's handler is back."""
    ignored = "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"
    probe = [sys.executable, "-c", ignored]
    with sigint_ignored_by_children():
        child = subprocess.run(probe, capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "True"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
