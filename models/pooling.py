"""Sentence poolers over a transformer's outputs, as SimCSE, DiffCSE, DCPCSE and DiffAug define them.

| name | embedding |
|---|---|
| `cls` | last-layer state at position 0, then an MLP (`Linear + tanh`); for a plain HF model the MLP is the backbone's pretrained pooler, as in SimCSE's exported checkpoints |
| `cls_before_pooler` | last-layer state at position 0 |
| `avg` | masked mean of the last layer (pads excluded) |
| `avg_first_last` | masked mean of (first + last) / 2; "first" = `hidden_states[first_layer]` (0 = embedding output as the `voidism/DiffCSE` and `YJiangcm/DCPCSE` code, 1 = first transformer layer as `princeton-nlp/SimCSE`'s current code) |
| `avg_top2` | masked mean of (last + second-last) / 2 |
| `mask` | last-layer state at the first `[MASK]` token of each row (prompt templates, DiffAug) |

Masks passed here are token-only masks (no prefix slots).

References: Gao, Yao, Chen (2021), *SimCSE: Simple Contrastive Learning of Sentence Embeddings* (section 6.3,
pooling methods); Wang and Lu (2022), *Differentiable Data Augmentation for Contrastive Sentence Representation
Learning* (the `[MASK]` state of a prompt template).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

POOLERS: tuple[str, ...] = ("cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2", "mask")
FIRST_LAYER_CHOICES = (0, 1)


class UnknownPoolerError(ValueError):
    """A pooler name outside `POOLERS`."""


def check_pooler(name: str) -> str:
    """The pooler name, checked.

    Args:
        name: one of `POOLERS`.

    Returns:
        `name` unchanged.

    Raises:
        UnknownPoolerError: `name` is not a known pooler; the message lists the known ones.
    """
    if name not in POOLERS:
        raise UnknownPoolerError(f"unknown pooler {name!r}; known: {', '.join(POOLERS)}")
    return name


def needs_hidden_states(name: str) -> bool:
    """Whether the pooler reads intermediate layers, so the encoder must run with `output_hidden_states=True`.

    Args:
        name: one of `POOLERS`.

    Examples:
        >>> from cse.models.pooling import needs_hidden_states
        >>> needs_hidden_states("avg_first_last"), needs_hidden_states("cls")
        (True, False)
    """
    return check_pooler(name) in ("avg_first_last", "avg_top2")


def masked_mean(states: Tensor, attention_mask: Tensor) -> Tensor:
    """The mean over the positions where `attention_mask` is 1: `[B, T, d]` → `[B, d]`.

    Args:
        states: `(B, T, d)` token states.
        attention_mask: `(B, T)`, 1 on the tokens to average (a row without any gives zeros).

    Examples:
        >>> import torch
        >>> from cse.models.pooling import masked_mean
        >>> states = torch.tensor([[[1.0], [3.0], [100.0]]])
        >>> masked_mean(states, torch.tensor([[1, 1, 0]]))
        tensor([[2.]])
    """
    m = attention_mask.to(states.dtype).unsqueeze(-1)
    return (states * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)


def mask_token_states(last: Tensor, input_ids: Tensor, mask_token_id: int) -> Tensor:
    """The state at the first `mask_token_id` of every row (DiffAug's prompt-template pooling).

    Args:
        last: `(B, T, d)` last-layer states.
        input_ids: `(B, T)` token ids.
        mask_token_id: the tokenizer's mask token id.

    Raises:
        ValueError: a row holds no mask token; the message counts them.
    """
    is_mask = input_ids == mask_token_id
    has = is_mask.any(dim=1)
    if not bool(has.all()):
        missing = int((~has).sum())
        raise ValueError(
            f"pooler 'mask': {missing} of {len(has)} inputs contain no [MASK] token (id {mask_token_id}); "
            "use a prompt template that contains the tokenizer's mask token"
        )
    first = is_mask.to(torch.int8).argmax(dim=1)
    return last[torch.arange(last.shape[0], device=last.device), first]


def pool(
    name: str,
    last_hidden_state: Tensor,
    attention_mask: Tensor,
    *,
    hidden_states: Sequence[Tensor] | None = None,
    input_ids: Tensor | None = None,
    mask_token_id: int | None = None,
    mlp: nn.Module | None = None,
    first_layer: int = 0,
) -> Tensor:
    """Pool a transformer's outputs into one vector per sentence with pooler `name` (see the table above).

    Args:
        name: one of `POOLERS`.
        last_hidden_state: `(B, T, d)` last-layer states.
        attention_mask: `(B, T)` token mask (no prefix slots).
        hidden_states: every layer's states including the embedding output, in Hugging Face order; needed by
            `avg_first_last` and `avg_top2`.
        input_ids: `(B, T)` token ids; needed by `mask`.
        mask_token_id: the tokenizer's mask token id; needed by `mask`.
        mlp: the `cls` pooler's MLP (`Linear + tanh`, e.g. `cse.models.heads.SimCSEPoolerMLP`); needed by `cls`.
        first_layer: which layer `avg_first_last` calls "first": 0 (embedding output) or 1.

    Returns:
        `(B, d)` sentence embeddings.

    Raises:
        UnknownPoolerError: `name` is not a known pooler.
        ValueError: an input the pooler needs is missing, or `first_layer` is not 0 or 1.

    Examples:
        >>> import torch
        >>> from cse.models.pooling import pool
        >>> states = torch.arange(12.0).reshape(1, 3, 4)
        >>> pool("cls_before_pooler", states, torch.ones(1, 3))
        tensor([[0., 1., 2., 3.]])
        >>> pool("avg", states, torch.tensor([[1, 1, 0]]))
        tensor([[2., 3., 4., 5.]])
    """
    check_pooler(name)
    if name in ("cls", "cls_before_pooler"):
        cls = last_hidden_state[:, 0]
        if name == "cls_before_pooler":
            return cls
        if mlp is None:
            raise ValueError("pooler 'cls' needs an MLP (Linear + tanh); none given")
        return mlp(cls)
    if name == "avg":
        return masked_mean(last_hidden_state, attention_mask)
    if name == "mask":
        if input_ids is None or mask_token_id is None:
            raise ValueError("pooler 'mask' needs input_ids and the tokenizer's mask_token_id")
        return mask_token_states(last_hidden_state, input_ids, mask_token_id)
    if hidden_states is None or len(hidden_states) < 3:
        raise ValueError(f"pooler {name!r} needs all hidden states (output_hidden_states=True, at least 2 layers)")
    if name == "avg_first_last":
        if first_layer not in FIRST_LAYER_CHOICES:
            raise ValueError(f"first_layer must be one of {FIRST_LAYER_CHOICES}, got {first_layer}")
        return masked_mean((hidden_states[first_layer] + hidden_states[-1]) / 2.0, attention_mask)
    return masked_mean((hidden_states[-1] + hidden_states[-2]) / 2.0, attention_mask)  # avg_top2
