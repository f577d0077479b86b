"""The evaluation stage's storage: where its STS input comes from, and its Parquet output rows.

Input: an `sts` dataset key in the data root, or a SentEval folder read with `read_senteval`.
Output: one dataset of kind `evaluations` per evaluation (one row, schema `schemas.EVALUATIONS`),
so the DuckDB views `evaluations` / `evaluations_all` compare any set of runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from cse.storage import schemas
from cse.storage.catalog import refresh_catalog
from cse.storage.datasets import EvaluationInput, resolve_input, write_dataset
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest
from cse.storage.readers import read_senteval, senteval_root, senteval_source_files
from cse.storage.secrets import redact, redact_value


class StsInput(EvaluationInput):
    """STS evaluation data (`load_sts_input`)."""


def load_sts_input(spec: str | None, root: DataRoot, shared_data: Path | None = None) -> StsInput:
    """The STS table for `spec`: an existing folder (SentEval layout), else an `sts` dataset key.

    `spec=None`: `<shared_data>/senteval` when it exists, else the newest ingested `sts` dataset,
    else a FileNotFoundError saying to run the `ingest` flow.
    """
    senteval = Path(shared_data) / "senteval" if shared_data is not None else None
    where = f"{senteval} does not exist and " if senteval is not None else ""
    return resolve_input(
        root,
        "sts",
        spec,
        cls=StsInput,
        read_folder=lambda f: (read_senteval(f)[0], senteval_root(f), senteval_source_files(f)),
        verify=True,
        default=lambda from_folder: from_folder(senteval) if senteval is not None and senteval.is_dir() else None,
        no_default=lambda data_root: (
            f"no STS data: {where}no `sts` dataset under {data_root.root}; run the `ingest` flow "
            "(or pass `sts` = a SentEval folder or an sts dataset key)"
        ),
        not_found=lambda data_root: (
            f"STS input {spec!r} is neither a SentEval folder nor an `sts` dataset under {data_root.root}; "
            "run the `ingest` flow or pass an existing folder"
        ),
    )


def row_identity(
    *,
    evaluation_id: str,
    mode: str,
    label: str,
    what: Mapping[str, Any],
    embedder: Mapping[str, Any],
    mlflow_run_id: str | None,
    source: str,
    source_hash: str,
) -> dict[str, Any]:
    """The columns every evaluation row shares (STS and transfer): which model, evaluated on which data, when.
    `what` names the evaluated model (keys model or backbone, pooler, checkpoint, method); missing keys come from
    the result's `embedder` description; `backbone_evaluation`, the evaluation id of a training job's backbone before
    training."""
    return {
        "evaluation_id": evaluation_id,
        "created": datetime.now(UTC).isoformat(),
        "mode": mode,
        "label": label,
        "model": what.get("model") or what.get("backbone") or embedder.get("model") or embedder.get("backbone"),
        "pooler": what.get("pooler") or embedder.get("pooler"),
        "checkpoint": what.get("checkpoint"),
        "method": what.get("method") or embedder.get("method"),
        "mlflow_run_id": mlflow_run_id,
        "backbone_evaluation": what.get("backbone_evaluation"),
        "sts_source": source,
        "sts_hash": source_hash,
    }


def _masked_cell(value: Any) -> Any:
    """A row's cell with its credentials masked: a JSON object or list (`details`) value by value, so that it stays
    JSON; any other text by `redact`."""
    if not isinstance(value, str):
        return value
    if value[:1] in ("{", "["):
        try:
            parsed = json.loads(value)
        except ValueError:
            return redact(value)
        masked = redact_value(parsed)
        return value if masked == parsed else json.dumps(masked, ensure_ascii=False)
    return redact(value)


def write_evaluation_row(
    root: DataRoot, row: Mapping[str, Any], *, params: Mapping[str, Any] | None = None
) -> Manifest:
    """Publish one evaluation row as dataset `evaluations/<evaluation_id>` and refresh the catalog. Its text (the
    label, free text; paths, sources) and `params` are stored with their credentials masked (`redact`), so the
    manifest, the Parquet and Arrow files, the catalog and `cse report` never show one."""
    row = {k: _masked_cell(v) for k, v in row.items()}
    params = redact_value(dict(params or {}))
    missing = [f.name for f in schemas.EVALUATIONS if not f.nullable and row.get(f.name) is None]
    if missing:
        raise ValueError(f"evaluation row lacks required fields {missing}")
    table = pa.Table.from_pylist([{f.name: row.get(f.name) for f in schemas.EVALUATIONS}], schema=schemas.EVALUATIONS)
    m = write_dataset(
        root,
        "evaluations",
        str(row["evaluation_id"]),
        [table],
        schemas.EVALUATIONS,
        params=params,
        inputs={"sts": str(row["sts_hash"])},
    )
    refresh_catalog(root)
    return m
