"""Logits of every supported family equal transformers' on random-weight checkpoints (f32).

A ragged batch mixes prompt chunks and single-token decodes of several requests, each at
its own position, over shuffled pages of a NaN-filled cache; the same sequence fed in one
chunk and in several chunks gives the same logits.
"""

import numpy as np
import pytest

from jengine.models import load_model
from tests.models.checkpoints import FAMILIES, VOCAB, hf_logits, make_checkpoint
from tests.models.paged_batch import PagedSequences

ATOL = 1e-4


def _sequences(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in lengths]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = make_checkpoint(request.param, str(path))
    return request.param, hf_model, load_model(str(path), dtype="float32")


def test_ragged_mixed_batch_matches_transformers(family_checkpoint):
    _check_ragged_mixed_batch(family_checkpoint, q_block_size=4)


# Query blocks of one token run the same kernels for every family: a plain family and a
# windowed, soft-capped one keep that case (a compile each, cold).
@pytest.mark.parametrize("family_checkpoint", ["llama3", "gemma2"], indirect=True)
def test_ragged_mixed_batch_in_one_token_query_blocks(family_checkpoint):
    _check_ragged_mixed_batch(family_checkpoint, q_block_size=1)


def _check_ragged_mixed_batch(family_checkpoint, q_block_size: int):
    _, hf_model, model = family_checkpoint
    seqs = _sequences(1, [13, 9, 20, 6])
    paged = PagedSequences(model, seqs, block_size=4)
    got = {i: [] for i in range(len(seqs))}
    schedule = [
        {0: 5, 1: 9, 2: 7},  # chunks of 0 and 2, all of 1
        {1: 0, 0: 8, 3: 6, 2: 1},  # rest of 0, all of 3, a one-token chunk of 2
        {2: 12, 3: 0},
    ]
    for chunks in schedule:
        chunks = {i: n for i, n in chunks.items() if n}
        for i, logits in paged.step(chunks, q_block_size=q_block_size).items():
            got[i].append(logits)
    # Decodes: every request takes single tokens while another still prefills.
    longer = [s + _sequences(i + 7, [3])[0] for i, s in enumerate(seqs)]
    paged.sequences = longer
    for _ in range(3):
        for i, logits in paged.step(
            {i: 1 for i in range(len(seqs))}, q_block_size=q_block_size
        ).items():
            got[i].append(logits)
    for i, seq in enumerate(longer):
        expected = hf_logits(hf_model, seq).numpy()
        np.testing.assert_allclose(np.concatenate(got[i]), expected, atol=ATOL, rtol=0)


def test_chunked_equals_one_shot(family_checkpoint):
    _, _, model = family_checkpoint
    seq = _sequences(3, [23])
    whole = PagedSequences(model, seq, block_size=8).step({0: 23})[0]
    paged = PagedSequences(model, seq, block_size=8, seed=5)
    chunks = np.concatenate([paged.step({0: n})[0] for n in (7, 1, 9, 6)])
    np.testing.assert_allclose(chunks, whole, atol=ATOL, rtol=0)


def test_greedy_argmax_identical(family_checkpoint):
    _, hf_model, model = family_checkpoint
    seq = _sequences(4, [11])[0]
    logits = PagedSequences(model, [seq]).step({0: 11})[0]
    assert (logits.argmax(-1) == hf_logits(hf_model, seq).numpy().argmax(-1)).all()
