"""Padding token id sequences into tensors, and the training batch every method consumes (pure torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch


def pad_sequences(
    seqs: Sequence[np.ndarray | Sequence[int]], pad_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask), right-padded to `length` (default: the longest sequence)."""
    n = max((len(s) for s in seqs), default=0) if length is None else length
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        k = len(s)
        ids[i, :k] = torch.as_tensor(np.asarray(s, dtype=np.int64))
        mask[i, :k] = 1
    return ids, mask


def check_views(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, views: tuple[int, ...] = (2, 3), what: str = "input_ids"
) -> None:
    """Refuse rows that are not `(B, n, T)` with n in `views`, or a mask of another shape (`what` names the rows)."""
    if input_ids.dim() != 3 or input_ids.shape[1] not in views:
        raise ValueError(f"{what} must be (B, {'|'.join(map(str, views))}, T), got {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        lead = "" if what == "input_ids" else f"{what}: "
        raise ValueError(f"{lead}attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")


@dataclass
class TrainBatch:
    """One training batch of `(B, n, T)` rows: n = 2 (one sentence, two dropout views) or 3 (NLI anchor,
    entailment, contradiction). `corrupted_ids`/`rtd_labels` (1 = replaced) come from the corruption stage for
    the methods that read it; `aux` is a second batch some methods consume beside it (DiffAug's NLI batch)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    corrupted_ids: torch.Tensor | None = None
    rtd_labels: torch.Tensor | None = None
    aux: TrainBatch | None = None

    def to(self, device: torch.device) -> TrainBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        return TrainBatch(
            self.input_ids.to(device, non_blocking=True),
            self.attention_mask.to(device, non_blocking=True),
            move(self.corrupted_ids),
            move(self.rtd_labels),
            None if self.aux is None else self.aux.to(device),
        )

    def pin_memory(self) -> TrainBatch:
        """The same batch in page-locked host memory (a later `.to(cuda)` copies asynchronously)."""
        pin = lambda t: None if t is None else t.pin_memory()
        return TrainBatch(
            self.input_ids.pin_memory(),
            self.attention_mask.pin_memory(),
            pin(self.corrupted_ids),
            pin(self.rtd_labels),
            None if self.aux is None else self.aux.pin_memory(),
        )

    @property
    def n_views(self) -> int:
        return self.input_ids.shape[1]

    @property
    def sentences(self) -> int:
        return self.input_ids.shape[0] * self.input_ids.shape[1] + (0 if self.aux is None else self.aux.sentences)

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum()) + (0 if self.aux is None else self.aux.tokens)

    @overload
    def flat(self, t: torch.Tensor) -> torch.Tensor: ...

    @overload
    def flat(self, t: None) -> None: ...

    def flat(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """`(B, n, T)` → `(B·n, T)`."""
        return None if t is None else t.reshape(-1, t.shape[-1])
