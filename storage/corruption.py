"""The rows of a corruption dataset (schema `cse.storage.schemas.CORRUPTION`), assembled from a tokens shard and the
corruptor's output.

Every input row × variants, in input order (row i variant 0..V-1, then row i+1): `id`, `column`, `variant`, the
original `input_ids`, the `corrupted_ids`, the `labels` (1 where the corrupted id differs) and the per-row counts
`n_masked`, `n_replaced`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def token_lists(input_ids: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column of token ids as (the concatenated ids, where each row starts: int64 offsets of length n + 1).

    Args:
        input_ids: the `input_ids` column of a tokens table.
    """
    flat = pc.list_flatten(input_ids).to_numpy()
    offsets = np.concatenate([[0], np.cumsum(pc.list_value_length(input_ids).to_numpy())]).astype(np.int64)
    return flat, offsets


def _list_array(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, value_type))


def corruption_rows(tokens: pa.Table, flat: np.ndarray, offsets: np.ndarray, variants: Sequence[Any]) -> pa.Table:
    """The corruption rows of a tokens shard: each input row × `len(variants)`, in input order.

    Args:
        tokens: the shard's tokens rows (`id`, `column`, `input_ids`).
        flat, offsets: its `input_ids` as `token_lists` gives them.
        variants: one corruption of the rows per variant, each with the arrays `corrupted`, `labels` (flat, in the
            order of `flat`), `n_masked` and `n_replaced` (one per row): `cse.models.corruption.SequenceCorruption`.
    """
    n = tokens.num_rows
    originals = _list_array(offsets, flat, pa.int32())
    tables = [
        pa.table(
            {
                "id": tokens.column("id"),
                "column": tokens.column("column"),
                "variant": pa.array(np.full(n, v), pa.int16()),
                "input_ids": originals,
                "corrupted_ids": _list_array(offsets, out.corrupted, pa.int32()),
                "labels": _list_array(offsets, out.labels, pa.int8()),
                "n_masked": pa.array(out.n_masked, pa.int16()),
                "n_replaced": pa.array(out.n_replaced, pa.int16()),
            }
        )
        for v, out in enumerate(variants)
    ]
    interleave = np.arange(n * len(variants)).reshape(len(variants), n).T.ravel()  # row i, variants 0..V-1, row i+1
    return pa.concat_tables(tables).take(pa.array(interleave))
