"""The "did you mean" hint: the closest known name to a misspelt one, for the messages that refuse a name (config
keys, presets, methods, deployments)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: object, known: Iterable[object]) -> str | None:
    """The known name most like `name` (difflib's ratio at least 0.6), or None.

    Examples:
        >>> from cse.config.suggest import closest
        >>> closest("learning_rat", ["batch_size", "learning_rate"])
        'learning_rate'
        >>> closest("xyz", ["batch_size"]) is None
        True
    """
    found = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(names: Iterable[object], known: Iterable[object]) -> str:
    """` (did you mean 'x'?)` naming the closest known name of each of `names` that has one; "" when none has.

    Examples:
        >>> from cse.config.suggest import did_you_mean
        >>> did_you_mean(["learning_rat", "zzz"], ["learning_rate", "seed"])
        " (did you mean 'learning_rate'?)"
    """
    known = list(known)
    longest = max((len(str(k)) for k in known), default=0)
    # at most the first ten names, and none far longer than every known name (a 10 MB key is no misspelling)
    names = [n for n in list(names)[:10] if len(str(n)) <= 2 * longest + 10]
    pairs = [(n, c) for n in names if (c := closest(n, known)) is not None]
    if not pairs:
        return ""
    if len(pairs) == 1:
        return f" (did you mean {pairs[0][1]!r}?)"
    return " (did you mean " + ", ".join(f"{c!r} for {n!r}" for n, c in pairs) + "?)"
