"""Dataset inputs: what a run read, as the "Datasets used" of the run in the MLflow UI, so lineage runs from the raw
source to the model. `cse.tracking.datasets` turns our datasets into MLflow datasets; this module logs them on runs and
reads them back."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import mlflow
from mlflow.entities import Dataset as DatasetEntity
from mlflow.entities import DatasetInput, InputTag
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from cse.tracking.datasets import as_datasets
from cse.tracking.stage_runs import active_run_id
from cse.tracking.store import configure_mlflow

# The `mlflow.data.context` input tag: how a run used a dataset (MLflow's autologging says "train" / "eval").
CONTEXT_SOURCE = "source"  # what a data stage reads and transforms (ingest: the raw file; tokenise, corrupt: a dataset)
CONTEXT_TRAIN = "train"  # the training rows (tokens; DiffAug's NLI tokens)
CONTEXT_CORRUPTION = "corruption"  # the corrupted views a D2CSE / DiffCSE job reads beside its tokens
CONTEXT_EVAL = "eval"  # evaluation data (STS: dev selection and test; SentEval transfer tasks)


def log_dataset_inputs(
    run_id: str | None, inputs: Iterable[tuple[Any, str]], tags: Mapping[str, str] | None = None
) -> list[DatasetInput]:
    """Log what run `run_id` (default: the active run) read as MLflow dataset inputs, each with its context
    (`CONTEXT_*`, the input tag `mlflow.data.context`) and `tags` (extra input tags). An input is anything
    `cse.tracking.datasets.as_datasets` takes: a `DatasetRef` or `Manifest` (Parquet-backed, digest = the content hash,
    source = the dataset folder, schema and row count), a resolved ingestion source (path or URL + sha256; an HF
    source: one input per HF dataset), an STS/transfer evaluation input, or an `mlflow.data` Dataset. All go in one
    `MlflowClient.log_inputs` request (what `mlflow.log_input` sends for one dataset of the active run); an input the
    run already has (a resumed job logs its inputs again) is not added twice. Returns the inputs logged."""
    if run_id is None:
        run_id = active_run_id()
        if run_id is None:
            raise RuntimeError("log_dataset_inputs needs a run: pass run_id or call it inside an active MLflow run")
    else:
        configure_mlflow()
    entries = []
    for item, context in inputs:
        input_tags = [
            InputTag(MLFLOW_DATASET_CONTEXT, context),
            *(InputTag(k, str(v)) for k, v in (tags or {}).items()),
        ]
        entries += [DatasetInput(DatasetEntity(**dataset.to_dict()), tags=input_tags) for dataset in as_datasets(item)]
    if entries:
        _log_inputs_racing_others(run_id, entries)
    return entries


_DUPLICATE_DATASET = ("unique constraint", "duplicate key")  # PostgreSQL / SQLite wording of the race below


def _log_inputs_racing_others(run_id: str, entries: list[DatasetInput], attempts: int = 4) -> None:
    """`log_inputs`, tolerating another run that registers the same dataset at the same moment.

    A dataset is stored once per experiment: the SQL store looks it up and inserts it when missing, so two jobs that
    read the same dataset and log at the same moment (a sweep's children on two workers) can both try the insert and
    the second fails with a unique-key violation (seen in the team-stack test on PostgreSQL). The dataset then exists,
    so the same request again succeeds; any other error is raised at once."""
    client = mlflow.MlflowClient()
    for attempt in range(attempts):
        try:
            client.log_inputs(run_id, datasets=entries)
            return
        except MlflowException as e:
            if attempt == attempts - 1 or not any(w in str(e).lower() for w in _DUPLICATE_DATASET):
                raise
            time.sleep(0.2 * (attempt + 1))


def run_dataset_inputs(run_id: str) -> list[dict[str, Any]]:
    """The dataset inputs of run `run_id` as plain dicts (name, digest, source_type, source, schema, profile, context
    and the other input tags), in the order the store returns them."""
    configure_mlflow()
    out = []
    inputs = mlflow.get_run(run_id).inputs  # None: a run without a record of inputs
    for di in inputs.dataset_inputs if inputs is not None else []:
        fields = {k: getattr(di.dataset, k) for k in ("name", "digest", "source_type", "source", "schema", "profile")}
        tags = {t.key: t.value for t in di.tags}
        out.append({**fields, "context": tags.pop(MLFLOW_DATASET_CONTEXT, None), "tags": tags})
    return out
