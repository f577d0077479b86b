"""A training job's MLflow run (tasks/train.py, tasks/distributed_train.py): started, or resumed from the run its
folder records; ended FINISHED, KILLED or FAILED; rank 0's callbacks of a distributed job."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from storage.runs import RunDir
from tracking.spool import ResilientMetricLogger
from tracking.store import configure_mlflow, ensure_experiment, flatten, reraise

log = logging.getLogger(__name__)


def start_or_resume_training_run(
    experiment: str,
    run_dir: RunDir,
    run_name: str,
    tags: Mapping[str, str],
    params: Mapping[str, Any],
    log_system_metrics: bool,
) -> mlflow.ActiveRun:
    """The training job's MLflow run: the one `run_dir` records (a resumed job continues it), else a new run in
    `experiment` with `tags` and the flattened `params`, whose id is recorded in `run_dir`."""
    exp_id = ensure_experiment(experiment)
    previous = run_dir.mlflow_run_id()
    if previous is not None:
        try:
            return mlflow.start_run(run_id=previous, log_system_metrics=log_system_metrics)
        except MlflowException:
            log.warning("MLflow run %s of %s not found; starting a new run", previous, run_dir.path)
    run = mlflow.start_run(
        experiment_id=exp_id, run_name=run_name, tags=dict(tags), log_system_metrics=log_system_metrics
    )
    run_dir.set_mlflow_run_id(run.info.run_id)
    mlflow.log_params(flatten(params))
    return run


@contextmanager
def training_run(
    experiment: str,
    run_dir: RunDir,
    run_name: str,
    tags: Mapping[str, str],
    params: Mapping[str, Any],
    log_system_metrics: bool,
    killed: tuple[type[BaseException], ...] = (KeyboardInterrupt,),
) -> Iterator[mlflow.ActiveRun]:
    """`start_or_resume_training_run` as the active run of the block: ended FINISHED after it, KILLED when it raises
    one of `killed` (an interrupt, the loop's simulated kill), FAILED on any other exception (which propagates)."""
    try:
        active = start_or_resume_training_run(experiment, run_dir, run_name, tags, params, log_system_metrics)
    except Exception as e:  # noqa: BLE001 - the store's error, said clearly and without credentials
        reraise(e)
    with active as run:
        try:
            yield run
        except killed:
            mlflow.end_run(status="KILLED")
            raise
        except BaseException as e:
            mlflow.end_run(status="FAILED")
            if isinstance(e, Exception):
                reraise(e)
            raise


def training_run_exists(run_id: str) -> bool:
    """Whether the MLflow run `run_id` (a finished job's) still exists in the configured tracking store."""
    configure_mlflow()
    try:
        mlflow.get_run(run_id)
    except MlflowException:
        return False
    return True


def rank_zero_callbacks(run_id: str, run_dir: RunDir, world_size: int):
    """Rank 0's `log_params` / `log_metrics` of a distributed job: into the job's run through the client (the run's
    status is left alone; tag `world_size`), via `ResilientMetricLogger` (an unreachable server spools into the
    job's folder; the launching task flushes)."""
    configure_mlflow()
    client = mlflow.MlflowClient()
    client.set_tag(run_id, "world_size", str(world_size))
    metrics_log = ResilientMetricLogger(run_id, run_dir, client=client)

    def log_params(params: dict) -> None:
        try:
            metrics_log.log_params(params)
        except MlflowException as e:  # a resumed run that logged other values before
            log.warning("params not logged (%s): %s", e, params)

    return log_params, metrics_log.log_metrics
