"""Padding token id sequences into tensors (pure torch)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def pad_sequences(seqs: Sequence[np.ndarray | Sequence[int]], pad_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask), right-padded to `length` (default: the longest sequence)."""
    n = max((len(s) for s in seqs), default=0) if length is None else length
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        k = len(s)
        ids[i, :k] = torch.as_tensor(np.asarray(s, dtype=np.int64))
        mask[i, :k] = 1
    return ids, mask
