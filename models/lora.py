"""LoRA adapters: PEFT folders read into the decoder's layout, and the low-rank products of
a batch in which every token may use a different adapter.

Where it sits: a model built with `DecoderConfig.lora_slots` > 0 holds, for each targeted
projection `name` of `lora_targets`, two layer-stacked parameters: `lora_a_<name>`
[L, S, r, in] and `lora_b_<name>` [L, S, out, r]: slots 1..S (S = lora_slots, slot s
at index s - 1) of rank r = lora_rank; slot 0, the base model, is not stored (a token on
it adds nothing, and costs nothing). `read_peft_adapter` turns a PEFT folder
into one slot's arrays (`LoRAAdapter.slot_arrays`), `adapter_from_weights` takes one
from a training loop's arrays, and the engine's `runner/lora_slots.py` writes them into
the params of a model `with_lora_slots` made: loading an adapter changes values, never a
shape, so nothing recompiles. The
forward pass takes each token's slot (`lora_slots` [T]) and adds, to every targeted
projection, `lora_delta`.

Promises (PEFT's numerics): y = x W^T + scale * (x A^T) B^T with scale = alpha / r
(alpha / sqrt(r) with rsLoRA), each module's own alpha (alpha_pattern) and rank
(rank_pattern), folded into B once at load; an adapter of rank below the slots', or a
module of rank below the adapter's, is zero-padded (exact), and a layer it leaves alone
(layers_to_transform) holds zeros; targets among q/k/v/o and gate/up/down, and a fused
module of the checkpoint (Phi-3's `qkv_proj`, `gate_up_proj`: `fused_weights`) as the
projections it splits into, each with the module's A and its own rows of B (exact: x A^T
B^T, row by row); a clear ValueError for what is not read (embedding or LM-head adapters,
`modules_to_save`, DoRA, biases, a rank above the slots', other targets, a module whose
sizes are not the model's).
"""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

# PEFT module name (the last part of its path) -> our projection
TARGETS = {
    "q_proj": "q_proj",
    "k_proj": "k_proj",
    "v_proj": "v_proj",
    "o_proj": "o_proj",
    "gate_proj": "gate_proj",
    "up_proj": "up_proj",
    "down_proj": "down_proj",
}
_TENSOR = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


def projection_sizes(config) -> dict[str, tuple[int, int]]:
    """Each target's (outputs, inputs) in a model of `config` (as its checkpoint holds
    it: before tensor parallelism repeats any KV head)."""
    D, F, H = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_attention_heads * H, config.num_key_value_heads * H
    return {
        "q_proj": (q_size, D), "k_proj": (kv_size, D), "v_proj": (kv_size, D),
        "o_proj": (D, q_size), "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F),
    }  # fmt: skip


def param_names(target: str) -> tuple[str, str]:
    """The layer parameters that hold `target`'s slots: (A, B)."""
    return f"lora_a_{target}", f"lora_b_{target}"


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights in the decoder's layout: target -> (A [L, r, in],
    B [L, out, r] times the scale)."""

    name: str
    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    def slot_arrays(self, rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The adapter zero-padded to slots of `rank`: target -> (A [L, rank, in],
        B [L, out, rank])."""
        if self.rank > rank:
            raise ValueError(f"LoRA adapter {self.name!r} has rank {self.rank} > {rank}")
        padded = {}
        for target, (a, b) in self.weights.items():
            pad = rank - a.shape[1]
            padded[target] = (
                np.pad(a, ((0, 0), (0, pad), (0, 0))),
                np.pad(b, ((0, 0), (0, 0), (0, pad))),
            )
        return padded


