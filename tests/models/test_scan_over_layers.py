"""Layers are stacked and scanned: the compiled program does not grow with depth, and
the KV cache is updated in place (donated), not copied."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jengine.models import AttentionMetadata, LlamaConfig, LlamaForCausalLM
from jengine.models.rope_config import RopeConfig

CONFIG = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope=RopeConfig(head_dim=16),
)


def _compiled_text(num_layers: int) -> str:
    model = LlamaForCausalLM(dataclasses.replace(CONFIG, num_hidden_layers=num_layers))
    graphdef, state = nnx.split(model)
    T, bs = 8, 4
    kv = jnp.zeros(model.kv_cache_shape(9, bs))
    meta = AttentionMetadata(
        slot_mapping=jnp.arange(T, dtype=jnp.int32) + bs,
        kv_lens=jnp.array([4, 4], jnp.int32),
        block_tables=jnp.array([[1, 0, 0, 0], [2, 0, 0, 0]], jnp.int32),
        query_start_loc=jnp.array([0, 4, 8], jnp.int32),
    )

    def forward(state, kv, ids, pos, meta):
        return nnx.merge(graphdef, state)(ids, pos, kv, meta)

    ids = jnp.zeros(T, jnp.int32)
    lowered = jax.jit(forward, donate_argnums=1).lower(state, kv, ids, ids, meta)
    return lowered.compile().as_text()


def test_program_size_independent_of_depth():
    shallow, deep = _compiled_text(2), _compiled_text(16)
    # Only constants such as the trip count and the stacked shapes differ.
    assert abs(len(deep) - len(shallow)) < 0.02 * len(shallow)
    assert "while" in deep


def test_kv_cache_is_donated_and_aliased():
    text = _compiled_text(2)
    # The cache parameter is aliased to the cache output: updated in place.
    assert "input_output_alias" in text
