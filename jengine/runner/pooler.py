"""The runner's pooling: each prompt's final hidden states -> one vector, across chunks.

Where it sits: in an embedding engine (`--runner pooling`, jengine/pooling.py) every
request is a prompt to pool. The forward step already returns the [T, D] final hidden
states of every scheduled token; `ModelRunner.collect` brings them to the host and hands
them here with the step's `PreparedStep`. `Pooler.pool` keeps each request's running
state between its prefill chunks and returns the vectors of the requests whose prompt the
step finished, which travel to the front end as float32 bytes (`EngineCoreOutput.pooled`).

Promises:
- LAST: the last prompt token's hidden state; MEAN: the mean over every prompt token
  (summed in float64); CLS: the first token's: as sentence-transformers pools the hidden
  states transformers returns;
- a chunk that starts at position 0 starts the request afresh (a preempted request
  recomputes from the start), and state of requests no longer in the batch (finished,
  aborted, preempted) is dropped, so nothing accumulates;
- MEAN and CLS need every prompt token computed here: their engines run without prefix
  caching (`EngineArgs.create_engine_config`); LAST needs only the last, which a prefix
  hit always leaves to compute.
- no program of its own: nothing to compile at warmup.
"""

from collections.abc import Container

import numpy as np

from jengine.runner.prepared_step import PreparedStep


def host_rows(hidden) -> np.ndarray:
    """A step's [T, D] hidden states on the host (one process's copy: they are
    replicated over a tensor-parallel mesh, which may span hosts)."""
    if not hidden.is_fully_addressable:
        hidden = hidden.addressable_data(0)
    return np.asarray(hidden)


class Pooler:
    def __init__(self, pooling_type: str):
        self.pooling_type = pooling_type
        # req_id -> MEAN: the float64 sum so far; CLS: the first token's hidden state.
        self._partial: dict[str, np.ndarray] = {}

    def pool(
        self, prepared: PreparedStep, hidden: np.ndarray, live: Container[str]
    ) -> dict[str, bytes]:
        """The pooled float32 vectors (as bytes) of the requests whose prompt this step
        finished. `hidden`: the step's [T, D] final hidden states on the host; `live`: the
        requests still in the batch."""
        finished = {}
        starts = prepared.query_start_loc
        done = prepared.sample_mask
        kind = self.pooling_type
        partial = self._partial
        for i, req_id in enumerate(prepared.req_ids):
            if req_id not in live:
                partial.pop(req_id, None)
                continue
            rows = hidden[starts[i] : starts[i + 1]]
            fresh = prepared.positions[starts[i]] == 0
            if kind == "LAST":
                vector = rows[-1] if done[i] else None
            elif kind == "CLS":
                first = rows[0] if fresh else partial[req_id]
                vector = first if done[i] else None
                if vector is None:
                    partial[req_id] = first
            else:  # MEAN
                total = rows.sum(axis=0, dtype=np.float64)
                if not fresh:
                    total += partial[req_id]
                num_tokens = int(prepared.kv_lens[i])
                vector = total / num_tokens if done[i] else None
                if vector is None:
                    partial[req_id] = total
            if vector is not None:
                partial.pop(req_id, None)
                finished[req_id] = np.asarray(vector, np.float32).tobytes()
        for req_id in [r for r in partial if r not in live]:  # gone since their last chunk
            del partial[req_id]
        return finished
