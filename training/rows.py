"""Training batches from the token and corruption datasets.

Unsupervised rows hold one sentence used twice (two dropout views); supervised rows hold
(anchor, entailment, contradiction). Each view reads its own corruption variant of its column: a
column read by k views (k = 2 unsupervised, 1 supervised) gives its j-th view of epoch e the variant
(e·k + j) mod `variants`. With `variants = epochs·k` (`required_variants`, the training default)
every view of every epoch gets a fresh corruption, as DiffCSE's on-the-fly generation does; with one
variant all views and epochs share it. The choice is logged as `corruption_reuse`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from cse.config.training import required_variants
from cse.models.batching import TrainBatch
from cse.storage.training_data import CorruptionRows, TokenRows, row_lengths, take_padded


class TrainingRows:
    """Rows of one training dataset; `corruption` None for methods that do not read corrupted ids.

    `pad_to`: every batch is padded to this length (the job's `max_length`: one shape for every step, so a compiled
    step is one graph); None pads each batch to its longest row, as the references' collators do. Both give the same
    losses and gradients: attention masks padded keys, every pooler and loss reads masked positions only, and the
    RTD mean over padding counts the positions up to the batch's longest row (`cse.models.losses.rtd_loss`).
    """

    def __init__(
        self,
        tokens: TokenRows,
        corruption: CorruptionRows | None,
        supervised: bool,
        pad_id: int,
        pad_to: int | None = None,
    ):
        self.tokens, self.corruption, self.pad_id, self.pad_to = tokens, corruption, pad_id, pad_to
        self.view_columns = tokens.columns if supervised else (tokens.columns[0],) * 2

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_views(self) -> int:
        return len(self.view_columns)

    def variant(self, epoch: int, view: int) -> int:
        col = self.view_columns[view]
        per_column = self.view_columns.count(col)
        slot = self.view_columns[:view].count(col)
        if self.corruption is None:
            raise ValueError("rows without a corruption dataset have no corruption variants")
        return (epoch * per_column + slot) % self.corruption.variants

    def reuse_description(self, epochs: int) -> str:
        if self.corruption is None:
            return "no corruption (method does not read it)"
        needed, have = required_variants(epochs, supervised=len(set(self.view_columns)) > 1), self.corruption.variants
        if have >= needed:
            return "fresh corruption for every view of every epoch"
        if have == 1:
            return "one corruption per sentence, shared by all views and epochs"
        return f"{have} variants cycled over {needed} view-epochs"

    def batch(self, rows: np.ndarray | Sequence[int], epoch: int) -> TrainBatch:
        """Rows `rows` of epoch `epoch`, padded to `pad_to` (else to their longest view): every view's ids (and
        corrupted ids and labels) taken as one fixed-width array by one gather per record batch of the
        (memory-mapped) rows (`take_padded`), never all rows at once; the same tensors as padding row by row
        (`cse.models.batching.pad_sequences`, tests/training/test_rows.py)."""
        lengths = np.stack([row_lengths(self.tokens.seqs[col], rows) for col in self.view_columns], 1)
        longest = int(lengths.max()) if lengths.size else 0
        if self.pad_to is not None and longest > self.pad_to:
            raise ValueError(
                f"a training row has {longest} tokens, more than the batch length {self.pad_to} (max_length): "
                "the tokens dataset was made with another max_length"
            )
        length = self.pad_to or longest
        stack = lambda arrays: torch.from_numpy(np.stack(arrays, 1))
        ids = stack([take_padded(self.tokens.seqs[col], rows, length, self.pad_id) for col in self.view_columns])
        mask = torch.from_numpy((np.arange(length)[None, None, :] < lengths[:, :, None]).astype(np.int64))
        if self.corruption is None:
            return TrainBatch(ids, mask)
        cor, lab = [], []
        for v, col in enumerate(self.view_columns):
            var = self.variant(epoch, v)
            cor.append(take_padded(self.corruption.corrupted[(col, var)], rows, length, self.pad_id))
            lab.append(take_padded(self.corruption.labels[(col, var)], rows, length, 0))
        return TrainBatch(ids, mask, stack(cor), stack(lab))


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Random row order of one epoch, a pure function of (seed, epoch) so a resumed run sees the same."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).numpy()
