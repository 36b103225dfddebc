"""When the scheduler runs a multi-step decode (`num_scheduler_steps` K > 1), and what it
hands out for one: one token per request with slots for K, counters advanced by K, and K
tokens taken back (up to a stop). The runner is played by hand: each test says which
tokens come back. The engine-level equality with single steps is
tests/engine/test_multi_step.py."""

from jengine.core import ModelRunnerOutput
from tests.core.core_helpers import EOS, assert_no_leak, make_request, make_scheduler

K = 4


def answer(scheduler, output, tokens_of) -> list:
    """Update `scheduler` with `tokens_of(req_id)` for each request `output` scheduled;
    returns the EngineCoreOutputs' outputs."""
    req_ids = list(output.num_scheduled_tokens)
    runner_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[tokens_of(r) for r in req_ids],
    )
    return scheduler.update_from_output(output, runner_output).outputs


def started(scheduler, *requests):
    """The requests added, their prompts run, and their first token sampled."""
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.num_decode_steps == 1  # a prefill step
    answer(scheduler, output, lambda r: [100])


def test_decoding_requests_get_k_tokens_per_step():
    scheduler = make_scheduler(num_scheduler_steps=K, block_size=4)
    a, b = make_request("a", 6, max_tokens=20), make_request("b", 9, max_tokens=20)
    started(scheduler, a, b)
    output = scheduler.schedule()
    assert output.num_decode_steps == K
    assert output.num_scheduled_tokens == {"a": 1, "b": 1}
    # Slots for all K tokens: a holds positions 6..9, b 9..12.
    kv = scheduler.kv_cache_manager
    assert len(kv.get_block_ids("a")) == 3 and len(kv.get_block_ids("b")) == 4
    assert (a.num_computed_tokens, b.num_computed_tokens) == (6 + K, 9 + K)
    assert a.num_output_placeholders == K
    outputs = answer(scheduler, output, lambda r: [11, 12, 13, 14])
    assert [o.new_token_ids for o in outputs] == [[11, 12, 13, 14]] * 2
    assert a.output_token_ids == [100, 11, 12, 13, 14] and a.num_output_placeholders == 0
    assert a.num_computed_tokens == a.num_tokens - 1  # decoding again
    assert scheduler.schedule().num_decode_steps == K


def test_a_stop_inside_the_tokens_ends_the_request_there():
    scheduler = make_scheduler(num_scheduler_steps=K)
    a = make_request("a", 6, max_tokens=20)
    started(scheduler, a)
    output = scheduler.schedule()
    (out,) = answer(scheduler, output, lambda r: [11, EOS, 13, 14])
    assert out.new_token_ids == [11, EOS] and out.finish_reason is not None
    assert_no_leak(scheduler)


def test_what_keeps_a_step_single():
    # A waiting request that could start now: it starts now.
    scheduler = make_scheduler(num_scheduler_steps=K)
    started(scheduler, make_request("a", 6, max_tokens=20))
    scheduler.add_request(make_request("b", 6))
    assert scheduler.schedule().num_decode_steps == 1

    # Room for fewer than K more tokens within max_model_len.
    scheduler = make_scheduler(num_scheduler_steps=K, max_model_len=10)
    started(scheduler, make_request("a", 7, max_tokens=20))
    assert scheduler.schedule().num_decode_steps == 1

    # min_tokens reached inside the K tokens (EOS unmasked from then on) ...
    scheduler = make_scheduler(num_scheduler_steps=K)
    started(scheduler, make_request("a", 6, max_tokens=20, min_tokens=3))
    assert scheduler.schedule().num_decode_steps == 1
    # ... but not if the tokens past it are past max_tokens too.
    scheduler = make_scheduler(num_scheduler_steps=K)
    started(scheduler, make_request("a", 6, max_tokens=3, min_tokens=3))
    assert scheduler.schedule().num_decode_steps == K


def test_it_never_preempts_for_the_k_tokens():
    # 6 usable blocks of 4, all held by a and b after their 9-token prompts; K more
    # tokens need a 4th block each, one more token does not: single steps, no preemption.
    scheduler = make_scheduler(num_scheduler_steps=K, num_blocks=7, max_model_len=24)
    started(scheduler, make_request("a", 9, max_tokens=20), make_request("b", 9, max_tokens=20))
    output = scheduler.schedule()
    assert output.num_decode_steps == 1 and not output.removed_req_ids
    assert scheduler.make_stats().num_preemptions == 0
