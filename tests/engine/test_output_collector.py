"""RequestOutputCollector: one pending item per request whatever the reader's pace; DELTA
outputs merge into it (texts, tokens, logprobs, newest finish state), other kinds replace
it, an error replaces anything and stays."""

import asyncio

from jengine.engine.output_collector import RequestOutputCollector
from jengine.outputs import CompletionOutput, Logprob, RequestOutput
from jengine.sampling_params import RequestOutputKind


def delta(step: int, index: int = 0, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(
        index,
        f"<{step}>",
        [step],
        cumulative_logprob=-float(step),
        logprobs=[{step: Logprob(-1.0, 1, f"<{step}>")}],
        finish_reason="length" if finished else None,
    )
    return RequestOutput("r", "p", [1], None, [completion], finished)


def test_unread_deltas_merge_into_one_pending_output():
    async def run():
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        for step in range(1000):  # a reader that never came: still one item
            collector.put(delta(step, index=step % 2, finished=step == 999))
        merged = await collector.get()
        assert collector._pending is None
        by_index = {c.index: c for c in merged.outputs}
        assert by_index[0].token_ids == list(range(0, 1000, 2))
        assert by_index[1].text == "".join(f"<{s}>" for s in range(1, 1000, 2))
        assert [next(iter(row)) for row in by_index[1].logprobs] == list(range(1, 1000, 2))
        assert by_index[1].finish_reason == "length" and by_index[0].finish_reason is None
        assert by_index[1].cumulative_logprob == -999.0 and merged.finished
        # Read as they come: each delta on its own.
        collector.put(delta(5))
        assert (await collector.get()).outputs[0].token_ids == [5]

    asyncio.run(run())


def test_cumulative_outputs_replace_and_errors_stay():
    async def run():
        collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
        collector.put(delta(1))
        collector.put(delta(2))
        assert (await collector.get()).outputs[0].token_ids == [2]
        error = RuntimeError("engine gone")
        collector.put(delta(3))
        collector.put(error)
        collector.put(delta(4))  # too late: the request already ended
        assert await collector.get() is error

    asyncio.run(run())
