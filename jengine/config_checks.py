"""Checks the config dataclasses share (`config.py`, `speculative_config.py`,
`engine/arg_utils.py`): a bad value is a ValueError naming its field, never a TypeError
from somewhere later. Jax-free."""

import numbers
import types
import typing
from dataclasses import fields


def require(ok: bool, field: str, msg: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} {msg}, got {value!r}")


# What a number field admits besides its own type (numpy's numbers among them).
_ADMITS = {int: numbers.Integral, float: numbers.Real}


def check_number_types(instance, prefix: str = "") -> None:
    """A number field of the wrong type is a ValueError naming it (`prefix` + its name)
    here, not a TypeError from arithmetic somewhere later (`max_model_len="abc"`, a
    speculative k of 2.5); other fields are checked against their choices where used."""
    hints = typing.get_type_hints(type(instance))
    for f in fields(instance):
        kind = hints[f.name]
        kinds = kind.__args__ if isinstance(kind, types.UnionType) else (kind,)
        if not set(kinds) & set(_ADMITS):
            continue
        value = getattr(instance, f.name)
        admitted = tuple(_ADMITS.get(k, k) for k in kinds)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, admitted):
            names = " or ".join(
                "None" if k is type(None) else ("an " if k is int else "a ") + k.__name__
                for k in kinds
            )
            raise ValueError(f"{prefix}{f.name} must be {names}, got {value!r}")
