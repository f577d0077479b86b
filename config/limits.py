r"""How large and how deep a parameter may be, and how much of a value an error message shows.

A parameter holds settings (a preset's overrides, a stage's config), never data. So a parameter nested deeper than
`MAX_DEPTH` levels or longer than `MAX_CHARS` characters of JSON is refused by name before anything uses it: the
`cse run` command line (`cse.ops.deployments.parse_params`), a training job's `overrides`
(`cse.config.training.resolve_train_config`) and a deployment run's nested parameters
(`cse.flows.deployment_params.deployment_merged`). Without this, a 900-level value raised a `RecursionError` naming
no parameter, and a 10 MB one was echoed whole by the errors about it.

Error messages show a value or a list of names cut to `MESSAGE_CHARS` characters (`cut`), saying how long it was.
Whatever a message echoes of what it was given (an argument, a path, a key, SQL a library quotes back) is shown by
one rule, `echo`: as it is when short and printable, else like a `repr` (quoted, control characters, ANSI escape
sequences and other characters a terminal would obey written as escapes: `\n`, `\x1b`, `\u202e`) and cut. `one_line`
applies it to a whole message, knowing the values that were given: every line `cse` prints about a value passes it
(`cse.ops.cli`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

MAX_DEPTH = 32  # the deepest configuration is 4 levels (overrides → ingest → wiki → hf)
MAX_CHARS = 1_000_000  # characters of a parameter's JSON text
MESSAGE_CHARS = 200  # characters of a value an error message shows
LONG_RUN_CHARS = 1_000  # a run of this many non-blank characters in a message is a value echoed whole: cut
LINE_CHARS = 4_000  # characters of a one-line message, at most (a list of many names, cut)


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


def escaped(text: str) -> str:
    r"""`text` with every character that is not printable written as `repr` writes it (`\n`, `\x1b`, `\u202e`):
    control characters (ASCII and C1), the ESC of an ANSI escape sequence, format characters such as a right-to-left
    override; the rest as it is, unquoted."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii") for c in text
    )


def echo(value: object, limit: int = MESSAGE_CHARS) -> str:
    r"""How a message shows a value it was given: as it is when printable and at most `limit` characters, else like a
    `repr` (quoted, characters that are not printable escaped), cut to `limit` characters saying how long it was.

    Examples:
        >>> from cse.config.limits import echo
        >>> echo("/data/runs/simcse/k1")
        '/data/runs/simcse/k1'
        >>> print(echo("/tmp/a\x1b[31mred\nb"))
        '/tmp/a\x1b[31mred\nb'
        >>> print(echo("x" * 500, 10))
        'xxxxxxxxxx'… (500 characters)
    """
    text = str(value)
    if len(text) <= limit and text.isprintable():
        return text
    return repr(text[:limit]) + (f"… ({len(text):,d} characters)" if len(text) > limit else "")


def one_line(message: object, echoed: Iterable[str] = (), limit: int = MESSAGE_CHARS) -> str:
    """`message` made one printable line of bounded length: every value of `echoed` (what the user gave: command-line
    arguments) that it holds, as given or as its `repr`, shown by `echo`; runs of whitespace made one space; any other
    character that is not printable escaped (`escaped`); a run of more than `LONG_RUN_CHARS` non-blank characters
    (a part of a value that a library quoted back) cut to `limit`; the line cut at `LINE_CHARS`.

    Args:
        message: an error message or a line about a value (its `str`).
        echoed: the values given, which the message may quote.
        limit: how many characters of a value are shown.
    """
    text = str(message)
    for value in sorted({v for v in echoed if v and (len(v) > limit or not v.isprintable())}, key=len, reverse=True):
        for form in (repr(value), value):
            if form in text:
                text = text.replace(form, echo(value, limit))
    text = escaped(" ".join(text.split()))
    text = re.sub(rf"\S{{{LONG_RUN_CHARS + 1},}}", lambda m: cut(m.group(), limit), text)
    return cut(text, LINE_CHARS)


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
