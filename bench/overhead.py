"""Host overhead per engine step: what the Python host spends around the device step
(schedule, input preparation, output conversion, scheduler update, output processing) at
1, 64 and 256 running requests, with the device step replaced by a no-op.

Where it sits: the same objects the engine uses — `Scheduler`, the runner's `InputBatch`
and its output conversion, `OutputProcessor` with the benchmark model's tokenizer (when
the folder has one) — driven by the loop `EngineCore.step` + `LLMEngine.step` run. Only
the jitted model and sampler are replaced: every request "samples" a fixed token. Each
request has a 128-token prompt and never finishes while the steps are timed; timing
starts once every request is decoding.

Then, with `--device` (on by default), the real engine on the benchmark model: the
median engine step while N requests decode, with async scheduling and without (and two
parts of it: the runner queueing a step, and waiting for a step's tokens), beside the
device time of the same decode step (its programs run back to back, inputs prepared, each
step waited for; and, as a device never idle would run them, ten calls queued before
one wait). With async scheduling the host's work overlaps the device's, so the step
should come close to the device time. The two engines and the device timing take turns
for `--rounds` rounds per N, and each figure is the median over rounds (every round's
kept): this VM's speed drifts by 15-25% within minutes, and one run of each in a row read
async - device anywhere from -1.6 to +16.9 ms at 256 running.

    jengine bench overhead [--num-running 1,64,256] [--steps 200] [--rounds 3] [--no-device]
"""

import argparse
import statistics
import time

import numpy as np

from jengine.config import CacheConfig, SchedulerConfig
from jengine.core.outputs import ModelRunnerOutput
from jengine.core.scheduler import Scheduler
from jengine.engine.output_processor import OutputProcessor
from jengine.protocol import EngineCoreRequest
from jengine.request import Request
from jengine.runner.buckets import BucketSpec
from jengine.runner.input_batch import InputBatch
from jengine.runner.step import SampleOutputs
from jengine.runner.step_outputs import InFlightStep, collected_output
from jengine.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams

from .common import add_common_args, count, package_versions, print_header, write_result
from .workloads import make_bench_model

PROMPT_LEN = 128
BLOCK_SIZE = 16
SAMPLED_TOKEN = 1000


