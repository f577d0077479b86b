"""Non-finite tensors, found and named: the one description every check of loaded weights and states uses.

A tensor holding `nan` or `inf` is named with how many of its values are non-finite and, for a matrix, its first
rows (`word_embeddings.weight (192 of 976,896 values, rows 1010, 1012, 1996, 1997, 1998 …)`): a backbone before
training (`cse.training.job.require_finite_weights`), the corruption generator when it is loaded
(`cse.models.generator_cache`), a resume state when it is read (`cse.training.state_writer.require_finite_state`).

Examples:
    >>> import torch
    >>> m = torch.zeros(4, 3)
    >>> m[2, 1] = float("inf")
    >>> non_finite_tensors([("m", m), ("v", torch.ones(2)), ("ids", torch.arange(3))])
    ['m (1 of 12 values, rows 2)']
    >>> non_finite_tensors(nested_tensors({"state": {0: {"exp_avg": m, "step": torch.tensor(1.0)}}}, "optimizer"))
    ['optimizer.state.0.exp_avg (1 of 12 values, rows 2)']
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

SHOWN = 5  # tensors named in a message, and rows named per tensor


class NonFiniteWeights(ValueError):
    """A model holds `nan`/`inf` weights as loaded (a backbone, a corruption generator): refused before it is used."""


def non_finite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """`name (n of m values[, rows …])` for each floating-point tensor of `named` holding a `nan` or `inf`.

    Args:
        named: (name, tensor) pairs, e.g. `model.named_parameters()` or `nested_tensors(state)`.

    Returns:
        One description per non-finite tensor, in the order given; a matrix also names its first `SHOWN` rows
        holding a non-finite value.
    """
    found = []
    for name, t in named:
        if not t.is_floating_point() or bool(torch.isfinite(t).all()):
            continue
        bad = ~torch.isfinite(t.detach())
        where = ""
        if t.dim() == 2:
            rows = bad.any(dim=1).nonzero().flatten().tolist()
            where = f", rows {', '.join(map(str, rows[:SHOWN]))}{' …' if len(rows) > SHOWN else ''}"
        found.append(f"{name} ({int(bad.sum()):,d} of {t.numel():,d} values{where})")
    return found


def listed(found: list[str]) -> str:
    """The first `SHOWN` descriptions of `non_finite_tensors`, `; `-joined, and how many more there are."""
    more = len(found) - SHOWN
    return "; ".join(found[:SHOWN]) + (f" and {more} more tensors" if more > 0 else "")


def nested_tensors(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors inside mappings, lists and tuples (an optimizer's `state_dict()`), named by their dotted path from
    `prefix` (from the top when it is empty); anything else is skipped."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (dict, list, tuple)):
        for k, v in obj.items() if isinstance(obj, dict) else enumerate(obj):
            yield from nested_tensors(v, f"{prefix}.{k}" if prefix else str(k))


def require_finite_model(model: torch.nn.Module, subject: str, refused: str) -> None:
    """Refuse a model with a non-finite parameter or buffer, naming each tensor and, for a matrix, its first rows.

    Args:
        model: the model as loaded or built.
        subject: what it is, for the message (`generator 'distilbert-base-uncased'`).
        refused: the sentence saying what was refused and what to do.

    Raises:
        NonFiniteWeights: `<subject> holds non-finite (nan/inf) weights: <tensors>. <refused>`.
    """
    if found := non_finite_tensors((*model.named_parameters(), *model.named_buffers())):
        raise NonFiniteWeights(f"{subject} holds non-finite (nan/inf) weights: {listed(found)}. {refused}")