def adapter_from_weights(name: str, weights, alpha: float | None, config) -> LoRAAdapter:
    """An adapter handed over in memory: {target: (A [L, r, in], B [L, out, r])} (jax or
    numpy arrays, PEFT's layout stacked over layers), scaled by alpha / r (alpha None: r),
    for a model of `config`."""
    where = f"LoRA adapter {name!r}"
    if not weights:
        raise ValueError(f"{where} has no weights")
    ranks = set()
    scaled = {}
    sizes, layers = projection_sizes(config), config.num_hidden_layers
    for target, pair in weights.items():
        if target not in TARGETS:
            raise ValueError(f"{where}: {target!r} is not a target (one of {sorted(TARGETS)})")
        # Copies: the adapter is what the weights are now, whatever the caller's training
        # does to its arrays next (np.asarray would keep a float32 numpy array itself).
        a, b = (np.array(x, np.float32) for x in pair)
        out, inputs = sizes[target]
        rank = a.shape[1] if a.ndim == 3 else -1
        if a.shape != (layers, rank, inputs) or b.shape != (layers, out, rank):
            raise ValueError(
                f"{where}: {target} wants A [{layers}, r, {inputs}] and B [{layers}, {out}, "
                f"r], got {a.shape} and {b.shape}"
            )
        ranks.add(rank)
        scaled[target] = (a, b)
    if len(ranks) != 1:
        raise ValueError(f"{where}: its targets have different ranks {sorted(ranks)}")
    (rank,) = ranks
    scale = np.float32((alpha if alpha is not None else rank) / rank)
    return LoRAAdapter(name, rank, {t: (a, b * scale) for t, (a, b) in scaled.items()})


def read_peft_adapter(path: str, config, name: str | None = None) -> LoRAAdapter:
    """A PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) for a model
    of `config`."""
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r} has no adapter_config.json")
    try:
        with open(config_path) as f:
            peft = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    where = f"LoRA adapter {path}"
    if peft.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {peft['peft_type']!r} is not LORA")
    for key in ("modules_to_save", "use_dora"):
        if peft.get(key):
            raise ValueError(f"{where}: {key} is not supported")
    if peft.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias {peft['bias']!r} is not supported (only 'none')")
    modules = {}
    for (target, layer), parts in _lora_pairs(path, config, where).items():
        if "A" not in parts or "B" not in parts or parts["A"].shape[0] != parts["B"].shape[1]:
            raise ValueError(f"{where}: {parts['module']} lacks lora_A or lora_B")
        rank = parts["A"].shape[0]  # rank_pattern's, where it names this module
        scale = _alpha(peft, parts["module"]) / (rank**0.5 if peft.get("use_rslora") else rank)
        modules[target, layer] = (parts["A"], parts["B"] * np.float32(scale))
    if not modules:
        raise ValueError(f"{where} has no LoRA weights")
    rank = max(a.shape[0] for a, _ in modules.values())
    sizes, weights = projection_sizes(config), {}
    for target in sorted({target for target, _ in modules}):
        # A layer the adapter leaves alone (layers_to_transform) adds nothing: zeros; a
        # module of a lower rank (rank_pattern) is zero-padded to the adapter's highest.
        out, inputs = sizes[target]
        nothing = (np.zeros((0, inputs)), np.zeros((out, 0)))
        a, b = zip(
            *(modules.get((target, layer), nothing) for layer in range(config.num_hidden_layers)),
            strict=True,
        )
        weights[target] = (
            np.stack([np.pad(x, ((0, rank - x.shape[0]), (0, 0))) for x in a]).astype(np.float32),
            np.stack([np.pad(x, ((0, 0), (0, rank - x.shape[1]))) for x in b]).astype(np.float32),
        )
    return LoRAAdapter(name or os.path.basename(os.path.normpath(path)), rank, weights)


def _lora_pairs(path: str, config, where: str) -> dict[tuple[str, int], dict]:
    """The adapter's tensors by (our projection, layer): {"module": PEFT's module name,
    "A": [r, in], "B": [out, r]}; a fused module's A goes to each projection it splits
    into, and its B's rows are split among them."""
    sizes, found = projection_sizes(config), {}
    for tensor, array in _adapter_tensors(path).items():
        match = _TENSOR.match(tensor)
        name = match.group(2) if match else None
        if name not in TARGETS and name not in config.fused_weights:
            raise ValueError(f"{where}: tensor {tensor} is not a LoRA weight jengine applies")
        layer, which = int(match.group(1)), match.group(3)
        if layer >= config.num_hidden_layers:
            raise ValueError(
                f"{where}: tensor {tensor} is for layer {layer}; the model has "
                f"{config.num_hidden_layers}"
            )
        targets = config.fused_weights.get(name, (TARGETS.get(name),))
        rows = [sizes[target][0] for target in targets]
        inputs = sizes[targets[0]][1]  # the parts of a fused module share their inputs
        axis, size = (1, inputs) if which == "A" else (0, sum(rows))
        if array.ndim != 2 or array.shape[axis] != size:
            wanted = f"[r, {size}]" if which == "A" else f"[{size}, r]"
            raise ValueError(
                f"{where}: tensor {tensor} is {list(array.shape)}; this model's {name} wants "
                f"{wanted}"
            )
        pieces = [array] * len(targets)
        if which == "B":
            pieces = np.split(array, np.cumsum(rows)[:-1])
        module = tensor.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        for target, piece in zip(targets, pieces, strict=True):
            found.setdefault((target, layer), {"module": module})[which] = np.asarray(piece)
    return found


