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
shared expert (a dense gated MLP scaled by sigmoid(its gate)) added. A batch runs as
grouped matmuls (`grouped_experts`: GPU, TPU), as a loop over the experts
(`looped_experts`: on CPU, where XLA's grouped matmul is slower), or, with few (token,
expert) pairs against many experts (a decode step), reading only the chosen experts'
weights (`gathered_experts`); `experts_impl` picks, by measurement. `dense_moe_mlp` is the
per-expert loop all are tested and timed against.
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
    (`first_expert` .. + gate.shape[0]; assignments to others count 0): [T, D]. One grouped
    matmul per projection over the (token, expert) pairs sorted by expert."""
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


def gathered_experts(
    x, weights, experts, gate, up, down, layer, *, activation: str, first_expert=0
) -> jax.Array:
    """The same sum for a few tokens (T * k at most the experts held): each (token,
    expert) pair reads its expert's weights straight out of the layer-stacked [L, E, ...]
    arrays, so a decode step reads k experts' weights, not all E (XLA:CPU's grouped matmul
    computes every group: bench/README.md)."""
    num_tokens, top_k = experts.shape
    local = experts.reshape(-1) - first_expert
    held = (local >= 0) & (local < gate.shape[1])
    index = jnp.where(held, local, 0)
    rows = jnp.repeat(x, top_k, axis=0)  # [T * k, D]
    g = jnp.einsum("md,mfd->mf", rows, gate[layer, index])
    u = jnp.einsum("md,mfd->mf", rows, up[layer, index])
    out = jnp.einsum("mf,mdf->md", ACTIVATIONS[activation](g) * u, down[layer, index])
    scale = jnp.where(held, weights.reshape(-1), 0)
    return jnp.sum((out * scale[:, None]).reshape(num_tokens, top_k, -1), axis=1)


def looped_experts(
    x, weights, experts, gate, up, down, layer, *, activation: str, first_expert=0
) -> jax.Array:
    """The same sum as a loop over the experts held here, each applied to every token and
    weighted by the routing (0 for tokens that did not choose it): E / k times the
    arithmetic, but on XLA:CPU faster than its grouped matmul (bench/README.md)."""
    act = ACTIVATIONS[activation]
    out = jnp.zeros_like(x)
    for e in range(gate.shape[1]):
        token_weight = jnp.sum(jnp.where(experts == first_expert + e, weights, 0), axis=-1)
        h = act(x @ gate[layer, e].T) * (x @ up[layer, e].T)
        out = out + (h @ down[layer, e].T) * token_weight[:, None]
    return out


def experts_impl(num_pairs: int, num_experts: int, backend: str | None = None) -> str:
    """How `moe_mlp` computes a batch's experts: "gathered" when its (token, expert) pairs
    are few against the experts (a decode step of a many-expert model reads k of E), else
    "grouped" matmuls, or on CPU the "looped" experts (measured faster there than XLA:CPU's
    grouped matmul at batch 1 and 64: `jengine bench moe`)."""
    if num_pairs * 8 <= num_experts:
        return "gathered"
    return "looped" if (backend or jax.default_backend()) == "cpu" else "grouped"


def moe_mlp(x, p: dict, config, layer, *, expert_offset=0, shard_axis: str | None = None):
    """The MoE block of layer `layer`: `p` holds the layer-stacked [L, ...] `router`,
    `expert_gate`, `expert_up`, `expert_down` and, for a shared expert,
    `shared_gate_proj`, `shared_up_proj`, `shared_down_proj`, `shared_expert_gate`. With
    `shard_axis` (inside shard_map) the devices' partial sums are added up over it."""
    top_k = config.num_experts_per_tok
    weights, experts = route(x, p["router"][layer], top_k, config.norm_topk_prob)
    kwargs = dict(activation=config.hidden_act, first_expert=expert_offset)
    stacked = (p["expert_gate"], p["expert_up"], p["expert_down"])
    impl = experts_impl(x.shape[0] * top_k, p["expert_gate"].shape[1])
    if impl == "gathered":
        out = gathered_experts(x, weights, experts, *stacked, layer, **kwargs)
    elif impl == "looped":
        out = looped_experts(x, weights, experts, *stacked, layer, **kwargs)
    else:
        out = grouped_experts(x, weights, experts, *(w[layer] for w in stacked), **kwargs)
    if config.shared_expert_intermediate_size:
        act = ACTIVATIONS[config.hidden_act]
        shared = act(x @ p["shared_gate_proj"][layer].T) * (x @ p["shared_up_proj"][layer].T)
        shared = shared @ p["shared_down_proj"][layer].T  # a part of it under a mesh
        out = out + jax.nn.sigmoid(x @ p["shared_expert_gate"][layer].T) * shared
    if shard_axis is not None:
        out = jax.lax.psum(out, shard_axis)
    return out


def expert_specs(config, axis: str) -> dict:
    """How each layer-stacked MoE weight lies over the mesh axis (see the module
    docstring; `runner/sharding.py` places them the same way)."""
    if config.expert_parallel:
        experts = dict.fromkeys(("expert_gate", "expert_up", "expert_down"), P(None, axis))
    else:
        experts = {
            "expert_gate": P(None, None, axis),
            "expert_up": P(None, None, axis),
            "expert_down": P(None, None, None, axis),
        }
    specs = {"router": P(), **experts}
    if config.shared_expert_intermediate_size:  # split as a dense MLP, in both modes
        specs |= {
            "shared_gate_proj": P(None, axis),
            "shared_up_proj": P(None, axis),
            "shared_down_proj": P(None, None, axis),
            "shared_expert_gate": P(),
        }
    return specs


def sharded_moe_mlp(x, p: dict, config, layer, mesh):
    """`moe_mlp` per device of `mesh`'s one axis (tokens replicated), summed over it."""
    axis = mesh.axis_names[0]
    specs = expert_specs(config, axis)

    def local(x, p, layer):
        offset = 0
        if config.expert_parallel:
            offset = jax.lax.axis_index(axis) * p["expert_gate"].shape[1]
        return moe_mlp(x, p, config, layer, expert_offset=offset, shard_axis=axis)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(P(), specs, P()), out_specs=P(), check_vma=False
    )(x, {name: p[name] for name in specs}, layer)


def dense_moe_mlp(x, p: dict, config) -> jax.Array:
    """The same block as a loop over every expert, each applied to every token and masked
    by the routing, for one layer's weights (`p` unstacked: [E, F, D], ...): what the
    grouped and gathered paths must equal (tests, `jengine bench moe`)."""
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
