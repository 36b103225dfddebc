"""Training a LoRA adapter in JAX on a model the engine serves, and handing it over.

Where it sits: research code. `lora_loss_fn(model, rank, ...)` returns
`loss(weights, tokens)`, the next-token cross-entropy of the model with the adapter
`weights` ({target: (A [L, r, in], B [L, out, r])}, `init_lora_weights`) applied, which
`jax.grad` differentiates with respect to the adapter only (the base weights are
constants of the function). The trained `weights` go to an engine made with
`enable_lora=True` as they are: `LLM.add_lora(name, weights, alpha)` (README, "LoRA
adapters").

Promises: the forward pass is the engine's own (the model with one adapter slot, every
token on it, through its paged attention over a scratch cache, as
`train_shakespeare.make_logits_fn` trains the bundled model), so what is trained is what
is served; the scale is alpha / r, as `add_lora` applies it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jengine.models.attention_metadata import SCRATCH_BLOCK_SIZE, paged_batch
from jengine.models.lora import param_names, projection_sizes, with_lora_slots


def init_lora_weights(config, rank: int, targets=("q_proj", "v_proj"), seed: int = 0) -> dict:
    """PEFT's initialisation: A random (Kaiming-uniform bounds), B zero, so training starts
    from the base model."""
    rng = np.random.default_rng(seed)
    layers, sizes = config.num_hidden_layers, projection_sizes(config)
    weights = {}
    for target in targets:
        out, inputs = sizes[target]
        bound = 1 / np.sqrt(inputs)
        a = rng.uniform(-bound, bound, (layers, rank, inputs)).astype(np.float32)
        weights[target] = (jnp.asarray(a), jnp.zeros((layers, out, rank), jnp.float32))
    return weights


def lora_loss_fn(model, rank: int, batch: int, seq_len: int, alpha: float | None = None):
    """loss(weights, tokens [batch, seq_len + 1]) -> mean next-token cross-entropy of
    `model` (an engine model, e.g. `load_model(path)`) with the adapter applied."""
    model = with_lora_slots(model, num_slots=1, rank=rank)
    graphdef, state = nnx.split(model)
    base = nnx.to_pure_dict(state)
    scale = (alpha if alpha is not None else rank) / rank
    positions, metadata, num_pages = paged_batch(batch, seq_len)
    on_the_adapter = jnp.ones(batch * seq_len, jnp.int32)  # every token on slot 1

    def loss(weights, tokens):
        layers = dict(base["layers"])
        for target, (a, b) in weights.items():
            a_name, b_name = param_names(target)
            layers[a_name] = layers[a_name].at[:, 0].set(a)  # slot 1, the only one
            layers[b_name] = layers[b_name].at[:, 0].set(b * scale)
        adapted_state = jax.tree.map(lambda x: x, state)  # a copy to fill
        nnx.replace_by_pure_dict(adapted_state, {**base, "layers": layers})
        adapted = nnx.merge(graphdef, adapted_state)
        cache = jnp.zeros(adapted.kv_cache_shape(num_pages, SCRATCH_BLOCK_SIZE), jnp.float32)
        hidden, _ = adapted(
            tokens[:, :-1].reshape(-1), positions, cache, metadata, lora_slots=on_the_adapter
        )
        logits = adapted.compute_logits(hidden)
        targets = tokens[:, 1:].reshape(-1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss
