"""Scheduler driven by a stub runner: budgets, chunking, preemption, priority, prefix hits,
aborts and stop conditions. No model runs; ``StubRunner`` checks every block table."""

import random

import pytest

from jengine.core import ModelRunnerOutput
from jengine.protocol import FinishReason
from jengine.request import RequestStatus
from tests.core.core_helpers import (
    EOS,
    Result,
    StubRunner,
    assert_no_leak,
    collect,
    make_request,
    make_scheduler,
    reference_tokens,
    run_to_completion,
    step,
)


def test_chunked_prefill_then_decode():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    req = make_request("a", 30, max_tokens=3)
    sched.add_request(req)
    runner, results = StubRunner(sched), {}

    scheduled, computed, sampled = [], [], []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        scheduled.append(so.num_scheduled_tokens["a"])
        data = so.scheduled_new_reqs or so.scheduled_cached_reqs
        computed.append(data[0].num_computed_tokens)
        out = runner.execute(so)
        sampled.append(out.sampled_token_ids[0])
        collect(sched.update_from_output(so, out), results)

    assert scheduled == [8, 8, 8, 6, 1, 1]
    assert computed == [0, 8, 16, 24, 30, 31]
    assert [len(s) for s in sampled] == [0, 0, 0, 1, 1, 1]  # nothing sampled mid-prompt
    assert results["a"].token_ids == reference_tokens(req.prompt_token_ids, 3)
    assert results["a"].finish_reason == FinishReason.LENGTH
    assert_no_leak(sched)


def test_running_requests_go_first_and_share_the_budget():
    sched = make_scheduler(max_num_batched_tokens=10, max_num_seqs=4)
    sched.add_request(make_request("a", 6, max_tokens=4))
    sched.add_request(make_request("b", 20, max_tokens=4))
    runner, results = StubRunner(sched), {}
    plan = []
    while sched.has_unfinished_requests():
        plan.append(dict(step(sched, runner, results).num_scheduled_tokens))
    # a's decode comes before b's prefill chunk; b gets what is left of the 10 tokens.
    assert plan[:4] == [{"a": 6, "b": 4}, {"a": 1, "b": 9}, {"a": 1, "b": 7}, {"a": 1, "b": 1}]
    assert all(r.token_ids for r in results.values())
    assert_no_leak(sched)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("caching", [True, False])
def test_many_requests_match_reference(policy, caching):
    rng = random.Random(0)
    sched = make_scheduler(
        max_num_batched_tokens=16,
        max_num_seqs=4,
        policy=policy,
        enable_prefix_caching=caching,
    )
    reqs = [
        make_request(f"r{i}", rng.randint(1, 40), max_tokens=rng.randint(1, 10), priority=i % 3)
        for i in range(20)
    ]
    for r in reqs:
        sched.add_request(r)
    results = run_to_completion(sched, StubRunner(sched))
    for r in reqs:
        assert results[r.request_id].token_ids == reference_tokens(r.prompt_token_ids, r.max_tokens)
        assert results[r.request_id].finish_reason == FinishReason.LENGTH
    assert_no_leak(sched)


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 5, max_tokens=3))
    runner, results = StubRunner(sched), {}
    so = step(sched, runner, results)
    assert list(so.num_scheduled_tokens) == ["r0", "r1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    run_to_completion(sched, runner, results)  # invariants checked every step
    assert len(results) == 5
    assert_no_leak(sched)


def test_long_prefill_token_threshold_limits_each_request():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    sched.add_request(make_request("a", 30, max_tokens=2))
    sched.add_request(make_request("b", 30, max_tokens=2))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}


