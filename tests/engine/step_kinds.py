"""Which steps an engine schedules, counted: for the multi-step tests, in-process and in
the tensor-parallel subprocess (`tests/runner/tp_check.py`), which imports only this of the
engine tests' helpers (their transformers and torch take ~4 s to import)."""

from collections import Counter


def count_step_kinds(llm) -> Counter:
    """A Counter of the steps `llm` schedules from now on, by `num_decode_steps` (1: an
    ordinary step, K: a multi-step decode)."""
    scheduler = llm.engine_core.scheduler
    schedule, counts = scheduler.schedule, Counter()

    def counted():
        output = schedule()
        counts[output.num_decode_steps] += 1
        return output

    scheduler.schedule = counted
    return counts
