"""The mixture-of-experts feed-forward block: a router's top-k, then each token's experts
through one grouped matmul over the tokens sorted by expert (no capacity, nothing dropped).

Where it sits: `models/decoder.py` calls `moe_mlp` in place of the gated MLP in layers of
an MoE family (Mixtral, Qwen2-MoE, Qwen3-MoE: `models/mixtral.py`, `models/qwen_moe.py`),
with the layer's expert weights [E, F, D] / [E, D, F] ([out, in] per expert, as HF stores
them). Under a mesh it runs per device inside `shard_map` (`sharded_moe_mlp`): with expert
parallelism each device holds E / n whole experts and computes the tokens routed to them,
otherwise each expert's F features are split as a dense MLP's are (a shared expert's are
split so in both modes); either way the tokens are replicated and one all-reduce sums the
devices' parts.

Promises (transformers' numerics): router logits in the activations' dtype, softmax in
float32, top-k (renormalised over the k where the family says so: Mixtral always,
Qwen's `norm_topk_prob`), the expert outputs weighted and summed per token; Qwen2-MoE's
shared expert (a dense gated MLP scaled by sigmoid(its gate)) added. `dense_moe_mlp` is
the per-expert loop the grouped matmul is tested and timed against.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jengine.models.layers import ACTIVATIONS

_OUT_IN = jax.lax.RaggedDotDimensionNumbers(  # x [M, in] with w [G, out, in]: contract `in`
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def route(x: jax.Array, router: jax.Array, top_k: int, normalize: bool):
    """(weights [T, k] in x's dtype, experts [T, k] int32) of each token's top-k experts."""
    logits = x @ router.T  # [T, E]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts.astype(jnp.int32)


def grouped_experts(
    x, weights, experts, gate, up, down, *, activation: str, first_expert=0
) -> jax.Array:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) over the experts held here
    (`first_expert` .. + gate.shape[0]; assignments to others count 0): [T, D]."""
    num_tokens, top_k = experts.shape
    num_local = gate.shape[0]
    local = experts.reshape(-1) - first_expert  # [T * k]
    held = (local >= 0) & (local < num_local)
    key = jnp.where(held, local, num_local)  # assignments held elsewhere sort last
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    token = order // top_k
    rows = x[token]  # [T * k, D], grouped by expert
    # Rows past the held groups come back as zeros from each grouped matmul.
    g = jax.lax.ragged_dot_general(rows, gate, group_sizes, _OUT_IN)
    u = jax.lax.ragged_dot_general(rows, up, group_sizes, _OUT_IN)
    out = jax.lax.ragged_dot_general(ACTIVATIONS[activation](g) * u, down, group_sizes, _OUT_IN)
    scale = jnp.where(held, weights.reshape(-1), 0)[order]
    return jnp.zeros_like(x).at[token].add(out * scale[:, None])


def moe_mlp(x, p: dict, config, *, expert_offset=0, shard_axis: str | None = None):
    """The MoE block of one layer: `p` holds its `router`, `expert_gate`, `expert_up`,
    `expert_down` and, for a shared expert, `shared_gate_proj`, `shared_up_proj`,
    `shared_down_proj`, `shared_expert_gate`. With `shard_axis` (inside shard_map) the
    devices' partial sums are added up over it."""
    weights, experts = route(x, p["router"], config.num_experts_per_tok, config.norm_topk_prob)
    out = grouped_experts(
        x,
        weights,
        experts,
        p["expert_gate"],
        p["expert_up"],
        p["expert_down"],
        activation=config.hidden_act,
        first_expert=expert_offset,
    )
    if config.shared_expert_intermediate_size:
        act = ACTIVATIONS[config.hidden_act]
        shared = act(x @ p["shared_gate_proj"].T) * (x @ p["shared_up_proj"].T)
        shared = shared @ p["shared_down_proj"].T  # a part of it under a mesh
        out = out + jax.nn.sigmoid(x @ p["shared_expert_gate"].T) * shared
    if shard_axis is not None:
        out = jax.lax.psum(out, shard_axis)
    return out


def expert_specs(config, axis: str) -> dict:
    """How each MoE weight of one layer lies over the mesh axis (see the module docstring;
    `runner/sharding.py` places the stacked weights the same way)."""
    if config.expert_parallel:
        experts = dict.fromkeys(("expert_gate", "expert_up", "expert_down"), P(axis))
    else:
        experts = {
            "expert_gate": P(None, axis),
            "expert_up": P(None, axis),
            "expert_down": P(None, None, axis),
        }
    specs = {"router": P(), **experts}
    if config.shared_expert_intermediate_size:  # split as a dense MLP, in both modes
        specs |= {
            "shared_gate_proj": P(axis),
            "shared_up_proj": P(axis),
            "shared_down_proj": P(None, axis),
            "shared_expert_gate": P(),
        }
    return specs


def sharded_moe_mlp(x, p: dict, config, mesh):
    """`moe_mlp` per device of `mesh`'s one axis (tokens replicated), summed over it."""
    axis = mesh.axis_names[0]
    specs = expert_specs(config, axis)

    def local(x, p):
        offset = 0
        if config.expert_parallel:
            offset = jax.lax.axis_index(axis) * p["expert_gate"].shape[0]
        return moe_mlp(x, p, config, expert_offset=offset, shard_axis=axis)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), specs), out_specs=P(), check_vma=False)(
        x, {name: p[name] for name in specs}
    )


def dense_moe_mlp(x, p: dict, config) -> jax.Array:
    """The same block as a loop over every expert, each applied to every token and masked
    by the routing: what the grouped matmul must equal (tests, `jengine bench moe`)."""
    weights, experts = route(x, p["router"], config.num_experts_per_tok, config.norm_topk_prob)
    act = ACTIVATIONS[config.hidden_act]
    out = jnp.zeros_like(x)
    for e in range(p["expert_gate"].shape[0]):
        h = act(x @ p["expert_gate"][e].T) * (x @ p["expert_up"][e].T)
        token_weight = jnp.sum(jnp.where(experts == e, weights, 0), axis=-1)
        out = out + (h @ p["expert_down"][e].T) * token_weight[:, None]
    if config.shared_expert_intermediate_size:
        shared = act(x @ p["shared_gate_proj"].T) * (x @ p["shared_up_proj"].T)
        out = out + jax.nn.sigmoid(x @ p["shared_expert_gate"].T) * (
            shared @ p["shared_down_proj"].T
        )
    return out
