"""Position-0 replacement (DiffCSE step 5, the conditioning vector of the CRTD discriminator and D2CSE's [CLS]
prompt): the first encoder layer takes the `cse_position0` argument where the family hands the model's kwargs to its
layers (`Position0Input`, mixed into the layer classes once), else a forward hook on the embeddings
(`replace_position0_output`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from cse.models.prompts.packing import PackedPosition0

POSITION0_KWARG = "cse_position0"


def _with_position0(hidden_states: torch.Tensor, vectors: torch.Tensor | PackedPosition0) -> torch.Tensor:
    """`hidden_states` `(B', T, d)` with position 0 replaced by `vectors` `(B', d)` (DiffCSE step 5); in a packed pass
    `(1, N, d)` with the slots at position 0 replaced by a `PackedPosition0`'s values."""
    if isinstance(vectors, PackedPosition0):
        return torch.where(vectors.first, vectors.values.to(hidden_states.dtype), hidden_states)
    return torch.cat([vectors.unsqueeze(1).to(hidden_states.dtype), hidden_states[:, 1:]], dim=1)


class Position0Input:
    """Mixed into the class of every encoder layer of a `PromptedBackbone` whose family passes the model's kwargs to
    its layers (`EncoderFamily.layer_kwargs`): the layer takes the `cse_position0` argument off its kwargs, and the
    first layer (`_cse_first`) replaces position 0 of its input with it. Set once when the backbone is wrapped, so a
    conditioned pass registers nothing per call (a compiled step has no hook to trace). Parameters and state-dict names
    are the layer's own."""

    _cse_first = False

    def forward(self, hidden_states, *args, **kwargs):
        vectors = kwargs.pop(POSITION0_KWARG, None)
        if vectors is not None and self._cse_first:
            hidden_states = _with_position0(hidden_states, vectors)
        return super().forward(hidden_states, *args, **kwargs)


_POSITION0_CLASSES: dict[type, type] = {}


def position0_class(cls: type) -> type:
    """`cls` with `Position0Input` mixed in (one class per layer class)."""
    if issubclass(cls, Position0Input):
        return cls
    if cls not in _POSITION0_CLASSES:
        _POSITION0_CLASSES[cls] = type(cls.__name__, (Position0Input, cls), {"__module__": cls.__module__})
    return _POSITION0_CLASSES[cls]


@contextmanager
def replace_position0_output(embeddings: nn.Module, vectors: torch.Tensor) -> Iterator[None]:
    """While active, the embedding module's output at position 0 is `vectors` (B', d) (DiffCSE step 5,
    docs/methods-overview.md): the route of the families whose layers get no kwargs (MPNet, DeBERTa-v2/v3)."""

    def hook(module, args, output):
        return _with_position0(output, vectors)

    handle = embeddings.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
