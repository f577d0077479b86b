"""Every stage run is an MLflow run, and a failing stage ends it FAILED (`stage_run`); what a stage records on its
run: tags, metrics, results and artifacts, a quarantined dataset."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, RunTag

from cse.tracking.orphans import OWNER_TAG, close_orphaned_runs, process_owner
from cse.tracking.provenance import git_commit, prefect_flow_run_id
from cse.tracking.store import configure_mlflow, ensure_experiment, flatten, reraise

log = logging.getLogger(__name__)


@contextmanager
def stage_run(
    experiment: str,
    run_name: str,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
    nested: bool = False,
) -> Iterator[mlflow.ActiveRun]:
    """An MLflow run around one stage. An exception ends the run FAILED and propagates. Runs of the same stage
    left RUNNING by a killed process are marked KILLED first (`close_orphaned_runs`)."""
    try:
        exp_id = ensure_experiment(experiment)
        base_tags = {"git_commit": git_commit(), OWNER_TAG: process_owner()}
        if (fr := prefect_flow_run_id()) is not None:
            base_tags["prefect_flow_run_id"] = str(fr)
        base_tags.update(tags or {})
        run = mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=base_tags, nested=nested)
    except Exception as e:  # noqa: BLE001 - the store's error, said clearly and without credentials
        reraise(e)
    try:
        if orphans := close_orphaned_runs(exp_id, run_name, closed_by=run.info.run_id):
            mlflow.set_tag("closed_orphaned_runs", ",".join(orphans))
        if params:
            mlflow.log_params(flatten(params))
        yield run
    except BaseException as e:  # any exit by exception closes the run FAILED, then propagates
        mlflow.end_run(status="FAILED")
        if isinstance(e, Exception):
            reraise(e)
        raise
    else:
        mlflow.end_run(status="FINISHED")


def log_quarantine(
    record, logger: logging.Logger | logging.LoggerAdapter | None = None, run_id: str | None = None
) -> None:
    """Record in the stage's MLflow run (the active one, or `run_id`) that a damaged dataset was moved aside
    (`cse.storage.integrity.Quarantined`): tags `quarantined` / `quarantine_reason` and the artifact
    `quarantine.json`."""
    from dataclasses import asdict

    (logger or log).warning(
        "dataset %s/%s was damaged (%s): quarantined at %s and rebuilt",
        record.kind,
        record.key,
        record.summary(),
        record.moved_to,
    )
    run_id = run_id or active_run_id()
    if run_id is None:
        raise RuntimeError(f"cannot record the quarantine of {record.kind}/{record.key}: no MLflow run is active")
    client = mlflow.MlflowClient()
    client.set_tag(run_id, "quarantined", record.moved_to)
    client.set_tag(run_id, "quarantine_reason", record.summary()[:5000])
    client.log_dict(run_id, asdict(record), "quarantine.json")


def tag_dataset_run(tags: Mapping[str, str], run_id: str | None = None) -> None:
    """Set `tags` on a dataset stage's MLflow run: the active run, or run `run_id` (a publish task may run outside
    the run's context)."""
    if run_id is None:
        mlflow.set_tags(dict(tags))
        return
    configure_mlflow()
    client = mlflow.MlflowClient()
    for k, v in tags.items():
        client.set_tag(run_id, k, v)


def log_dataset_metrics(metrics: Mapping[str, float], run_id: str | None = None, step: int | None = None) -> None:
    """Log `metrics` (at `step` when given) to a dataset stage's MLflow run: the active run, or run `run_id`."""
    if run_id is not None:
        configure_mlflow()
    mlflow.log_metrics(dict(metrics), step=step, run_id=run_id)


def active_run_id() -> str | None:
    """The id of the MLflow run active in this thread (a stage's or a training job's), None outside one."""
    run = mlflow.active_run()
    return run.info.run_id if run is not None else None


def log_run_results(
    run_id: str,
    *,
    metrics: Mapping[str, float] | None = None,
    tags: Mapping[str, Any] | None = None,
    texts: Mapping[str, str] | None = None,
    dicts: Mapping[str, Any] | None = None,
    folders: Mapping[str, str | Path] | None = None,
    step: int = 0,
) -> None:
    """Results on run `run_id`, through the client (no active-run state involved): `metrics` (at `step`, stamped
    now), `tags` (values stringified), `texts` and `dicts` (artifact file name → text, or → a dict saved as JSON)
    and `folders` (artifact path → local folder whose files are uploaded there)."""
    client = mlflow.MlflowClient()
    now = int(time.time() * 1000)
    if metrics or tags:
        client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, step) for k, v in (metrics or {}).items()],
            tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()],
        )
    for name, text in (texts or {}).items():
        client.log_text(run_id, text, name)
    for name, value in (dicts or {}).items():
        client.log_dict(run_id, value, name)
    for artifact_path, folder in (folders or {}).items():
        client.log_artifacts(run_id, str(folder), artifact_path=artifact_path)
