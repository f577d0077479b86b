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

# One row per evaluation (dataset kind "evaluations", one dataset per evaluation). STS scores are
# Spearman ×100, transfer scores accuracy ×100 (null when not computed in that mode); `details` holds the full
# result as JSON.
EVALUATIONS = pa.schema(
    [
        pa.field("evaluation_id", pa.string(), nullable=False),
        pa.field("created", pa.string(), nullable=False),  # ISO 8601 UTC
        pa.field("mode", pa.string(), nullable=False),  # test | dev
        pa.field("label", pa.string(), nullable=False),
        pa.field("model", pa.string()),
        pa.field("pooler", pa.string()),
        pa.field("checkpoint", pa.string()),
        pa.field("method", pa.string()),
        pa.field("mlflow_run_id", pa.string()),
        # a training job's test evaluation: the evaluation id of its backbone's score before training (added later:
        # absent from older files, read as null through the `_all` views)
        pa.field("backbone_evaluation", pa.string()),
        pa.field("sts_source", pa.string(), nullable=False),  # dataset key or folder
        pa.field("sts_hash", pa.string(), nullable=False),
        *[pa.field(t, pa.float64()) for t in ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr", "sts_avg")],
        pa.field("sts_avg_pearson", pa.float64()),
        pa.field("stsb_dev", pa.float64()),
        pa.field("sickr_dev", pa.float64()),
        pa.field("retrieval_match", pa.string()),
        *[pa.field(f"retrieval_r{k}", pa.float64()) for k in (1, 3, 5, 10)],
        pa.field("alignment", pa.float64()),
        pa.field("uniformity", pa.float64()),
        # mode "transfer": SentEval transfer accuracies ×100 (null otherwise); sts_source / sts_hash then name the
        # transfer input (`transfer:<origin>:<location>`, hash of its files)
        *[pa.field(t, pa.float64()) for t in ("mr", "cr", "subj", "mpqa", "sst2", "trec", "mrpc", "transfer_avg")],
        pa.field("mrpc_f1", pa.float64()),
        pa.field("transfer_devacc_avg", pa.float64()),
        pa.field("sentences", pa.int64(), nullable=False),
        pa.field("seconds", pa.float64(), nullable=False),
        pa.field("details", pa.string(), nullable=False),  # the full result, JSON
    ]
)


# One comparison (flow `compare`) in long form: a value per (table, row, metric). `row_kind` says whether the
# row is one of our runs, its backbone's own score before training, the papers' published number, or their difference
# (run − published).
COMPARISONS = pa.schema(
    [
        pa.field("comparison_id", pa.string(), nullable=False),
        pa.field("created", pa.string(), nullable=False),
        pa.field("table", pa.string(), nullable=False),  # sts | retrieval | align_uniform | parameters | transfer
        pa.field("row_kind", pa.string(), nullable=False),  # run | backbone (before training) | published | difference
        pa.field("label", pa.string(), nullable=False),
        pa.field("method", pa.string()),
        pa.field("backbone", pa.string()),
        pa.field("setting", pa.string()),
        pa.field("mlflow_run_id", pa.string()),
        pa.field("source", pa.string()),
        pa.field("metric", pa.string(), nullable=False),
        pa.field("value", pa.float64()),
    ]
)
