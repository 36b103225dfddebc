"""Swapping in new weights of the same shapes without recompiling the step.

Where it sits: `ModelRunner.update_weights` (what `LLM.update_weights` and RL-style
research code call) hands the engine's current params and the caller's new ones to
`updated_params`, which returns params laid out exactly as the current ones.

Promises: host arrays, and jax arrays on other devices than the engine's, are copied (and
cast) on the host; jax arrays on the engine's devices never leave them (another layout
there is resharded by one jitted program, the engine's own copied there), and the engine
never shares a buffer with the caller; every new weight gets its old weight's sharding,
so the step never recompiles; a missing or unexpected leaf, a leaf that is no array or
one of another shape or kind of number is a ValueError naming it
(`models/param_tree.py`); the engine's LoRA slots are kept unless given.
"""

import jax
import numpy as np
from flax import nnx

from jengine.models.param_tree import fitted_leaves, flatten, unflatten


def _adapter_slot(name: str) -> bool:
    """A LoRA slot's params are the engine's, not the model's: kept unless given."""
    return name.rsplit(".", 1)[-1].startswith("lora_")


def updated_params(current, params, tensor_parallel, config):
    """`params` (a State, pure dict or model) in the layout of `current`; `config`: the
    engine's model config."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    old_leaves = dict(flatten(nnx.to_pure_dict(current)))
    changes_layout = bool(tensor_parallel and tensor_parallel.changes_layout)
    optional = frozenset(filter(_adapter_slot, old_leaves))
    if changes_layout:
        # The caller's weights have the checkpoint's KV heads and vocabulary (or the
        # engine's layout already); the engine repeats the one and pads the other.
        given = fitted_leaves(old_leaves, params, "update_weights", optional=optional, shapes=False)
        for name, value in given.items():
            engine_shape = tuple(old_leaves[name].shape)
            shape = tensor_parallel.checkpoint_shape(name, engine_shape)
            if tuple(value.shape) not in (shape, engine_shape):
                raise ValueError(
                    f"update_weights: param {name} has shape {tuple(value.shape)}, expected "
                    f"{shape} (the checkpoint's layout)"
                )
        params = tensor_parallel.fit_params(params, config)
    new_leaves = fitted_leaves(old_leaves, params, "update_weights", optional=optional)
    placed = {}
    moves = {}  # name -> a device array to reshard on its devices
    for name, new in new_leaves.items():
        old = old_leaves[name]
        on_device = isinstance(new, jax.Array)
        if on_device and new.sharding == old.sharding and new.dtype == old.dtype:
            # The engine's own layout: copied on the device, so that what the caller does
            # with its arrays next (a train step that donates them) never reaches the
            # engine's. (device_put also commits them: committed and uncommitted arrays are
            # different jit cache keys.)
            placed[name] = jax.device_put(new, old.sharding, may_alias=False)
        elif on_device and new.sharding.device_set == old.sharding.device_set:
            moves[name] = new  # another layout on the same devices (a training mesh's)
        else:
            # Through the host, as the engine's own copy (cast there: nothing compiles).
            # device_put alone shares memory: with a host array on a CPU device, and with
            # the shard of a jax array on a device both sets hold.
            placed[name] = jax.device_put(np.array(new, dtype=old.dtype), old.sharding)
    if moves:
        # One program moves (and casts) them all with the collectives XLA picks; a
        # device_put would go through the host for most layout changes.
        targets = [old_leaves[name] for name in moves]
        moved = jax.jit(
            lambda arrays: [a.astype(t.dtype) for a, t in zip(arrays, targets)],
            out_shardings=[t.sharding for t in targets],
        )(list(moves.values()))
        placed.update(zip(moves, moved))
    state = jax.tree.map(lambda x: x, current)
    nnx.replace_by_pure_dict(state, unflatten(placed))
    return state
