"""InputBatch follows hand-built SchedulerOutputs and pads them into bucket-shaped arrays.

Every case uses block_size 4 and max_model_len 64 (16 pages a request, page buckets 8 and
16), max_num_seqs 4 and max_num_batched_tokens 32 (token buckets 16 and 32), so the
expected arrays below are small enough to check by hand.
"""

import numpy as np
import pytest

from jengine.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jengine.runner.buckets import BucketSpec, StepShape
from jengine.runner.input_batch import InputBatch
from jengine.sampling_params import SamplingParams

BLOCK_SIZE = 4
GREEDY = dict(temperature=0.0, max_tokens=8)


@pytest.fixture
def batch():
    spec = BucketSpec.create(
        max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=BLOCK_SIZE
    )
    return InputBatch(spec, BLOCK_SIZE, seed=0)


def new_req(req_id, prompt, block_ids, computed=0, outputs=(), **params):
    return NewRequestData(
        req_id,
        list(prompt),
        SamplingParams(**{**GREEDY, **params}),
        list(block_ids),
        computed,
        output_token_ids=list(outputs),
    )


def step(new=(), cached=(), tokens=None, removed=()):
    tokens = tokens or {}
    return SchedulerOutput(list(new), list(cached), tokens, sum(tokens.values()), set(removed))


def run(batch, scheduler_output):
    batch.update(scheduler_output)
    return batch.prepare(scheduler_output)


def test_prefill_of_two_requests_is_padded_to_a_bucket(batch):
    prepared = run(
        batch,
        step(
            new=[new_req("a", range(11, 17), [3, 7]), new_req("b", [21, 22, 23], [5])],
            tokens={"a": 6, "b": 3},
        ),
    )
    # 9 tokens of 2 requests with 2 pages at most -> the (16, 4, 8, 16) prefill shape.
    assert prepared.shape == StepShape(16, 4, 8, 16)
    assert prepared.req_ids == ["a", "b"]
    np.testing.assert_array_equal(
        prepared.input_ids, [11, 12, 13, 14, 15, 16, 21, 22, 23] + [0] * 7
    )
    np.testing.assert_array_equal(prepared.positions, [0, 1, 2, 3, 4, 5, 0, 1, 2] + [0] * 7)
    # slot = block * block_size + offset: a's positions 0-3 in block 3, 4-5 in block 7;
    # b's in block 5; the 7 padding tokens write into the null page 0.
    np.testing.assert_array_equal(
        prepared.slot_mapping, [12, 13, 14, 15, 28, 29, 20, 21, 22] + [0] * 7
    )
    np.testing.assert_array_equal(prepared.query_start_loc, [0, 6, 9, 9, 9])
    # Padding requests: q_len 0 (repeated query_start_loc) and kv_len 0.
    np.testing.assert_array_equal(prepared.kv_lens, [6, 3, 0, 0])
    expected_tables = np.zeros((4, 8), np.int32)
    expected_tables[0, :2] = [3, 7]
    expected_tables[1, 0] = 5
    np.testing.assert_array_equal(prepared.block_tables, expected_tables)
    # The head and the sampler run over the 2 sampling rows only (their own bucket).
    np.testing.assert_array_equal(prepared.logits_indices, [5, 8])
    np.testing.assert_array_equal(prepared.sample_mask, [True, True])
    assert prepared.prompt_targets is None and prepared.prompt_logprob_rows == {}
    np.testing.assert_array_equal(prepared.sampling["slots"][:2], [0, 1])


def test_chunked_prefill_samples_only_when_the_chunk_reaches_the_end(batch):
    prompt = list(range(100, 110))  # 10 tokens over blocks 9, 2, 6
    first = run(batch, step(new=[new_req("a", prompt, [9, 2, 6])], tokens={"a": 4}))
    assert first.shape == StepShape(16, 4, 8, 16)
    np.testing.assert_array_equal(first.input_ids[:4], prompt[:4])
    np.testing.assert_array_equal(first.sample_mask, [False])  # S = 1 row
    assert first.kv_lens[0] == 4

    second = run(batch, step(cached=[CachedRequestData("a", [], 4)], tokens={"a": 6}))
    np.testing.assert_array_equal(second.input_ids[:6], prompt[4:])
    np.testing.assert_array_equal(second.positions[:6], [4, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(second.slot_mapping[:6], [8, 9, 10, 11, 24, 25])
    np.testing.assert_array_equal(second.query_start_loc, [0, 6, 6, 6, 6])
    assert second.kv_lens[0] == 10
    np.testing.assert_array_equal(second.sample_mask, [True])
    np.testing.assert_array_equal(second.logits_indices, [5])


def test_decode_step_uses_the_sampled_token_and_new_blocks(batch):
    run(
        batch,
        step(
            new=[new_req("a", [1, 2, 3, 4], [3]), new_req("b", [5, 6], [8])],
            tokens={"a": 4, "b": 2},
        ),
    )
    batch.record_sampled(["a", "b"], [[40], [50]])
    prepared = run(
        batch,
        step(
            cached=[CachedRequestData("a", [11], 4), CachedRequestData("b", [], 2)],
            tokens={"a": 1, "b": 1},
        ),
    )
    # Decode-only: T = R = 2, one token per query block.
    assert prepared.shape == StepShape(2, 2, 8, 1)
    np.testing.assert_array_equal(prepared.input_ids, [40, 50])
    np.testing.assert_array_equal(prepared.positions, [4, 2])
    # a's position 4 is the first slot of its new block 11.
    np.testing.assert_array_equal(prepared.slot_mapping, [44, 34])
    np.testing.assert_array_equal(prepared.kv_lens, [5, 3])
    np.testing.assert_array_equal(prepared.block_tables[:, :2], [[3, 11], [8, 0]])
    np.testing.assert_array_equal(prepared.sample_mask, [True, True])
    np.testing.assert_array_equal(prepared.sampling["output_index"], [1, 1])


def test_block_table_is_truncated_to_the_bucket_width(batch):
    blocks = list(range(20, 30))  # 10 blocks, more than the 8-page bucket holds
    prepared = run(batch, step(new=[new_req("a", [1, 2, 3, 4, 5], blocks)], tokens={"a": 5}))
    assert prepared.shape.num_pages == 8
    np.testing.assert_array_equal(prepared.block_tables[0], blocks[:8])
    np.testing.assert_array_equal(prepared.slot_mapping[:5], [80, 81, 82, 83, 84])


def test_resumed_request_runs_prompt_and_earlier_outputs(batch):
    prepared = run(
        batch,
        step(new=[new_req("a", [1, 2, 3], [4, 6], outputs=[7, 8])], tokens={"a": 5}),
    )
    np.testing.assert_array_equal(prepared.input_ids[:5], [1, 2, 3, 7, 8])
    np.testing.assert_array_equal(prepared.slot_mapping[:5], [16, 17, 18, 19, 24])
    assert prepared.sample_mask[0]
    assert prepared.sampling["output_index"][0] == 2
    assert batch.requests["a"].num_prompt_tokens == 3


def test_prefix_hit_runs_only_the_uncached_tokens(batch):
    prompt = list(range(30, 38))  # 8 tokens; the first block (4 tokens) is cached
    prepared = run(batch, step(new=[new_req("a", prompt, [2, 3], computed=4)], tokens={"a": 4}))
    np.testing.assert_array_equal(prepared.input_ids[:4], prompt[4:])
    np.testing.assert_array_equal(prepared.positions[:4], [4, 5, 6, 7])
    np.testing.assert_array_equal(prepared.slot_mapping[:4], [12, 13, 14, 15])
    assert prepared.kv_lens[0] == 8 and prepared.sample_mask[0]


def test_prompt_logprob_rows_and_targets(batch):
    prompt = [11, 12, 13, 14, 15, 16]
    first = run(
        batch,
        step(
            new=[new_req("b", [21, 22], [5]), new_req("a", prompt, [3, 7], prompt_logprobs=2)],
            tokens={"b": 2, "a": 4},
        ),
    )
    # a's tokens sit at rows 2..5; positions 0..3 predict prompt tokens 1..4.
    assert first.prompt_logprob_rows == {"a": (2, 6)}
    np.testing.assert_array_equal(first.prompt_targets, [0, 0, 12, 13, 14, 15] + [0] * 10)
    assert not first.sample_mask[1]  # a's chunk ends mid-prompt

    second = run(batch, step(cached=[CachedRequestData("a", [], 4)], tokens={"a": 2}))
    # Position 4 predicts the last prompt token; position 5 predicts an output: no target.
    assert second.prompt_logprob_rows == {"a": (0, 1)}
    np.testing.assert_array_equal(second.prompt_targets[:2], [16, 0])
    assert second.sample_mask[0]


def test_removed_requests_free_their_slots(batch):
    run(
        batch,
        step(new=[new_req("a", [1, 2], [1]), new_req("b", [3, 4], [2])], tokens={"a": 2, "b": 2}),
    )
    assert (batch.requests["a"].slot, batch.requests["b"].slot) == (0, 1)
    # "ghost" was never seen by the runner (e.g. aborted while waiting): ignored.
    prepared = run(
        batch,
        step(new=[new_req("c", [5, 6], [3])], tokens={"c": 2}, removed={"a", "ghost"}),
    )
    assert set(batch.requests) == {"b", "c"}
    assert batch.requests["c"].slot == 0  # a's slot, handed out again
    assert prepared.req_ids == ["c"]
    np.testing.assert_array_equal(prepared.sampling["slots"][:1], [0])
    assert sorted(batch.free_slots) == [2, 3]


def test_recorded_rows_feed_the_next_step_like_recorded_lists(batch):
    first = run(
        batch,
        step(
            new=[new_req("a", [1, 2, 3], [3]), new_req("b", range(10, 16), [8, 9])],
            tokens={"a": 3, "b": 4},  # b's chunk ends mid-prompt: nothing sampled
        ),
    )
    batch.mark_sampling(first)
    batch.record_sampled_rows(first, np.array([40, 50, 0, 0], np.int32), batch.num_removals)
    np.testing.assert_array_equal(batch.all_token_ids("a"), [1, 2, 3, 40])
    np.testing.assert_array_equal(batch.all_token_ids("b"), list(range(10, 16)))
    second = run(
        batch,
        step(
            cached=[CachedRequestData("a", [], 3), CachedRequestData("b", [], 4)],
            tokens={"a": 1, "b": 2},
        ),
    )
    np.testing.assert_array_equal(second.input_ids[:3], [40, 14, 15])
    np.testing.assert_array_equal(second.sample_mask[:2], [True, True])
    np.testing.assert_array_equal(second.sampling["output_index"][:2], [1, 0])


def test_a_pending_token_is_read_from_the_device_and_counted(batch):
    """Async scheduling: the next step is prepared before the last one's token is back.
    Its input position points at the slot's last sampled token on the device, its output
    index counts the token, and a request dropped before the token is back never gets
    it (its slot went to someone else)."""
    first = run(
        batch,
        step(
            new=[new_req("a", [1, 2, 3], [3]), new_req("b", [7, 8], [4])],
            tokens={"a": 3, "b": 2},
        ),
    )
    batch.mark_sampling(first)
    removals = batch.num_removals
    second = run(
        batch,
        step(
            cached=[CachedRequestData("a", [], 3), CachedRequestData("b", [], 2)],
            tokens={"a": 1, "b": 1},
        ),
    )
    slot_a, slot_b = batch.requests["a"].slot, batch.requests["b"].slot
    np.testing.assert_array_equal(second.from_slot[:2], [slot_a, slot_b])
    np.testing.assert_array_equal(second.positions[:2], [3, 2])
    np.testing.assert_array_equal(second.sample_mask[:2], [True, True])
    np.testing.assert_array_equal(second.sampling["output_index"][:2], [1, 1])
    batch.mark_sampling(second)
    # b ends and c takes its slot before the first step's tokens are collected.
    third = run(
        batch,
        step(
            new=[new_req("c", [5, 6, 7, 8, 9], [6, 7])],
            cached=[CachedRequestData("a", [], 4)],
            tokens={"a": 1, "c": 5},
            removed={"b"},
        ),
    )
    assert batch.requests["c"].slot == slot_b
    batch.record_sampled_rows(first, np.array([40, 50], np.int32), removals)
    np.testing.assert_array_equal(batch.all_token_ids("a"), [1, 2, 3, 40])
    np.testing.assert_array_equal(batch.all_token_ids("c"), [5, 6, 7, 8, 9])
    # a's second token is still pending: the third step reads it from the device.
    np.testing.assert_array_equal(third.from_slot[:6], [slot_a, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(third.sampling["output_index"][:2], [2, 0])


def test_same_order_after_a_membership_change_is_not_served_from_the_cache(batch):
    # "b" leaves and comes back (say, resumed after preemption, here with other params)
    # while the steps' request order stays ["a", "b"]: nothing cached may be reused.
    run(
        batch,
        step(new=[new_req("a", [1], [1]), new_req("b", [2], [2])], tokens={"a": 1, "b": 1}),
    )
    batch.record_sampled(["a", "b"], [[5], [6]])
    cached = [CachedRequestData("a", [], 1), CachedRequestData("b", [], 1)]
    decode = run(batch, step(cached=cached, tokens={"a": 1, "b": 1}))
    np.testing.assert_array_equal(decode.input_ids, [5, 6])
    batch.record_sampled(["a", "b"], [[7], [8]])
    prepared = run(
        batch,
        step(
            new=[new_req("b", [2, 6, 9], [4], temperature=0.5)],
            cached=[CachedRequestData("a", [], 2)],
            tokens={"a": 1, "b": 3},
            removed={"b"},
        ),
    )
    assert prepared.req_ids == ["a", "b"]
    np.testing.assert_array_equal(prepared.sampling["slots"][:2], [0, batch.requests["b"].slot])
    np.testing.assert_array_equal(prepared.sampling["temperature"][:2], [0.0, 0.5])
    np.testing.assert_array_equal(prepared.input_ids[:4], [7, 2, 6, 9])
    np.testing.assert_array_equal(prepared.slot_mapping[:4], [6, 16, 17, 18])
