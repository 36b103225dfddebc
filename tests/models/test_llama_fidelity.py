"""Logits of every supported family equal transformers' on random-weight checkpoints (f32).

A ragged batch mixes prompt chunks and single-token decodes of several requests, each at
its own position, over shuffled pages of a NaN-filled cache; the same sequence fed in one
chunk and in several chunks gives the same logits.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jengine.models import AttentionMetadata, load_model
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


# Scaled ropes on a family that reads them (each family's config takes the same dict):
# YaRN with transformers' defaults and with every knob set; LongRoPE (Phi-3.5's kind) with
# its short factors and attention factor, within its original length (the sequences here
# are at most 23 tokens); dynamic NTK within max_position_embeddings.
SCALED_ROPES = {
    "yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn-knobs": ("llama2", {
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "beta_fast": 16.0,
        "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False,
        "original_max_position_embeddings": 12,
    }),
    "longrope": ("phi3", {
        "rope_type": "longrope", "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [5.0, 7.0, 9.0, 11.0],
    }),
    "dynamic": ("llama2", {"rope_type": "dynamic", "factor": 2.0}),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(SCALED_ROPES))
def scaled_rope_checkpoint(request, tmp_path_factory):
    family, rope = SCALED_ROPES[request.param]
    overrides = {"rope_parameters": {"rope_theta": 10000.0, **rope}}
    if family == "phi3":
        overrides["original_max_position_embeddings"] = 32
    path = tmp_path_factory.mktemp(request.param)
    hf_model = make_checkpoint(family, str(path), config_overrides=overrides)
    return request.param, hf_model, load_model(str(path), dtype="float32")


def test_scaled_ropes_match_transformers(scaled_rope_checkpoint):
    _check_ragged_mixed_batch(scaled_rope_checkpoint, q_block_size=4)


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float32_models_ask_for_float32_matmuls(tmp_path, dtype):
    """jax runs float32 matmuls as TF32 on a GPU unless told otherwise (on an H100 a
    float32 engine's logprobs were 1.9e-3 off transformers'): every matmul of a float32
    model's forward and logits asks for HIGHEST precision; a bfloat16 model's keep the
    default. (Lowered with the XLA reference attention: on this CPU the layers' matmuls
    are kernels' custom calls, and what the test reads is the dots XLA would run.)"""
    make_checkpoint("llama3", str(tmp_path))
    graphdef, state = nnx.split(load_model(str(tmp_path), dtype=dtype))
    model = nnx.merge(graphdef, state)
    cache = jnp.zeros(model.kv_cache_shape(4, 4), model.dtype)
    metadata = AttentionMetadata(
        slot_mapping=jnp.arange(8, dtype=jnp.int32),
        kv_lens=jnp.asarray([8, 0], jnp.int32),
        block_tables=jnp.asarray([[1, 2], [0, 0]], jnp.int32),
        query_start_loc=jnp.asarray([0, 8, 8], jnp.int32),
        q_block_size=4,
    )

    def step(state, ids):
        model = nnx.merge(graphdef, state)
        hidden, _ = model(ids, ids, cache, metadata, attention_impl="reference")
        return model.compute_logits(hidden)

    text = jax.jit(step).lower(state, jnp.arange(8, dtype=jnp.int32)).as_text()
    dots = re.findall(r"stablehlo\.dot_general[^\n]*", text)
    assert dots
    highest = [d for d in dots if "precision = [HIGHEST, HIGHEST]" in d]
    assert len(highest) == (len(dots) if dtype == "float32" else 0), dots


def test_qwen2_moe_without_qkv_biases(tmp_path):
    """Qwen2-MoE's `qkv_bias=False` (its config's own switch; Qwen2's always has them)
    loads without the biases and equals transformers (it was refused as a checkpoint
    missing q/k/v biases)."""
    hf_model = make_checkpoint("qwen2-moe", str(tmp_path), config_overrides={"qkv_bias": False})
    model = load_model(str(tmp_path), dtype="float32")
    seq = _sequences(5, [17])[0]
    logits = PagedSequences(model, [seq]).step({0: 17})[0]
    np.testing.assert_allclose(logits, hf_logits(hf_model, seq).numpy(), atol=ATOL, rtol=0)


def test_gemma3_bidirectional_attention_is_refused(tmp_path):
    """EmbeddingGemma's bidirectional prompt attention cannot come from a causal KV cache:
    refused by name (it ran causally, other tokens than transformers' and no error)."""
    overrides = {"use_bidirectional_attention": True}
    make_checkpoint("gemma3", str(tmp_path), config_overrides=overrides)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        load_model(str(tmp_path), dtype="float32")
