"""Reading pre-tokenised text and corruption shards back as aligned arrays for training."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc

from storage.datasets import read_dataset
from storage.layout import DataRoot


@dataclass
class TokenRows:
    """Token id sequences of one dataset, row-aligned: `seqs[column][i]` belongs to `ids[i]`."""

    ids: np.ndarray
    seqs: dict[str, list[np.ndarray]]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(self.seqs)


def _lists(column) -> list[np.ndarray]:
    """A list<int32> Arrow column → one int64 numpy array per row (zero-copy slices of one buffer)."""
    col = column.combine_chunks()
    flat = col.values.to_numpy().astype(np.int64)
    offsets = col.offsets.to_numpy()
    return [flat[offsets[i]:offsets[i + 1]] for i in range(len(col))]


def load_token_rows(root: DataRoot, key: str, columns: tuple[str, ...], limit: int | None = None) -> TokenRows:
    table = read_dataset(root, "tokens", key, columns=["id", "column", "input_ids"])
    seqs: dict[str, list[np.ndarray]] = {}
    ids = None
    for c in columns:
        part = table.filter(pc.equal(table.column("column"), c))
        if part.num_rows == 0:
            raise ValueError(f"tokens dataset {key} has no column {c!r}")
        part = part.sort_by("id")
        if limit is not None:
            part = part.slice(0, limit)
        col_ids = part.column("id").to_numpy()
        if ids is None:
            ids = col_ids
        elif not np.array_equal(ids, col_ids):
            raise ValueError(f"tokens dataset {key}: columns are not row-aligned")
        seqs[c] = _lists(part.column("input_ids"))
    return TokenRows(ids=ids, seqs=seqs)


@dataclass
class CorruptionRows:
    """Corrupted sequences and labels per (column, variant), aligned to a TokenRows' ids."""

    variants: int
    corrupted: dict[tuple[str, int], list[np.ndarray]]
    labels: dict[tuple[str, int], list[np.ndarray]]


def load_corruption_rows(root: DataRoot, key: str, tokens: TokenRows) -> CorruptionRows:
    table = read_dataset(root, "corruption", key, columns=["id", "column", "variant", "input_ids", "corrupted_ids", "labels"])
    variants = int(pc.max(table.column("variant")).as_py()) + 1
    corrupted, labels = {}, {}
    for c in tokens.columns:
        for v in range(variants):
            part = table.filter(pc.and_(pc.equal(table.column("column"), c), pc.equal(table.column("variant"), v))).sort_by("id")
            part_ids = part.column("id").to_numpy()
            pos = np.searchsorted(part_ids, tokens.ids)
            if len(part_ids) == 0 or np.any(pos >= len(part_ids)) or not np.array_equal(part_ids[pos], tokens.ids):
                raise ValueError(f"corruption dataset {key} lacks rows of column {c!r}, variant {v}")
            part = part.take(pos)
            originals = _lists(part.column("input_ids"))
            if any(not np.array_equal(a, b) for a, b in zip(originals[:64], tokens.seqs[c][:64])):
                raise ValueError(f"corruption dataset {key} was made from other token ids than the training tokens")
            corrupted[(c, v)] = _lists(part.column("corrupted_ids"))
            labels[(c, v)] = _lists(part.column("labels"))
    return CorruptionRows(variants=variants, corrupted=corrupted, labels=labels)