def _pressure_workload(num_blocks, policy="fcfs"):
    # 36 usable tokens (9 blocks of 4) for six requests that each grow to 26 tokens.
    sched = make_scheduler(
        num_blocks=num_blocks, max_model_len=32, max_num_batched_tokens=32, policy=policy
    )
    reqs = [make_request(f"r{i}", 10, max_tokens=16, priority=i % 2) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    return sched, reqs


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_then_resume_gives_identical_outputs(policy):
    big, reqs = _pressure_workload(num_blocks=200, policy=policy)
    expected = run_to_completion(big, StubRunner(big))
    assert sum(r.num_preemptions for r in reqs) == 0

    sched, reqs = _pressure_workload(num_blocks=10, policy=policy)
    runner, results = StubRunner(sched), {}
    preemptions, resumed, queries, hits = 0, 0, 0, 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        for new in so.scheduled_new_reqs:
            if new.output_token_ids:  # resumed: carries its outputs and a full block table
                resumed += 1
                assert new.output_token_ids == results[new.req_id].token_ids
                assert new.num_computed_tokens % 4 == 0
        outputs = sched.update_from_output(so, runner.execute(so))
        preemptions += outputs.scheduler_stats.num_preemptions
        queries += outputs.scheduler_stats.prefix_cache_queries
        hits += outputs.scheduler_stats.prefix_cache_hits
        collect(outputs, results)
    assert preemptions > 0 and resumed > 0
    # The prefix-cache metrics count each prompt's first lookup only (vLLM's): a resumed
    # request finding its own blocks again is no hit (the prompts share nothing).
    assert (queries, hits) == (sum(len(r.prompt_token_ids) for r in reqs), 0)
    assert preemptions == sum(r.num_preemptions for r in reqs)
    for r in reqs:
        assert results[r.request_id].token_ids == expected[r.request_id].token_ids
        assert results[r.request_id].token_ids == reference_tokens(r.prompt_token_ids, 16)
    assert_no_leak(sched)


def _tight_scheduler(policy):
    return make_scheduler(num_blocks=5, max_model_len=16, max_num_batched_tokens=32, policy=policy)


def test_fcfs_preempts_the_latest_running_request():
    sched = _tight_scheduler("fcfs")
    a, b = make_request("a", 7, max_tokens=8), make_request("b", 7, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    runner, results = StubRunner(sched), {}
    step(sched, runner, results)  # both prefill: 2 blocks each, pool full
    step(sched, runner, results)  # both decode into their second block
    so = step(sched, runner, results)  # a needs a third block: b makes room
    assert so.num_scheduled_tokens == {"a": 1}
    assert "b" in so.removed_req_ids
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and list(sched.waiting)[0] is b
    run_to_completion(sched, runner, results)
    for r in (a, b):
        assert results[r.request_id].token_ids == reference_tokens(r.prompt_token_ids, 8)
    assert_no_leak(sched)


def test_priority_preempts_lowest_priority_even_if_already_scheduled():
    sched = _tight_scheduler("priority")
    low = make_request("low", 5, max_tokens=10, priority=1, arrival_time=0.0)
    high = make_request("high", 7, max_tokens=8, priority=0, arrival_time=1.0)
    runner, results = StubRunner(sched), {}
    sched.add_request(low)
    step(sched, runner, results)  # low: 2 blocks
    sched.add_request(high)
    step(sched, runner, results)  # high: 2 blocks, pool full; running = [low, high]
    step(sched, runner, results)  # both decode in place
    so = step(sched, runner, results)
    # low was scheduled first in this step, then high needed a block: low is the victim,
    # and its tokens are taken back out of the step.
    assert so.num_scheduled_tokens == {"high": 1} and so.total_num_scheduled_tokens == 1
    assert "low" in so.removed_req_ids and low.status == RequestStatus.PREEMPTED
    run_to_completion(sched, runner, results)
    assert results["low"].token_ids == reference_tokens(low.prompt_token_ids, 10)
    assert results["high"].token_ids == reference_tokens(high.prompt_token_ids, 8)
    assert_no_leak(sched)


@pytest.mark.parametrize(("policy", "order"), [("priority", "bca"), ("fcfs", "abc")])
def test_waiting_order_follows_policy(policy, order):
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    sched.add_request(make_request("a", 4, max_tokens=1, priority=5, arrival_time=0.0))
    sched.add_request(make_request("b", 4, max_tokens=1, priority=0, arrival_time=1.0))
    sched.add_request(make_request("c", 4, max_tokens=1, priority=0, arrival_time=2.0))
    runner, results, admitted = StubRunner(sched), {}, []
    while sched.has_unfinished_requests():
        admitted += [n.req_id for n in step(sched, runner, results).scheduled_new_reqs]
    assert "".join(admitted) == order


def test_prefix_hits_across_requests_and_eviction_after_free():
    sched = make_scheduler(num_blocks=17, max_model_len=64, max_num_batched_tokens=64)
    runner, results = StubRunner(sched), {}
    shared = make_request("a", 22).prompt_token_ids  # 5 full blocks + 2 tokens
    sched.add_request(make_request("a", shared, max_tokens=4))
    run_to_completion(sched, runner, results)
    assert results["a"].num_cached_tokens == 0

    b = make_request("b", shared[:20] + [1, 2, 3, 4, 5], max_tokens=4)
    sched.add_request(b)
    so = step(sched, runner, results)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 20
    assert so.num_scheduled_tokens["b"] == 5
    run_to_completion(sched, runner, results)
    assert results["b"].num_cached_tokens == 20
    assert results["b"].token_ids == reference_tokens(b.prompt_token_ids, 4)

    # Two other requests use every block; a's cached blocks are evicted.
    sched.add_request(make_request("x", 30, max_tokens=2))
    sched.add_request(make_request("y", 30, max_tokens=2))
    run_to_completion(sched, runner, results)
    sched.add_request(make_request("c", shared, max_tokens=2))
    run_to_completion(sched, runner, results)
    assert results["c"].num_cached_tokens == 0
    assert_no_leak(sched)


def test_prefix_hit_within_the_same_step():
    sched = make_scheduler(max_num_batched_tokens=64)
    prompt = make_request("p", 13).prompt_token_ids
    sched.add_request(make_request("a", prompt, max_tokens=3))
    sched.add_request(make_request("b", prompt, max_tokens=3))
    runner, results = StubRunner(sched), {}
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 13, "b": 1}
    # The runner writes a's K/V before b reads it, and checks b's context.
    outputs = sched.update_from_output(so, runner.execute(so))
    collect(outputs, results)
    stats = outputs.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (26, 12)
    run_to_completion(sched, runner, results)
    assert results["a"].token_ids == results["b"].token_ids
    assert results["b"].num_cached_tokens == 12
    assert_no_leak(sched)


def test_abort_waiting_and_running_requests():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 9, max_tokens=20), make_request("b", 9, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    runner, results = StubRunner(sched), {}
    step(sched, runner, results)
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    sched.finish_requests("b")
    assert b.status == RequestStatus.FINISHED_ABORTED and len(sched.waiting) == 0
    sched.finish_requests(["a", "unknown"])
    assert a.get_finished_reason() == FinishReason.ABORT
    assert not sched.has_unfinished_requests()
    assert_no_leak(sched)
    so = sched.schedule()
    assert so.removed_req_ids == {"a", "b"} and so.is_empty


def test_abort_while_step_runs_discards_its_results():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=5))
    sched.add_request(make_request("b", 5, max_tokens=5))
    runner = StubRunner(sched)
    so = sched.schedule()
    out = runner.execute(so)
    sched.finish_requests("a")
    outputs = sched.update_from_output(so, out)
    assert [o.request_id for o in outputs.outputs] == ["b"]
    results = {}
    run_to_completion(sched, runner, results)
    assert "a" not in results
    assert_no_leak(sched)


