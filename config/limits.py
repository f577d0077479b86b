"""How large and how deep a parameter may be, and how much of a value an error message shows.

A parameter holds settings (a preset's overrides, a stage's config), never data. So a parameter nested deeper than
`MAX_DEPTH` levels or longer than `MAX_CHARS` characters of JSON is refused by name before anything uses it: the
`cse run` command line (`cse.ops.deployments.parse_params`), a training job's `overrides`
(`cse.config.training.resolve_train_config`) and a deployment run's nested parameters
(`cse.flows.deployment_params.deployment_merged`). Without this, a 900-level value raised a `RecursionError` naming
no parameter, and a 10 MB one was echoed whole by the errors about it.

Error messages show a value or a list of names cut to `MESSAGE_CHARS` characters (`cut`), saying how long it was.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

MAX_DEPTH = 32  # the deepest configuration is 4 levels (overrides → ingest → wiki → hf)
MAX_CHARS = 1_000_000  # characters of a parameter's JSON text
MESSAGE_CHARS = 200  # characters of a value an error message shows


class ParameterRefused(ValueError):
    """A parameter too deep or too large to be settings: refused by name."""


def cut(text: object, limit: int = MESSAGE_CHARS) -> str:
    """`text` (its `str`) when at most `limit` characters, else its head and how long it was.

    Examples:
        >>> from cse.config.limits import cut
        >>> cut("x" * 500, 10)
        'xxxxxxxxxx… (500 characters)'
    """
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,d} characters)"


def nesting_depth(value: Any) -> int:
    """How many levels of mappings and lists `value` holds (0 for a scalar), counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
        if depth + 1 > MAX_DEPTH:  # deep enough to refuse: no need to walk the rest
            return depth + 1
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_parameter(name: str, value: Any, chars: int | None = None) -> Any:
    """`value` when it is nested at most `MAX_DEPTH` levels and its JSON is at most `MAX_CHARS` characters;
    `ParameterRefused` naming `name` otherwise.

    Args:
        name: the parameter's name, for the message.
        value: the parameter's value (parsed).
        chars: the length of its JSON text when known (the command line's), else measured.
    """
    if (depth := nesting_depth(value)) > MAX_DEPTH:
        raise ParameterRefused(
            f"parameter {name!r} is nested {'more than ' if depth == MAX_DEPTH + 1 else ''}{MAX_DEPTH} levels deep; "
            f"at most {MAX_DEPTH} are accepted (a parameter holds settings, the deepest of which are 4 levels)"
        )
    if chars is None:
        chars = len(json.dumps(value, default=str))
    if chars > MAX_CHARS:
        raise ParameterRefused(
            f"parameter {name!r} is {chars:,d} characters of JSON; at most {MAX_CHARS:,d} are accepted (a parameter "
            "holds settings, not data: point at a file or dataset instead)"
        )
    return value
