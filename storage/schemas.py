"""Explicit Parquet schemas of every dataset kind.

Token and corruption tables are long-form, keyed by (id, column): `column` names the source text
column (`text` for Wiki1M; `sent0`, `sent1`, `hard_neg` for NLI).
"""

from __future__ import annotations

import pyarrow as pa

WIKI1M = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
    ]
)

NLI = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("sent0", pa.string(), nullable=False),
        pa.field("sent1", pa.string(), nullable=False),
        pa.field("hard_neg", pa.string(), nullable=False),
    ]
)

TEXT_COLUMNS = {"wiki1m": ("text",), "nli": ("sent0", "sent1", "hard_neg")}

STS = pa.schema(
    [
        pa.field("task", pa.string(), nullable=False),  # sts12..sts16, stsb, sickr
        pa.field("subset", pa.string(), nullable=False),  # e.g. MSRpar; "all" for STS-B / SICK
        pa.field("split", pa.string(), nullable=False),  # test | dev | train
        pa.field("pair_index", pa.int32(), nullable=False),  # line order within (task, subset, split)
        pa.field("sentence1", pa.string(), nullable=False),
        pa.field("sentence2", pa.string(), nullable=False),
        pa.field("score", pa.float64(), nullable=False),
    ]
)

TOKENS = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("column", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("length", pa.int16(), nullable=False),
    ]
)

CORRUPTION = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("column", pa.string(), nullable=False),
        pa.field("variant", pa.int16(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("corrupted_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("labels", pa.list_(pa.int8()), nullable=False),  # 1 = replaced (corrupted != original)
        pa.field("n_masked", pa.int16(), nullable=False),
        pa.field("n_replaced", pa.int16(), nullable=False),
    ]
)
