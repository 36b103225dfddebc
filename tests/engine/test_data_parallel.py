"""Data parallelism without the server: the balancer's routing and stats rules, and
`LLM(data_parallel_size=2)`: the same tokens as one engine, work on both replicas, one
replica's death a clear error while the other still answers."""

import os
import signal
import subprocess
import sys

import pytest

from jengine import LLM, SamplingParams
from jengine.engine.client import EngineDeadError
from jengine.engine.load_balancer import DataParallelBalancer, combine_stats
from jengine.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats
from tests.entrypoints.tiny_model import ENGINE_ARGS, make_tiny_model


def test_balancer_routes_to_least_load_and_keeps_requests_in_place():
    balancer = DataParallelBalancer(2)
    assert [balancer.route([f"r{i}"]) for i in range(4)] == [0, 1, 0, 1]
    assert balancer.route(["0_n", "1_n", "2_n"]) == 0  # one request's n sequences together
    assert balancer.route(["a"]) == 1 and balancer.route(["b"]) == 1
    assert balancer.loads == [5, 4]

    # A report replaces the replica's count: replica 0 got all 5 and has 1 running.
    report = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r0", [7], finish_reason=FinishReason.STOP)],
        scheduler_stats=SchedulerStats(
            num_running_reqs=1, kv_cache_usage=0.5, num_requests_received=5, num_preemptions=2
        ),
        engine_index=0,
    )
    balancer.observe(report)
    assert balancer.loads == [1, 4]
    # The stats handed on are the sum over replicas (replica 1 has not reported yet).
    assert report.scheduler_stats.num_running_reqs == 1
    assert report.scheduler_stats.kv_cache_usage == 0.25
    assert report.scheduler_stats.num_preemptions == 2
    assert balancer.route(["c"]) == 0
    assert balancer.route(["d"]) == 0 and balancer.loads == [3, 4]
    # A report written before "c" and "d" arrived still counts them: they are on the way.
    balancer.observe(
        EngineCoreOutputs(
            scheduler_stats=SchedulerStats(num_running_reqs=1, num_requests_received=5),
            engine_index=0,
        )
    )
    assert balancer.loads == [1 + 2, 4]

    # Aborts go where the sequences are; a finished one is forgotten.
    assert balancer.take(["r0", "r1", "1_n", "a", "gone"]) == {1: ["r1", "a"], 0: ["1_n"]}
    lost = balancer.replica_died(1)
    assert sorted(lost) == ["b", "r3"]
    assert [balancer.route([f"x{i}"]) for i in range(3)] == [0, 0, 0]
    balancer.replica_died(0)
    assert balancer.route(["late"]) is None


def test_balancer_takes_turns_between_idle_replicas():
    """Requests one at a time, each finished before the next: every arrival finds both
    replicas idle, and they take turns (the lowest index took every one before)."""
    balancer = DataParallelBalancer(3)
    chosen = []
    for i in range(7):
        index = balancer.route([f"r{i}"])
        chosen.append(index)
        balancer.observe(
            EngineCoreOutputs(
                outputs=[EngineCoreOutput(f"r{i}", [1], finish_reason=FinishReason.STOP)],
                scheduler_stats=SchedulerStats(num_requests_received=chosen.count(index)),
                engine_index=index,
            )
        )
        assert balancer.loads == [0, 0, 0]
    assert chosen == [0, 1, 2, 0, 1, 2, 0]
    balancer.replica_died(1)
    assert [balancer.route([f"x{i}"]) for i in range(2)] == [2, 0]


def test_combined_stats_sum_counts_and_keep_each_replica():
    one = {
        "num_running_reqs": 2, "num_waiting_reqs": 1, "num_free_blocks": 200,
        "num_preemptions": 0, "compiles_after_warmup": 0, "num_requests_added": 10,
        "num_blocks": 256, "kv_cache_usage": 0.2, "attention_impl": "cpu",
        "spec_decode_drafts": 0, "spec_decode_draft_tokens": 0, "spec_decode_accepted_tokens": 0,
    }  # fmt: skip
    two = {**one, "num_running_reqs": 3, "num_free_blocks": 100, "kv_cache_usage": 0.6}
    stats = combine_stats([one, two], [0, 2])  # replica 1 died
    assert stats["num_running_reqs"] == 5 and stats["num_free_blocks"] == 300
    assert stats["num_blocks"] - 1 == 2 * 255  # usable blocks, one null block each
    assert stats["kv_cache_usage"] == pytest.approx(0.4)
    assert stats["replicas"] == [{**one, "index": 0}, {**two, "index": 2}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_model_dp")))


def test_llm_data_parallel_matches_one_engine(tiny_model):
    prompts = [f"Prompt number {i} of the batch" for i in range(16)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, n=1 + i % 2) for i in range(16)]
    expected = LLM(tiny_model, **ENGINE_ARGS).generate(prompts, params, use_tqdm=False)

    llm = LLM(tiny_model, data_parallel_size=2, **ENGINE_ARGS)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outputs] == [
            [c.token_ids for c in o.outputs] for o in expected
        ]
        client = llm.llm_engine.client
        stats = client.call_utility("get_stats")
        added = [replica["num_requests_added"] for replica in stats["replicas"]]
        assert sum(added) == 24 and min(added) >= 8, added  # 16 prompts, 8 with n = 2
        assert stats["num_free_blocks"] == 2 * (ENGINE_ARGS["num_gpu_blocks_override"] - 1)
        assert stats["compiles_after_warmup"] == 0
        assert llm.reset_prefix_cache()
        with pytest.raises(ValueError, match="data_parallel_size 1"):
            llm.update_weights({})

        # One replica dies: the run fails clearly; the other replica still answers.
        engine = llm.llm_engine
        for i in range(4):
            engine.add_request(f"long{i}", "Hello", SamplingParams(max_tokens=100, ignore_eos=True))
        engine.step()
        os.kill(client.engine_pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="replica 1"):
            while engine.has_unfinished_requests():
                engine.step()
        assert client.call_utility("has_unfinished_requests") in (True, False)
        assert not client.engine_dead
    finally:
        llm.shutdown()


def test_data_parallel_needs_a_checkpoint(tiny_model):
    with pytest.raises(ValueError, match="not a module or params"):
        LLM(tiny_model, params={}, data_parallel_size=2, **ENGINE_ARGS)


def test_a_script_that_never_shuts_down_exits(tiny_model, tmp_path):
    """`LLM(data_parallel_size=2)` in a script with no shutdown() (vLLM's needs none): it
    exits once done (it hung at exit: multiprocessing joined engines that ignored the
    SIGTERM it sent them while their parent lived)."""
    script = tmp_path / "script.py"
    script.write_text(
        "from jengine import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({tiny_model!r}, data_parallel_size=2, warmup=False, **{ENGINE_ARGS!r})\n"
        "    llm.generate(['Hello'], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "    print('done', flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