def _run_one(sample, max_model_len=64, **kwargs) -> Result:
    sched = make_scheduler(max_model_len=max_model_len)
    prompt = kwargs.pop("prompt", 6)
    sched.add_request(make_request("a", prompt, **kwargs))
    runner = StubRunner(sched, sample=lambda req_id, tokens: sample(len(tokens)))
    results = run_to_completion(sched, runner)
    assert_no_leak(sched)
    return results["a"]


def _eos_at(n_out):
    # 6-token prompts: the n-th generated token (1-based) is EOS, later ones too.
    return lambda num_tokens: EOS if num_tokens - 6 >= n_out - 1 else 100 + num_tokens


def test_stop_on_eos():
    res = _run_one(_eos_at(3), max_tokens=10)
    assert res.token_ids == [106, 107, EOS]
    assert res.finish_reason == FinishReason.STOP and res.stop_reason is None
    assert str(res.finish_reason) == "stop"


def test_ignore_eos_and_missing_eos_run_to_max_tokens():
    res = _run_one(_eos_at(3), max_tokens=5, ignore_eos=True)
    assert len(res.token_ids) == 5 and res.finish_reason == FinishReason.LENGTH
    res = _run_one(_eos_at(3), max_tokens=5, eos_token_id=None)
    assert len(res.token_ids) == 5 and res.finish_reason == FinishReason.LENGTH


def test_min_tokens_defers_eos_and_stop_tokens():
    res = _run_one(_eos_at(3), max_tokens=10, min_tokens=5)
    assert res.token_ids == [106, 107, EOS, EOS, EOS]
    assert res.finish_reason == FinishReason.STOP
    res = _run_one(lambda n: 77, max_tokens=10, min_tokens=4, stop_token_ids=[77])
    assert res.token_ids == [77] * 4 and res.stop_reason == 77


def test_stop_token_ids():
    res = _run_one(lambda n: 77 if n == 8 else 100 + n, max_tokens=10, stop_token_ids=[5, 77])
    assert res.token_ids == [106, 107, 77]
    assert res.finish_reason == FinishReason.STOP and res.stop_reason == 77