def _alpha(peft: dict, module: str) -> float:
    """PEFT's lora_alpha of `module` ("model.layers.3.self_attn.v_proj"): the first `alpha_pattern`
    key that matches the end of its name (PEFT's rule: a regex, after a dot), else
    lora_alpha (else r)."""
    for key, alpha in (peft.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(alpha)
    return float(peft.get("lora_alpha", peft["r"]))


def _adapter_tensors(path: str) -> dict[str, np.ndarray]:
    from jengine.models.loader import read_safetensors  # the loader imports the models

    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        legacy = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise ValueError(
            f"LoRA adapter {path!r} has no adapter_model.safetensors"
            + (" (its adapter_model.bin, PyTorch's pickle format, is not read)" if legacy else "")
        )
    return read_safetensors(file)


def with_lora_slots(model, num_slots: int, rank: int):
    """`model` (any family of models/decoder.py) rebuilt with `num_slots` adapter slots of
    `rank` on every projection an adapter may target (attention only where the MLP is a
    mixture of experts), all zero: outputs unchanged until an adapter is written in."""
    from flax import nnx

    from jengine.models.loader import model_from_params  # the loader imports the models

    targets = tuple(
        t
        for t in TARGETS
        if not (model.config.num_experts and t in ("gate_proj", "up_proj", "down_proj"))
    )
    config = dataclasses.replace(
        model.config, lora_slots=num_slots, lora_rank=rank, lora_targets=targets
    )
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    shapes = nnx.to_pure_dict(
        nnx.state(
            nnx.eval_shape(lambda: type(model)(config, dtype=model.dtype, rngs=nnx.Rngs(0))),
            nnx.Param,
        )
    )["layers"]
    layers = dict(params["layers"])
    for target in targets:
        for name in param_names(target):
            layers[name] = jnp.zeros(shapes[name].shape, model.dtype)
    return model_from_params(type(model), config, {**params, "layers": layers}, model.dtype)


# Up to this many tokens a step gathers each token's own slot (reading one adapter's
# weights a token); past it every slot's product is computed and masked (one matmul per
# slot set, no per-token copy of weights). On this 2-core CPU, for 4 slots of rank 16 on a
# 512 x 1408 projection: 1 token 22.6 vs 75.4 us, 8 tokens 74.5 vs 124.0, 64 tokens 409.6
# vs 248.6 (gathered vs masked, jitted alone).
GATHER_MAX_TOKENS = 16


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """sum over slots s of [slots[t] == s] * (x[t] A_s^T) B_s^T: [T, in] -> [T, out], for one
    layer's a [S, r, in], b [S, out, r] holding slots 1..S (a token on slot 0 gets zero).
    Few tokens (a decode step): each token's slot gathered. More: every slot's product for
    every token, masked to its own (S r (in + out) per token, small beside the
    projection's in x out, with no per-token copy of adapter weights)."""
    if x.shape[0] <= GATHER_MAX_TOKENS:
        index = jnp.maximum(slots - 1, 0)
        h = jnp.einsum("ti,tri->tr", x, a[index]) * (slots > 0)[:, None].astype(x.dtype)
        return jnp.einsum("tr,tor->to", h, b[index])
    h = jnp.einsum("ti,sri->tsr", x, a)  # [T, S, r]
    held = jnp.arange(1, a.shape[0] + 1, dtype=slots.dtype)
    mine = (slots[:, None] == held[None, :]).astype(x.dtype)
    return jnp.einsum("tsr,sor->to", h * mine[:, :, None], b)
