"""Numbers are finite numbers: the one rule every configuration model follows.

`inf` and `nan` are never meaningful parameter values (a learning rate of `inf` trains a NaN model), so every
pydantic configuration (`cse.config.stages._Config`, and through it every stage, training and evaluation config) and
every method's typed model config (a frozen dataclass of `models/`, checked by `check_finite_fields` in
`cse.config.methods`) refuses them; `require_finite` is the same rule for one number.

A boolean is not a number either: pydantic reads JSON `true` as 1 for an `int` or `float` field, so
`{"learning_rate": true}` trained at 1.0 and `{"max_steps": true}` ran one step. `refuse_booleans` refuses a boolean
given for a field that takes numbers (and not booleans), naming the field; both config kinds apply it.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import ConfigDict

FINITE_ONLY = ConfigDict(allow_inf_nan=False)


def require_finite(name: str, value: float) -> float:
    """`value` when it is a finite number; ValueError naming `name` and the value otherwise."""
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def check_finite_fields(obj, where: str):
    """`obj` (a dataclass, e.g. a method's model config) when every float field is finite; ValueError naming
    `where.<field>` and the value otherwise."""
    import dataclasses

    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float):
            require_finite(f"{where}.{f.name}", value)
    return obj


def _takes_numbers_not_booleans(tp: Any) -> tuple[bool, Any]:
    """(whether a boolean given for annotation `tp` would be read as a number, the item annotation of a tuple/list)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        found = [_takes_numbers_not_booleans(a) for a in typing.get_args(tp)]
        if any(a is bool for a in typing.get_args(tp)):
            return False, None
        return any(f[0] for f in found), next((f[1] for f in found if f[1] is not None), None)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return False, args[0] if args else None
    if origin is typing.Annotated:
        return _takes_numbers_not_booleans(typing.get_args(tp)[0])
    return tp in (int, float), None


def refuse_booleans(annotations: Mapping[str, Any], data: Any, where: str) -> None:
    """Refuse a boolean given for a field whose annotation takes numbers and not booleans (or a list of them).

    Args:
        annotations: field name → its (resolved) type annotation.
        data: the raw input (a mapping of field values; anything else is left to the validation).
        where: the config's name, for the message.

    Raises:
        ValueError: naming `where.<field>` and the value.
    """
    if not isinstance(data, Mapping):
        return
    for name, value in data.items():
        if name not in annotations:
            continue
        number, item = _takes_numbers_not_booleans(annotations[name])
        if number and isinstance(value, bool):
            raise ValueError(f"{where}.{name} takes a number, got the boolean {str(value).lower()}")
        if item is not None and isinstance(value, (list, tuple)) and _takes_numbers_not_booleans(item)[0]:
            if any(isinstance(v, bool) for v in value):
                raise ValueError(f"{where}.{name} takes numbers, got a boolean in {list(value)}")
