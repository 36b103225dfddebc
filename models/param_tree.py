"""A params tree by name: the flat view ("layers.q_proj") of a nested params dict, and the
check that a caller's tree fits a model's.

Where it sits: `loader.model_from_params` (`LLM(params=...)`) and the runner's
`weight_update.updated_params` (`LLM.update_weights`) check what a caller hands over here
before placing a single array, so both name the same faults the same way.

Promises: `fitted_leaves` returns the given leaves by name, or raises a ValueError naming
the missing and unexpected leaves, a leaf that is not an array, or one whose shape or kind
of number (floating point or integer) is not the model's. Floating-point leaves may come
in another float dtype: the model casts them, but an integer array where the model holds
floats (or the other way round) is a mistake, never a cast.
"""

from collections.abc import Iterator, Mapping
from typing import Any

import jax.numpy as jnp


def flatten(tree: Mapping, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, leaf) of every leaf of a nested dict."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten(value, name + ".")
        else:
            yield name, value


def unflatten(flat: Mapping[str, Any]) -> dict:
    """The nested dict of a {dotted name: leaf} dict."""
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def fitted_leaves(
    expected: Mapping[str, Any],
    given: Any,
    what: str,
    *,
    optional: frozenset[str] = frozenset(),
    shapes: bool = True,
) -> dict[str, Any]:
    """`given` (a nested dict of arrays) checked against `expected` ({dotted name: an
    array or shape-dtype struct}): its leaves by name. Names in `optional` may be left
    out; `shapes=False` leaves the shapes to the caller (a layout still to change)."""
    if not isinstance(given, Mapping):
        raise ValueError(
            f"{what}: params must be a dict of arrays (a pure dict or an nnx.State), "
            f"got {type(given).__name__}"
        )
    leaves = dict(flatten(given))
    missing = sorted(set(expected) - set(leaves) - optional)
    extra = sorted(set(leaves) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{what}: params do not fit the model: missing {missing}, unexpected {extra}"
        )
    for name, value in leaves.items():
        spec = expected[name]
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise ValueError(f"{what}: param {name} is a {type(value).__name__}, not an array")
        if shapes and tuple(value.shape) != tuple(spec.shape):
            raise ValueError(
                f"{what}: param {name} has shape {tuple(value.shape)}, expected {tuple(spec.shape)}"
            )
        if jnp.issubdtype(value.dtype, jnp.floating) != jnp.issubdtype(spec.dtype, jnp.floating):
            raise ValueError(
                f"{what}: param {name} is {jnp.dtype(value.dtype).name}, the model holds "
                f"{jnp.dtype(spec.dtype).name}"
            )
    return leaves
