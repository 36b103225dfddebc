"""Swapping in new weights of the same shapes without recompiling the step.

Where it sits: `ModelRunner.update_weights` (what `LLM.update_weights` and RL-style
research code call) hands the engine's current params and the caller's new ones to
`updated_params`, which returns params laid out exactly as the current ones.

Promises: host arrays are cast on the host when their dtype differs; jax arrays on the
engine's devices never leave them (another layout there is resharded by one jitted
program); every new weight gets its old weight's sharding, so the step never recompiles;
a structure or shape that does not fit is a ValueError naming what is wrong.
"""

import jax
import numpy as np
from flax import nnx


def updated_params(current, params, tensor_parallel, config):
    """`params` (a State, pure dict or model) in the layout of `current`; `config`: the
    engine's model config."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params)
    if tensor_parallel and tensor_parallel.changes_layout:
        # The caller's weights have the checkpoint's KV heads and vocabulary; the engine
        # repeats the one and pads the other.
        if isinstance(params, nnx.State):
            params = nnx.to_pure_dict(params)
        params = tensor_parallel.fit_params(params, config)
    if not isinstance(params, nnx.State):
        state = jax.tree.map(lambda x: x, current)
        try:
            nnx.replace_by_pure_dict(state, params)
        except (KeyError, ValueError) as e:
            raise ValueError(f"update_weights: params do not fit the model: {e}") from e
        params = state
    new_leaves, new_tree = jax.tree.flatten(params)
    old_leaves, old_tree = jax.tree.flatten(current)
    if new_tree != old_tree:
        raise ValueError("update_weights: params have a different structure than the model")
    leaves = []
    moves = {}  # leaf index -> a device array to reshard on its devices
    for index, (new, old) in enumerate(zip(new_leaves, old_leaves, strict=True)):
        if new.shape != old.shape:
            raise ValueError(f"update_weights: a weight of shape {old.shape} got {new.shape}")
        on_device = isinstance(new, jax.Array)
        if on_device and new.sharding == old.sharding and new.dtype == old.dtype:
            # The engine's own layout: the same buffers (device_put only commits them:
            # committed and uncommitted arrays are different jit cache keys).
            leaves.append(jax.device_put(new, old.sharding))
        elif on_device and new.sharding.device_set == old.sharding.device_set:
            leaves.append(None)  # another layout on the same devices (a training mesh's)
            moves[index] = new
        else:
            if new.dtype != old.dtype:
                new = np.asarray(new).astype(old.dtype)  # on the host: nothing compiles
            leaves.append(jax.device_put(new, old.sharding))
    if moves:
        # One program moves (and casts) them all with the collectives XLA picks; a
        # device_put would go through the host for most layout changes.
        targets = [old_leaves[index] for index in moves]
        moved = jax.jit(
            lambda arrays: [a.astype(t.dtype) for a, t in zip(arrays, targets)],
            out_shardings=[t.sharding for t in targets],
        )(list(moves.values()))
        for index, array in zip(moves, moved):
            leaves[index] = array
    return jax.tree.unflatten(old_tree, leaves)
