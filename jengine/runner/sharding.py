"""Tensor parallelism with jax.sharding: the mesh, how each weight and the KV cache are
laid out over it, and the model rewritten so every device holds whole KV heads.

Where it sits: `ModelRunner` builds a `TensorParallel` when `tensor_parallel_size > 1`,
hands the model through `fit_model` (before anything reaches a device), places params and
cache with `param_shardings` / `kv_cache_sharding`, and passes `mesh` to the model, whose
attention runs per shard inside `shard_map` (XLA cannot partition a custom call). Every
collective is one XLA emits from these shardings.

Promises (Megatron's layout, vLLM's choices):
- q/k/v and gate/up are column-parallel (output features split), o and down row-parallel
  (input features split; XLA adds the all-reduce), the embedding and the LM head
  vocab-parallel, norms replicated; the KV cache is split over its KV-head axis;
- with fewer KV heads than devices, each KV head is repeated so every device holds one
  (as vLLM does): the model's `num_key_value_heads` becomes the TP size, and since each q
  head still meets its own KV head's weights, the outputs do not change;
- a vocabulary the TP size does not divide (added tokens: 32001, 49153, 151665, ...) is
  padded with zero rows in the embedding and LM head up to a multiple of it (as vLLM
  does); the padded logits are cut off before sampling, so no padded id is ever sampled
  or reported in logprobs;
- a clear ValueError for sizes that cannot work: more devices asked for than present, q
  heads, KV heads or MLP width not divisible by the TP size.

`step_collectives` reads back what a compiled step sends between devices (the tests and
`jengine bench parallel` use it): per layer two all-reduces of the [T, D] activations, one
for the embedding, and one all-gather of the [R, V] logits.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "tp"

# Our parameter name -> which axis of its per-layer array (leading layer axis excluded) is
# split; absent: replicated.
_LAYER_SPLIT = {
    "q_proj": 0, "k_proj": 0, "v_proj": 0,  # [out, D]: column-parallel
    "q_bias": 0, "k_bias": 0, "v_bias": 0,
    "gate_proj": 0, "up_proj": 0, "gate_bias": 0, "up_bias": 0,
    "o_proj": 1, "down_proj": 1,  # [D, in]: row-parallel
    # Mixture of experts (models/moe.py): each expert's features split, as a dense MLP's
    # (with expert parallelism instead, `_EXPERT_SPLIT`); a shared expert likewise.
    "expert_gate": 1, "expert_up": 1, "expert_down": 2,  # [E, F, D], [E, D, F]
    "shared_gate_proj": 0, "shared_up_proj": 0, "shared_down_proj": 1,
    # LoRA slots (models/lora.py), A [S, r, in] and B [S, out, r]: split as their base
    # weight is, B's outputs of a column-parallel one, A's inputs of a row-parallel one.
    "lora_b_q_proj": 1, "lora_b_k_proj": 1, "lora_b_v_proj": 1,
    "lora_b_gate_proj": 1, "lora_b_up_proj": 1,
    "lora_a_o_proj": 2, "lora_a_down_proj": 2,
}  # fmt: skip
_EXPERT_SPLIT = {"expert_gate": 0, "expert_up": 0, "expert_down": 0}  # whole experts
_TOP_SPLIT = {"embed_tokens": 0, "lm_head": 0}  # [V, D]: vocab-parallel


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    size: int
    mesh: Mesh
    kv_repeats: int  # each KV head's copies, so every device holds one (1: none)
    vocab_padding: int  # zero rows that make the vocabulary a multiple of `size`
    expert_parallel: bool = False  # MoE: whole experts over the devices (models/moe.py)

    @classmethod
    def create(
        cls, size: int, config, devices=None, *, expert_parallel: bool = False
    ) -> "TensorParallel":
        """`devices`: where the mesh goes (default: the first `size` of `jax.devices()`),
        e.g. those of a user's training mesh. `expert_parallel`: an MoE model's experts
        spread whole over the devices (else each one's features split)."""
        if expert_parallel and not config.num_experts:
            raise ValueError("enable_expert_parallel needs a mixture-of-experts model")
        if not config.num_experts:
            widths = [("MLP width (intermediate_size)", config.intermediate_size)]
        elif expert_parallel:
            widths = [("experts", config.num_experts)]
        else:
            widths = [("expert MLP width (moe_intermediate_size)", config.moe_intermediate_size)]
        if config.shared_expert_intermediate_size:
            widths.append(("shared expert's width", config.shared_expert_intermediate_size))
        for name, count in (("attention heads", config.num_attention_heads), *widths):
            if count % size:
                raise ValueError(f"tensor_parallel_size={size} does not divide the {count} {name}")
        kv = config.num_key_value_heads
        if kv % size and size % kv:
            raise ValueError(
                f"tensor_parallel_size={size} and the {kv} KV heads: one must divide the other"
            )
        devices = list(devices if devices is not None else jax.devices())
        if size > len(devices):
            raise ValueError(
                f"tensor_parallel_size={size} needs {size} devices; "
                f"{len(devices)} {devices[0].platform} device(s) are present"
            )
        return cls(
            size,
            Mesh(np.array(devices[:size]), (AXIS,)),
            kv_repeats=max(1, size // kv),
            vocab_padding=-config.vocab_size % size,
            expert_parallel=expert_parallel,
        )

    # -- the model --------------------------------------------------------------------------

    @property
    def changes_layout(self) -> bool:
        """Whether the engine's weights differ in shape from the checkpoint's."""
        return self.kv_repeats > 1 or self.vocab_padding > 0

    def fit_model(self, model: nnx.Module) -> nnx.Module:
        """The model with each KV head repeated until every device holds one, and the
        vocabulary padded to a multiple of the TP size, if needed; its config says
        whether experts are spread whole."""
        config = model.config
        if not self.changes_layout and config.expert_parallel == self.expert_parallel:
            return model
        new_config = dataclasses.replace(
            config,
            num_key_value_heads=config.num_key_value_heads * self.kv_repeats,
            vocab_padding=self.vocab_padding,
            expert_parallel=self.expert_parallel,
        )
        state = self.fit_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)), config)
        from jengine.models.loader import model_from_params

        return model_from_params(type(model), new_config, state, model.dtype)

    def fit_params(self, params: dict, config) -> dict:
        """A params dict in the checkpoint's layout -> the engine's (each step a no-op
        where the weights have it already)."""
        # A quantized weight is a dict of arrays (values, scales, mins), each with the
        # weight's rows on the same axis: each is padded or repeated alike.
        params = dict(params)
        for name in ("embed_tokens", "lm_head"):
            if name in params and _rows(params[name], 0) == config.vocab_size:
                params[name] = jax.tree.map(
                    lambda w: _pad_rows(w, self.vocab_padding), params[name]
                )
        layers = dict(params["layers"])
        head_dim = config.head_dim
        # k/v weights are [L, K * H, D], their biases [L, K * H].
        if self.kv_repeats == 1 or _rows(layers["k_proj"], 1) == self.size * head_dim:
            return params  # nothing to repeat, or repeated already
        # (LoRA slots' B of k/v: [L, S, K * H, r].)
        heads_axis = {"lora_b_k_proj": 2, "lora_b_v_proj": 2}
        for name in ("k_proj", "v_proj", "k_bias", "v_bias", *heads_axis):
            if name in layers:
                axis = heads_axis.get(name, 1)
                layers[name] = jax.tree.map(
                    lambda w, axis=axis: _repeat_heads(w, head_dim, self.kv_repeats, axis),
                    layers[name],
                )
        return {**params, "layers": layers}

    def checkpoint_shape(self, name: str, engine_shape: tuple) -> tuple:
        """A leaf's shape (dotted name) in the checkpoint's layout, from its shape in the
        engine's: the vocabulary unpadded, each KV head once."""
        shape = list(engine_shape)
        parts = name.split(".")
        if parts[0] in ("embed_tokens", "lm_head"):
            shape[0] -= self.vocab_padding
        elif parts[0] == "layers" and parts[1] in ("k_proj", "v_proj", "k_bias", "v_bias"):
            shape[1] //= self.kv_repeats
        elif parts[0] == "layers" and parts[1] in ("lora_b_k_proj", "lora_b_v_proj"):
            shape[2] //= self.kv_repeats
        return tuple(shape)

    def fit_lora_b(self, target: str, b, config):
        """One adapter's B [L, out, r] of `target` in the engine's layout: a k/v
        projection's heads repeated as `fit_params` repeats the base weight's."""
        if self.kv_repeats == 1 or target not in ("k_proj", "v_proj"):
            return b
        return np.asarray(_repeat_heads(b, config.head_dim, self.kv_repeats, axis=1))

    # -- placement --------------------------------------------------------------------------

    def param_shardings(self, params):
        """A NamedSharding per leaf of the params State, by parameter name. A quantized
        weight's arrays (values, scales, mins: `models/quantized_linear.py`) split along
        its own axis each where their size allows, else stay whole (per-channel scales
        of a row-parallel weight: each output's one scale multiplies every shard's part)."""

        def spec(path, leaf) -> NamedSharding:
            names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
            if "layers" in names:
                name = names[names.index("layers") + 1]
                split_by = (
                    _EXPERT_SPLIT
                    if self.expert_parallel and name in _EXPERT_SPLIT
                    else _LAYER_SPLIT
                )
                axis = split_by.get(name)
                split = None if axis is None else axis + 1  # after the layer axis
            else:
                split = _TOP_SPLIT.get(names[0])
            axes = [None] * leaf.ndim
            if split is not None and leaf.shape[split] % self.size == 0:
                axes[split] = AXIS
            return NamedSharding(self.mesh, P(*axes))

        return jax.tree_util.tree_map_with_path(spec, params)

    def kv_cache_sharding(self) -> NamedSharding:
        """[L, 2, K, blocks, block_size, H]: split over the KV heads."""
        return NamedSharding(self.mesh, P(None, None, AXIS, None, None, None))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


def _rows(weight, axis: int) -> int:
    """A weight's size along `axis`: an array's, or a quantized weight's values'."""
    return (weight["values"] if isinstance(weight, dict) else weight).shape[axis]


def _pad_rows(weight, rows: int):
    """[V, D] -> [V + rows, D], the new rows zero (on the device for a jax array)."""
    if rows == 0:
        return weight
    if isinstance(weight, jax.Array):
        # Under jit the zero is a constant of the program, not a host-to-device copy.
        return jax.jit(lambda w: jnp.pad(w, ((0, rows), (0, 0))))(weight)
    return np.pad(np.asarray(weight), ((0, rows), (0, 0)))


def _repeat_heads(weight, head_dim: int, repeats: int, axis: int):
    """K * H entries along `axis` -> K * repeats * H: each head's `repeats` times in a row.
    A jax array stays on its devices (jnp); anything else is repeated on the host."""
    xp = jnp if isinstance(weight, jax.Array) else np
    weight = xp.asarray(weight)
    shape = weight.shape
    heads = weight.reshape(*shape[:axis], shape[axis] // head_dim, head_dim, *shape[axis + 1 :])
    repeated = xp.repeat(heads, repeats, axis=axis)
    return repeated.reshape(*shape[:axis], shape[axis] * repeats, *shape[axis + 1 :])


# -- what the compiled step sends between devices ----------------------------------------

_COLLECTIVE = re.compile(
    r"^\s*%?\S+ = (\w+)\[([\d,]*)\]\S* "
    r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_WHILE = re.compile(r"body=%?([\w.\-]+).*?\"known_trip_count\":\{\"n\":\"(\d+)\"\}")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}


def step_collectives(compiled_hlo: str) -> list[dict]:
    """The collectives in a compiled step's HLO text, each with its result's size in bytes
    and how many times one step runs it (a layer-scan body's, once per layer)."""
    trips = {body: int(n) for body, n in _WHILE.findall(compiled_hlo)}
    found, computation = [], None
    for line in compiled_hlo.splitlines():
        if header := _COMPUTATION.match(line):
            computation = header.group(2)
            continue
        if match := _COLLECTIVE.match(line):
            dtype, dims, kind = match.groups()
            shape = [int(d) for d in dims.split(",") if d]
            found.append(
                dict(
                    kind=kind,
                    dtype=dtype,
                    shape=shape,
                    bytes=math.prod(shape) * _DTYPE_BYTES.get(dtype, 4),
                    times_per_step=trips.get(computation, 1),
                )
            )
    return found