class NoOpRunner:
    """The runner's host side with the device step replaced by a constant sample."""

    def __init__(self, buckets: BucketSpec):
        self.input_batch = InputBatch(buckets, BLOCK_SIZE)

    def execute(self, scheduler_output) -> ModelRunnerOutput:
        self.input_batch.update(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        prepared = self.input_batch.prepare(scheduler_output)
        self.input_batch.mark_sampling(prepared)
        rows = prepared.num_sample_rows
        sampled = SampleOutputs(
            sampled=np.full(rows, SAMPLED_TOKEN, np.int32),
            logprob_ids=np.zeros((rows, MAX_LOGPROBS + 1), np.int32),
            logprobs=np.zeros((rows, MAX_LOGPROBS + 1), np.float32),
            ranks=np.zeros(rows, np.int32),
        )
        # The real runner's conversion of device outputs into a ModelRunnerOutput.
        step = InFlightStep(prepared, sampled, None, None, self.input_batch.num_removals)
        return collected_output(step, self.input_batch)


def step_times(num_running: int, steps: int, tokenizer) -> dict:
    max_model_len = PROMPT_LEN + steps + 64
    scheduler_config = SchedulerConfig(
        max_num_seqs=num_running,
        max_num_batched_tokens=max(2048, num_running),
        max_model_len=max_model_len,
    )
    pages = -(-max_model_len // BLOCK_SIZE)
    scheduler = Scheduler(
        scheduler_config, CacheConfig(block_size=BLOCK_SIZE), num_running * pages + 1
    )
    runner = NoOpRunner(
        BucketSpec.create(num_running, max(2048, num_running), max_model_len, BLOCK_SIZE)
    )
    output_processor = OutputProcessor(tokenizer)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=max_model_len, ignore_eos=True)
    for index in range(num_running):
        prompt = rng.integers(100, 31000, size=PROMPT_LEN).tolist()
        request = EngineCoreRequest(str(index), prompt, params)
        # The engine core knows it by the id of this registration.
        [sequence] = output_processor.add_request(request, None, RequestOutputKind.DELTA)
        scheduler.add_request(Request(sequence.request_id, prompt, params))

    parts = {"schedule": [], "runner": [], "update": [], "output_processing": []}
    decoding = False
    while len(parts["schedule"]) < steps:
        t0 = time.perf_counter()
        scheduler_output = scheduler.schedule()
        t1 = time.perf_counter()
        runner_output = runner.execute(scheduler_output)
        t2 = time.perf_counter()
        engine_outputs = scheduler.update_from_output(scheduler_output, runner_output)
        t3 = time.perf_counter()
        output_processor.process_outputs(engine_outputs.outputs)
        t4 = time.perf_counter()
        # Time steady decoding only: every request running, one token each.
        if decoding:
            for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                parts[name].append(seconds)
        decoding = scheduler_output.total_num_scheduled_tokens == num_running
    # What was timed processed every request's tokens (none is dropped as unknown).
    taken = [len(state.output_token_ids) for state in output_processor.request_states.values()]
    if len(taken) != num_running or min(taken) == 0:
        raise RuntimeError("the output processor took no tokens of some requests")
    totals = [sum(step) for step in zip(*parts.values(), strict=True)]
    return dict(
        num_running=num_running,
        steps=steps,
        median_ms=1000 * statistics.median(totals),
        mean_ms=1000 * statistics.fmean(totals),
        parts_median_ms={name: 1000 * statistics.median(t) for name, t in parts.items()},
    )


def _recording(prepare, into: list):
    """`prepare` that also keeps each step it prepares in `into`."""

    def recording(scheduler_output):
        into.append(prepare(scheduler_output))
        return into[-1]

    return recording


def device_step_times(
    model_dir: str, num_running: list[int], steps: int, rounds: int, dtype: str = "float32"
) -> list[dict]:
    """Median engine step (steady decoding) per mode, and the device time of such a step:
    one of the steps the engine ran, prepared again and run alone, waited for; the modes
    and the device timing in turns, `rounds` times per N."""
    from jengine import LLM

    engines = {
        mode: LLM(
            model_dir,
            dtype=dtype,
            max_model_len=PROMPT_LEN + steps + 64,
            max_num_seqs=max(num_running),
            kv_cache_memory_bytes=4 << 30,  # every request's whole length: no preemption
            async_scheduling=mode == "async",
        )
        for mode in ("async", "sync")
    }
    rng = np.random.default_rng(0)
    results = []
    for n in num_running:
        by_round = []
        for round_index in range(max(1, rounds)):
            row = {}
            for mode, llm in engines.items():
                times, prepared = _decode(llm, n, steps, rng, f"{n}-{round_index}")
                for part, seconds in times.items():
                    # Steady decoding: past the prefills, before the requests end.
                    row[f"{mode}_{part}_ms"] = 1000 * statistics.median(seconds[-steps // 2 : -5])
                if mode == "sync":
                    # A decode step from the middle (its blocks are free now: rewriting
                    # them harms nothing).
                    runner = llm.engine_core.runner
                    step = prepared[-steps // 4]
                    row["device_ms"] = _device_ms(runner, step)
                    row["device_back_to_back_ms"] = _back_to_back_ms(runner, step)
            row["async_minus_device_ms"] = row["async_step_ms"] - row["device_ms"]
            by_round.append(row)
        medians = {key: statistics.median(r[key] for r in by_round) for key in by_round[0]}
        results.append(dict(num_running=n, **medians, rounds=by_round))
    return results


def _decode(llm, n: int, steps: int, rng, prefix: str) -> tuple[dict[str, list[float]], list]:
    """n requests with random prompts decoding `steps` tokens: each engine step's time
    ("step") and two parts of it, the runner queueing a step's programs ("dispatch") and
    waiting for a step's sampled tokens ("collect"); and every step the runner prepared."""
    engine, runner = llm.llm_engine, llm.engine_core.runner
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for index in range(n):
        prompt = rng.integers(100, 31000, size=PROMPT_LEN).tolist()
        # DELTA, as the host loop above and a streaming server ask: CUMULATIVE would add
        # rebuilding every request's whole output each step (~2 ms a step at 256 running).
        engine.add_request(
            f"{prefix}-{index}",
            {"prompt_token_ids": prompt},
            params,
            output_kind=RequestOutputKind.DELTA,
        )
    times = {"step": [], "dispatch": [], "collect": []}
    prepared = []
    prepare = runner.input_batch.prepare
    runner.input_batch.prepare = _recording(prepare, prepared)
    runner.dispatch = _timed(runner.dispatch, times["dispatch"])
    runner.collect = _timed(runner.collect, times["collect"])
    try:
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            times["step"].append(time.perf_counter() - started)
    finally:
        runner.input_batch.prepare = prepare
        del runner.dispatch, runner.collect  # the class's methods again
    return times, prepared


def _timed(method, into: list):
    """`method` that also appends each call's duration to `into`."""

    def timed(*args):
        started = time.perf_counter()
        result = method(*args)
        into.append(time.perf_counter() - started)
        return result

    return timed


def _device_ms(runner, step) -> float:
    """The median time of `step`'s programs run alone, each run waited for."""
    import jax

    device = []
    for _ in range(20):
        jax.block_until_ready((runner.kv_cache, runner.sampling_state))
        started = time.perf_counter()
        jax.block_until_ready(runner._run(step))
        device.append(time.perf_counter() - started)
    return 1000 * statistics.median(device[5:])


def _back_to_back_ms(runner, step, calls: int = 10) -> float:
    """`step`'s programs called `calls` times without waiting, then waited for: the time
    per step of a device that is never idle. On a GPU it is below `_device_ms`, which also
    counts launching each run while the device waits (~2 ms for the 1.1B model's layer
    scan on an H100)."""
    import jax

    jax.block_until_ready((runner.kv_cache, runner.sampling_state))
    started = time.perf_counter()
    for _ in range(calls):
        outputs = runner._run(step)
    jax.block_until_ready(outputs)
    return 1000 * (time.perf_counter() - started) / calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="jengine bench overhead", description=__doc__.split("\n\n")[0]
    )
    add_common_args(parser, "overhead")
    parser.add_argument("--num-running", default="1,64,256")
    parser.add_argument("--steps", type=count, default=200)
    parser.add_argument("--device", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--rounds", type=count, default=3, help="turns of the real-engine modes")
    args = parser.parse_args(argv)

    versions = package_versions("transformers")
    print_header("overhead", args, versions)
    from jengine.engine.tokenizer import load_tokenizer_from

    tokenizer = load_tokenizer_from(make_bench_model(args.model_dir))
    results = []
    for num_running in (int(n) for n in args.num_running.split(",")):
        result = step_times(num_running, args.steps, tokenizer)
        results.append(result)
        parts = ", ".join(f"{k} {v:.3f}" for k, v in result["parts_median_ms"].items())
        print(
            f"{num_running:4d} running: {result['median_ms']:.3f} ms per step "
            f"(median; mean {result['mean_ms']:.3f}): {parts}"
        )
    device = []
    if args.device:
        counts = [int(n) for n in args.num_running.split(",")]
        model = make_bench_model(args.model_dir)
        device = device_step_times(model, counts, args.steps, args.rounds)
        for row in device:
            by_round = ", ".join(f"{r['async_minus_device_ms']:+.3f}" for r in row["rounds"])
            print(
                f"{row['num_running']:4d} running, real engine (median of {len(row['rounds'])} "
                f"rounds): step {row['async_step_ms']:.3f} ms async / {row['sync_step_ms']:.3f} "
                f"ms sync; device {row['device_ms']:.3f} ms, back to back "
                f"{row['device_back_to_back_ms']:.3f} ms (async - device = "
                f"{row['async_minus_device_ms']:+.3f} ms; by round {by_round}); of a step, "
                f"dispatch {row['async_dispatch_ms']:.3f} / {row['sync_dispatch_ms']:.3f} ms, "
                f"waiting for the tokens {row['async_collect_ms']:.3f} / "
                f"{row['sync_collect_ms']:.3f} ms"
            )
    write_result(
        "overhead",
        args,
        versions,
        dict(
            detokenized=tokenizer is not None,
            prompt_len=PROMPT_LEN,
            results=results,
            device=device,
        ),
    )


if __name__ == "__main__":
    main()
