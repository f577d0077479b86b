"""Reading pre-tokenised text and corruption datasets back as aligned rows for training, memory-mapped.

The rows stay in the datasets' Arrow copies (storage/arrow_copy.py), mapped into memory, never materialised: a
loader keeps only, per column (and corruption variant), the positions of its rows in the table, in id order
(8 bytes a row or fewer), and `ArrowLists` hands out a row's token ids as a numpy view into the map. The page cache
holds what batches touch, shared by every process that reads the same dataset (the ranks of a distributed job), and
the kernel can drop it again: a Wiki1M job with four corruption variants no longer holds all of them in its own
memory (README, "Training rows, memory-mapped").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cse.storage.hf import open_arrow_table
from cse.storage.layout import DataRoot


class ArrowLists(Sequence[np.ndarray]):
    """Rows of one `list<int>` column of a (memory-mapped) Arrow table, in a chosen order: `self[i]` is the token ids
    of table row `positions[i]` as a read-only numpy view into the table's buffer (nothing copied); `take(rows)` gives
    several at once; slicing gives another `ArrowLists`."""

    def __init__(self, column: pa.ChunkedArray, positions: np.ndarray):
        chunks = column.chunks
        self._column = column
        self._offsets = [c.offsets.to_numpy(zero_copy_only=True) for c in chunks]  # absolute into `values`
        self._values = [c.values.to_numpy(zero_copy_only=True) for c in chunks]
        self._starts = np.cumsum([0] + [len(c) for c in chunks])
        self._positions = positions

    def __len__(self) -> int:
        return len(self._positions)

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, i: slice) -> ArrowLists: ...

    def __getitem__(self, i: int | slice) -> np.ndarray | ArrowLists:
        if isinstance(i, slice):
            return ArrowLists(self._column, self._positions[i])
        return self.take([i])[0]

    def take(self, rows: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """The ids of rows `rows` (indices into this sequence), as numpy views."""
        pos = self._positions[np.asarray(rows, dtype=np.int64)]
        chunk = np.searchsorted(self._starts, pos, side="right") - 1
        local = pos - self._starts[chunk]
        offsets, values = self._offsets, self._values
        return [values[c][offsets[c][j] : offsets[c][j + 1]] for c, j in zip(chunk.tolist(), local.tolist())]

    def _located(self, rows: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(record batch, start in its values, length) of every row of `rows`."""
        pos = self._positions[np.asarray(rows, dtype=np.int64)]
        chunk = np.searchsorted(self._starts, pos, side="right") - 1
        local = pos - self._starts[chunk]
        starts = np.empty(len(pos), dtype=np.int64)
        ends = np.empty(len(pos), dtype=np.int64)
        for c in np.unique(chunk).tolist():
            here = chunk == c
            starts[here] = self._offsets[c][local[here]]
            ends[here] = self._offsets[c][local[here] + 1]
        return chunk, starts, ends - starts

    def lengths(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """The token counts of rows `rows`, from the offsets alone."""
        return self._located(rows)[2]

    def take_padded(self, rows: Sequence[int] | np.ndarray, length: int, pad_id: int) -> np.ndarray:
        """Rows `rows` as one `(len(rows), length)` int64 array right-padded with `pad_id`: one numpy gather per
        record batch the rows fall in (16,384 rows each in the Arrow copies), no per-row copy.

        Raises:
            ValueError: a row longer than `length`.
        """
        chunk, starts, counts = self._located(rows)
        if len(counts) and int(counts.max()) > length:
            raise ValueError(f"a row has {int(counts.max())} ids, more than the padded length {length}")
        out = np.full((len(counts), length), pad_id, dtype=np.int64)
        columns = np.arange(length)[None, :]
        for c in np.unique(chunk).tolist():
            here = chunk == c
            n = counts[here][:, None]
            values = self._values[c]
            if not len(values):
                continue
            index = np.minimum(starts[here][:, None] + np.minimum(columns, np.maximum(n - 1, 0)), len(values) - 1)
            out[here] = np.where(columns < n, values[index], pad_id)
        return out


def row_lengths(seqs: Sequence[np.ndarray], rows: Sequence[int] | np.ndarray) -> np.ndarray:
    """The token counts of rows `rows` of a row sequence (an `ArrowLists`: from its offsets, nothing read)."""
    if isinstance(seqs, ArrowLists):
        return seqs.lengths(rows)
    return np.array([len(seqs[i]) for i in rows], dtype=np.int64)


def take_padded(seqs: Sequence[np.ndarray], rows: Sequence[int] | np.ndarray, length: int, pad_id: int) -> np.ndarray:
    """Rows `rows` of a row sequence as one `(len(rows), length)` int64 array right-padded with `pad_id`
    (`ArrowLists.take_padded`; an in-memory sequence row by row).

    Raises:
        ValueError: a row longer than `length`.
    """
    if isinstance(seqs, ArrowLists):
        return seqs.take_padded(rows, length, pad_id)
    out = np.full((len(rows), length), pad_id, dtype=np.int64)
    for i, r in enumerate(rows):
        s = seqs[r]
        if len(s) > length:
            raise ValueError(f"a row has {len(s)} ids, more than the padded length {length}")
        out[i, : len(s)] = s
    return out


def take_rows(seqs: Sequence[np.ndarray], rows: Sequence[int] | np.ndarray) -> list[np.ndarray]:
    """Rows `rows` of a row sequence: an `ArrowLists` (memory-mapped) or any in-memory sequence of arrays."""
    if isinstance(seqs, ArrowLists):
        return seqs.take(rows)
    return [seqs[i] for i in rows]


@dataclass
class TokenRows:
    """Token id sequences of one dataset, row-aligned: `seqs[column][i]` belongs to `ids[i]`. The loaders give
    memory-mapped `ArrowLists`; tests and benchmarks may pass in-memory lists of arrays."""

    ids: np.ndarray
    seqs: dict[str, Sequence[np.ndarray]]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(self.seqs)


def _positions(mask: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Table positions of the rows in `mask`, in id order (int32 when the table allows: half the memory)."""
    pos = np.flatnonzero(mask)
    pos = pos[np.argsort(ids[pos], kind="stable")]
    return pos.astype(np.int32) if len(ids) < 2**31 else pos


def _equals(column: pa.ChunkedArray, value: str) -> np.ndarray:
    return pc.equal(column, value).to_numpy(zero_copy_only=False)


def load_token_rows(root: DataRoot, key: str, columns: tuple[str, ...], limit: int | None = None) -> TokenRows:
    """The rows of `columns` of tokens dataset `key`, aligned by id (the first `limit` ids when set), memory-mapped.
    ValueError when a column is missing or the columns hold different ids."""
    table = open_arrow_table(root, "tokens", key)
    if table.num_rows == 0:
        raise ValueError(
            f"tokens dataset {key} ({root.dataset_dir('tokens', key)}) has 0 rows: its source had no usable "
            "rows (ingestion refuses an empty source; rerun it)"
        )
    all_ids = table.column("id").to_numpy()
    seqs: dict[str, Sequence[np.ndarray]] = {}
    ids: np.ndarray | None = None
    for c in columns:
        pos = _positions(_equals(table.column("column"), c), all_ids)
        if len(pos) == 0:
            raise ValueError(f"tokens dataset {key} has no column {c!r}")
        if limit is not None:
            pos = pos[:limit]
        col_ids = all_ids[pos]
        if ids is None:
            ids = col_ids
        elif not np.array_equal(ids, col_ids):
            raise ValueError(f"tokens dataset {key}: columns are not row-aligned")
        seqs[c] = ArrowLists(table.column("input_ids"), pos)
    if ids is None:
        raise ValueError(f"tokens dataset {key}: no columns asked for")
    return TokenRows(ids=ids, seqs=seqs)


@dataclass
class CorruptionRows:
    """Corrupted sequences and labels per (column, variant), aligned to a TokenRows' ids."""

    variants: int
    corrupted: dict[tuple[str, int], Sequence[np.ndarray]]
    labels: dict[tuple[str, int], Sequence[np.ndarray]]


_CHECKED_ROWS = 64  # rows whose original ids are compared with the training tokens


def load_corruption_rows(root: DataRoot, key: str, tokens: TokenRows) -> CorruptionRows:
    """Corruption dataset `key`'s variants of every column of `tokens`, aligned to `tokens.ids`, memory-mapped.
    ValueError when a (column, variant) lacks rows of those ids, or when the corruption was made from other token
    ids than these (its first rows' originals differ)."""
    table = open_arrow_table(root, "corruption", key)
    if table.num_rows == 0:
        raise ValueError(f"corruption dataset {key} is empty")
    all_ids = table.column("id").to_numpy()
    all_variants = table.column("variant").to_numpy()
    variants = int(all_variants.max()) + 1
    corrupted: dict[tuple[str, int], Sequence[np.ndarray]] = {}
    labels: dict[tuple[str, int], Sequence[np.ndarray]] = {}
    for c in tokens.columns:
        in_column = _equals(table.column("column"), c)
        for v in range(variants):
            pos = _positions(in_column & (all_variants == v), all_ids)
            part_ids = all_ids[pos]
            at = np.searchsorted(part_ids, tokens.ids)
            if len(part_ids) == 0 or np.any(at >= len(part_ids)) or not np.array_equal(part_ids[at], tokens.ids):
                raise ValueError(f"corruption dataset {key} lacks rows of column {c!r}, variant {v}")
            pos = pos[at]
            head = np.arange(min(_CHECKED_ROWS, len(pos)))
            originals = ArrowLists(table.column("input_ids"), pos).take(head)
            if any(not np.array_equal(a, b) for a, b in zip(originals, take_rows(tokens.seqs[c], head))):
                raise ValueError(f"corruption dataset {key} was made from other token ids than the training tokens")
            corrupted[(c, v)] = ArrowLists(table.column("corrupted_ids"), pos)
            labels[(c, v)] = ArrowLists(table.column("labels"), pos)
    return CorruptionRows(variants=variants, corrupted=corrupted, labels=labels)
