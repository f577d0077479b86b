"""Finite numbers only: the one rule every configuration model follows.

`inf` and `nan` are never meaningful parameter values (a learning rate of `inf` trains a NaN model), so every
pydantic configuration (`cse.config.stages._Config`, and through it every stage, training and evaluation config) and
every method's typed model config (a frozen dataclass of `models/`, checked by `check_finite_fields` in
`cse.config.methods`) refuses them; `require_finite` is the same rule for one number.
"""

from __future__ import annotations

import math

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
