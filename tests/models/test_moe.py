"""The mixture-of-experts block (`models/moe.py`) against its dense per-expert loop: the
grouped matmuls (many tokens) and the gathered experts (a decode step's few) give the
loop's values for 1 to 64 tokens, with and without a shared expert, renormalised or not;
the parts a device computes for its own experts (expert parallelism) add up to the whole."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jengine.models.decoder import DecoderConfig
from jengine.models.moe import (
    dense_moe_mlp,
    experts_impl,
    gathered_experts,
    grouped_experts,
    looped_experts,
    moe_mlp,
    route,
)
from jengine.models.rope_config import RopeConfig

D, F, E, LAYERS = 64, 48, 6, 3


def _config(shared: int = 0, normalize: bool = True, top_k: int = 2) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=32,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope=RopeConfig(16),
        num_experts=E,
        num_experts_per_tok=top_k,
        moe_intermediate_size=F,
        norm_topk_prob=normalize,
        shared_expert_intermediate_size=shared,
    )


def _weights(config, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {
        "router": (E, D),
        "expert_gate": (E, F, D),
        "expert_up": (E, F, D),
        "expert_down": (E, D, F),
    }
    if config.shared_expert_intermediate_size:
        S = config.shared_expert_intermediate_size
        shapes |= {
            "shared_gate_proj": (S, D),
            "shared_up_proj": (S, D),
            "shared_down_proj": (D, S),
            "shared_expert_gate": (1, D),
        }
    return {
        name: jnp.asarray(rng.standard_normal((LAYERS, *shape)) * 0.2, jnp.float32)
        for name, shape in shapes.items()
    }


@pytest.mark.parametrize("tokens", [1, 17, 64])
@pytest.mark.parametrize("shared, normalize, top_k", [(0, True, 2), (40, False, 2), (0, False, 3)])
def test_the_block_equals_the_dense_loop(tokens, shared, normalize, top_k):
    config = _config(shared, normalize, top_k)
    stacked = _weights(config)
    x = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, D)), jnp.float32)
    layer = 1
    ours = jax.jit(lambda x, p, layer: moe_mlp(x, p, config, layer))(x, stacked, layer)
    dense = dense_moe_mlp(x, {k: v[layer] for k, v in stacked.items()}, config)
    np.testing.assert_allclose(ours, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_the_three_ways_agree(tokens):
    """Grouped matmuls, looped experts and gathered experts on the same routing (the
    block picks one by batch and backend: each is checked here on every batch)."""
    config = _config()
    stacked = _weights(config)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((tokens, D)), jnp.float32)
    weights, experts = route(x, stacked["router"][2], 2, True)
    experts_at = (stacked["expert_gate"], stacked["expert_up"], stacked["expert_down"])
    routed = (x, weights, experts)
    gathered = gathered_experts(*routed, *experts_at, 2, activation="silu")
    looped = looped_experts(*routed, *experts_at, 2, activation="silu")
    grouped = grouped_experts(*routed, *(w[2] for w in experts_at), activation="silu")
    np.testing.assert_allclose(gathered, grouped, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(looped, grouped, rtol=1e-5, atol=1e-5)


def test_the_way_each_batch_takes():
    assert experts_impl(2, 64, "cpu") == "gathered"  # a decode step of a many-expert model
    assert experts_impl(2, 8, "cpu") == "looped"
    assert experts_impl(128, 8, "gpu") == "grouped"


@pytest.mark.parametrize("tokens", [1, 64])
def test_each_devices_own_experts_add_up_to_the_whole(tokens):
    """Expert parallelism's arithmetic without devices: three 'devices' of two experts
    each compute only their own experts' share; the shares sum to the block."""
    config = _config()
    stacked = _weights(config)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((tokens, D)), jnp.float32)
    whole = moe_mlp(x, stacked, config, 0)
    parts = []
    for device in range(3):
        own = {
            k: v if k == "router" else v[:, 2 * device : 2 * device + 2] for k, v in stacked.items()
        }
        parts.append(moe_mlp(x, own, config, 0, expert_offset=2 * device))
    np.testing.assert_allclose(sum(parts), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [3, 64])  # gathered, grouped
def test_an_expert_no_token_chose_changes_nothing(tokens):
    """The router favours experts 0 and 1 for every token (a constant feature they weigh
    heavily): expert 5's weights, blown up, never reach the output."""
    config = dataclasses.replace(_config(), num_experts_per_tok=1)
    stacked = _weights(config)
    stacked["router"] = stacked["router"].at[:, :2, 0].set(50.0)
    x = np.random.default_rng(2).standard_normal((tokens, D)).astype(np.float32)
    x[:, 0] = 1.0
    _, experts = route(jnp.asarray(x), stacked["router"][0], 1, True)
    assert set(np.asarray(experts).ravel()) <= {0, 1}
    poisoned = dict(stacked)
    poisoned["expert_up"] = stacked["expert_up"].at[0, 5].set(1e9)
    np.testing.assert_array_equal(
        moe_mlp(jnp.asarray(x), poisoned, config, 0), moe_mlp(jnp.asarray(x), stacked, config, 0)
    )
