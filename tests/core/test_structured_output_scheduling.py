"""Structured outputs in the scheduler, on the host: a constrained request waits while its
grammar compiles and nothing else waits for it; once compiled, each step carries its
bitmask row when (and only when) it samples; its tokens feed its matcher and it ends with
"stop" when the grammar is complete; an abort while compiling leaks nothing."""

import threading

import numpy as np
from llguidance import LLTokenizer

from jengine.core import structured_output
from jengine.core.structured_output import StructuredOutputManager
from jengine.models.default import BUNDLED_MODEL_PATH
from jengine.protocol import FinishReason
from jengine.request import RequestStatus
from jengine.sampling_params import StructuredOutputsParams
from tests.core.core_helpers import (
    StubRunner,
    assert_no_leak,
    make_request,
    make_scheduler,
    next_token,
    step,
)

CHOICES = ["yes please", "no thanks"]


def slow_manager(release: threading.Event) -> tuple[StructuredOutputManager, LLTokenizer]:
    with open(f"{BUNDLED_MODEL_PATH}/tokenizer.json") as f:
        tokenizer = LLTokenizer(f.read())

    def make_tokenizer():
        release.wait(30)  # the "slow compile"
        return tokenizer, True

    return StructuredOutputManager(make_tokenizer, tokenizer.vocab_size), tokenizer


def first_allowed(row: np.ndarray) -> int:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return int(np.flatnonzero(bits)[0])


def test_a_compiling_grammar_holds_up_nothing_and_then_constrains():
    release = threading.Event()
    manager, tokenizer = slow_manager(release)
    scheduler = make_scheduler()
    scheduler.structured_output_manager = manager
    constraint = StructuredOutputsParams(choice=CHOICES)
    scheduler.add_request(make_request("c", 6, max_tokens=20, structured_outputs=constraint))
    scheduler.add_request(make_request("free", 6, max_tokens=3))
    masks = {}

    def sample(req_id, tokens):
        return first_allowed(masks[req_id]) if req_id in masks else next_token(tokens)

    runner, results = StubRunner(scheduler, sample), {}
    for _ in range(4):  # the free request runs to its end; the constrained one waits
        so = step(scheduler, runner, results)
        assert "c" not in so.num_scheduled_tokens and so.grammar_bitmask is None
    assert results["free"].finish_reason == FinishReason.LENGTH
    assert scheduler.requests["c"].status == RequestStatus.WAITING_FOR_GRAMMAR

    release.set()
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        sampling = [r for r in so.num_scheduled_tokens if r == "c"]
        assert so.structured_output_request_ids == sampling  # a row only when it samples
        rows = so.grammar_bitmask if so.grammar_bitmask is not None else []
        masks = dict(zip(so.structured_output_request_ids, rows))
        for output in scheduler.update_from_output(so, runner.execute(so)).outputs:
            results.setdefault(output.request_id, type(results["free"])())
            results[output.request_id].token_ids.extend(output.new_token_ids)
            results[output.request_id].finish_reason = output.finish_reason
    text = tokenizer.decode_str(results["c"].token_ids)
    assert text in CHOICES and results["c"].finish_reason == FinishReason.STOP
    assert_no_leak(scheduler)
    manager.shutdown()


def test_abort_while_the_grammar_compiles():
    release = threading.Event()
    manager, _ = slow_manager(release)
    scheduler = make_scheduler()
    scheduler.structured_output_manager = manager
    constraint = StructuredOutputsParams(regex="[a-z]+")
    scheduler.add_request(make_request("c", 6, structured_outputs=constraint))
    assert scheduler.has_unfinished_requests()
    scheduler.finish_requests("c")
    release.set()
    assert_no_leak(scheduler)
    assert not scheduler.constrained_ids
    manager.shutdown()


def test_compiled_grammars_kept_are_bounded(monkeypatch):
    """Every distinct schema compiles once and is kept for requests to come, but only the
    last MAX_COMPILED used: a server sent ever new schemas grew without bound."""
    monkeypatch.setattr(structured_output, "MAX_COMPILED", 3)
    release = threading.Event()
    release.set()
    manager, _ = slow_manager(release)
    choices = ("a", "b", "c", "a", "d")  # "a" used again: "b" is the oldest then
    constraints = {c: StructuredOutputsParams(choice=[c]) for c in choices}
    for i, choice in enumerate(choices):
        request = make_request(f"r{i}", 6, structured_outputs=constraints[choice])
        manager.add_request(request)
        assert request.structured_output.future.result() is not None
    kept = [structured_output.spec_key(constraints[c]) for c in ("c", "a", "d")]
    assert list(manager._compiled) == kept
    manager.shutdown()
