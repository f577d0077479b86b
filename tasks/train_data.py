"""Training batches from the token and corruption datasets.

Unsupervised rows hold one sentence used twice (two dropout views); supervised rows hold
(anchor, entailment, contradiction). Each view reads its own corruption variant:
view v of epoch e uses variant (e·n_views + v) mod `variants`, so with 2·epochs variants every
view of every epoch gets a fresh corruption, as DiffCSE's on-the-fly generation does; with one
variant both views (and all epochs) share it. The choice is logged as `corruption_reuse`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from models.batching import pad_sequences
from storage.training_data import CorruptionRows, TokenRows


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, n_views, T)
    attention_mask: torch.Tensor  # (B, n_views, T)
    corrupted_ids: torch.Tensor  # (B, n_views, T)
    rtd_labels: torch.Tensor  # (B, n_views, T), 1 = replaced

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in (self.input_ids, self.attention_mask, self.corrupted_ids, self.rtd_labels)))

    @property
    def sentences(self) -> int:
        return self.input_ids.shape[0] * self.input_ids.shape[1]

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())


class TrainingRows:
    def __init__(self, tokens: TokenRows, corruption: CorruptionRows, supervised: bool, pad_id: int):
        self.tokens, self.corruption, self.pad_id = tokens, corruption, pad_id
        self.view_columns = tokens.columns if supervised else (tokens.columns[0],) * 2

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_views(self) -> int:
        return len(self.view_columns)

    def variant(self, epoch: int, view: int) -> int:
        return (epoch * self.n_views + view) % self.corruption.variants

    def reuse_description(self, epochs: int) -> str:
        needed, have = self.n_views * epochs, self.corruption.variants
        if have >= needed:
            return "fresh corruption for every view of every epoch"
        if have == 1:
            return "one corruption per sentence, shared by all views and epochs"
        return f"{have} variants cycled over {needed} view-epochs"

    def batch(self, rows: np.ndarray, epoch: int) -> Batch:
        views_ids, views_cor, views_lab = [], [], []
        for v, col in enumerate(self.view_columns):
            var = self.variant(epoch, v)
            views_ids.append([self.tokens.seqs[col][i] for i in rows])
            views_cor.append([self.corruption.corrupted[(col, var)][i] for i in rows])
            views_lab.append([self.corruption.labels[(col, var)][i] for i in rows])
        length = max(len(s) for view in views_ids for s in view)
        ids, mask, cor, lab = [], [], [], []
        for v in range(self.n_views):
            i, m = pad_sequences(views_ids[v], self.pad_id, length)
            c, _ = pad_sequences(views_cor[v], self.pad_id, length)
            lb, _ = pad_sequences(views_lab[v], 0, length)
            ids.append(i), mask.append(m), cor.append(c), lab.append(lb)
        return Batch(torch.stack(ids, 1), torch.stack(mask, 1), torch.stack(cor, 1), torch.stack(lab, 1))


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Random row order of one epoch, a pure function of (seed, epoch) so a resumed run sees the same."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).numpy()