def test_length_limits():
    res = _run_one(lambda n: 100 + n, max_tokens=4)
    assert len(res.token_ids) == 4 and str(res.finish_reason) == "length"
    # max_tokens=None: until the sequence reaches max_model_len.
    res = _run_one(lambda n: 100 + n, max_model_len=16, max_tokens=None, prompt=10)
    assert len(res.token_ids) == 6 and res.finish_reason == FinishReason.LENGTH
    # A prompt of exactly max_model_len still yields one token.
    res = _run_one(lambda n: 100 + n, max_model_len=16, max_tokens=None, prompt=16)
    assert len(res.token_ids) == 1 and res.finish_reason == FinishReason.LENGTH


def test_logprobs_are_carried_and_trimmed_per_request():
    sched = make_scheduler()
    sched.add_request(make_request("k2", 5, max_tokens=3, logprobs=2))
    sched.add_request(make_request("k0", 5, max_tokens=3, logprobs=0))
    sched.add_request(make_request("none", 5, max_tokens=3))
    runner = StubRunner(sched)
    seen = {"k2": [], "k0": [], "none": []}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        for out in sched.update_from_output(so, runner.execute(so)).outputs:
            if out.new_logprobs is None:
                seen[out.request_id].append(None)
                continue
            (tok,) = out.new_token_ids
            assert out.new_logprobs.token_ids[0][0] == tok
            seen[out.request_id].append(out.new_logprobs.token_ids[0])
    assert all(len(row) == 3 for row in seen["k2"]) and len(seen["k2"]) == 3
    assert all(len(row) == 1 for row in seen["k0"])
    assert seen["none"] == [None] * 3


def test_prompt_logprobs_skip_prefix_cache_and_arrive_per_chunk():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    prompt = make_request("p", 20).prompt_token_ids
    runner, results = StubRunner(sched), {}
    sched.add_request(make_request("a", prompt, max_tokens=2))
    run_to_completion(sched, runner, results)
    sched.add_request(make_request("b", prompt, max_tokens=2, prompt_logprobs=1))
    rows = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        assert not so.scheduled_new_reqs or so.scheduled_new_reqs[0].num_computed_tokens == 0
        for out in sched.update_from_output(so, runner.execute(so)).outputs:
            if out.new_prompt_logprobs is not None:
                rows += out.new_prompt_logprobs.token_ids
    assert [r[0] for r in rows] == prompt and all(len(r) == 2 for r in rows)
    assert_no_leak(sched)


def test_stats_and_validation():
    sched = make_scheduler(max_num_seqs=2, max_model_len=32)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 8))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("r0", 8))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", 33))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("empty", []))
    so = sched.schedule()
    sched.update_from_output(
        so,
        ModelRunnerOutput(
            req_ids=list(so.num_scheduled_tokens),
            req_id_to_index={r: i for i, r in enumerate(so.num_scheduled_tokens)},
            sampled_token_ids=[[11] for _ in so.num_scheduled_tokens],
        ),
    )
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 1)
    assert stats.kv_cache_usage == pytest.approx(4 / 63)  # 2 blocks each of 63 usable
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(num_blocks=8, block_size=4, max_model_len=32)  # 28 tokens of cache


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workload_with_aborts_leaks_nothing(policy):
    rng = random.Random(1)
    sched = make_scheduler(
        num_blocks=14, max_model_len=48, max_num_batched_tokens=24, max_num_seqs=6, policy=policy
    )
    runner, results = StubRunner(sched), {}
    shared = make_request("shared", 16).prompt_token_ids
    reqs, aborted = {}, set()
    for i in range(40):
        prompt = make_request(f"q{i}", rng.randint(1, 30)).prompt_token_ids
        if rng.random() < 0.4:
            prompt = shared[: rng.randint(4, 16)] + prompt  # some prefix sharing
        prompt = prompt[:40]
        r = make_request(f"q{i}", prompt, max_tokens=rng.randint(1, 8), priority=rng.randint(0, 2))
        reqs[r.request_id] = r
        sched.add_request(r)
        for _ in range(rng.randint(0, 3)):
            if sched.has_unfinished_requests():
                step(sched, runner, results)
        if rng.random() < 0.2:
            victim = rng.choice(list(reqs))
            if not reqs[victim].is_finished():
                aborted.add(victim)
            sched.finish_requests(victim)
    run_to_completion(sched, runner, results)
    for req_id, r in reqs.items():
        if req_id in aborted:
            continue
        assert results[req_id].token_ids == reference_tokens(r.prompt_token_ids, r.max_tokens)
    assert_no_leak(sched)
