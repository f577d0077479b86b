"""A training job's MLflow run (tasks/train.py, tasks/distributed_train.py): started, or resumed from the run its
folder records; ended FINISHED, KILLED or FAILED; rank 0's callbacks of a distributed job; read back for a
re-evaluation of its checkpoint (`training_run_ref`: its experiment, the `sts` dataset it used, the tags that nest
the re-evaluation's run under it)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from cse.storage.runs import RunDir
from cse.storage.secrets import redact
from cse.tracking.lineage import CONTEXT_EVAL
from cse.tracking.run_pages import curve_metrics
from cse.tracking.spool import ResilientMetricLogger
from cse.tracking.store import configure_mlflow, ensure_experiment, flatten, reraise

log = logging.getLogger(__name__)


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
    """The training job's MLflow run as the active run of the block: the one `run_dir` records (a resumed job continues
    it), else a new run in `experiment` with `tags` and the flattened `params`, whose id is recorded in `run_dir`.
    Ended FINISHED after the block, KILLED when it raises one of `killed` (the loop's simulated kill) or any exception
    that is not an `Exception` (an interrupt, Prefect's `TerminationSignal` for SIGTERM, an exit), FAILED on any other
    exception (which propagates)."""
    try:
        exp_id, active = ensure_experiment(experiment), None
        if (previous := run_dir.mlflow_run_id()) is not None:
            try:
                active = mlflow.start_run(run_id=previous, log_system_metrics=log_system_metrics)
            except MlflowException:
                log.warning("MLflow run %s of %s not found; starting a new run", previous, run_dir.path)
        if active is None:
            active = mlflow.start_run(
                experiment_id=exp_id, run_name=run_name, tags=dict(tags), log_system_metrics=log_system_metrics
            )
            run_dir.set_mlflow_run_id(active.info.run_id)
            mlflow.log_params(flatten(params))
    except Exception as e:  # noqa: BLE001 - the store's error, said clearly and without credentials
        reraise(e)
    with active as run:
        try:
            yield run
        except BaseException as e:  # any exit by exception ends the run (KILLED or FAILED), then propagates
            if isinstance(e, killed) or not isinstance(e, Exception):  # stopped from outside, not failed
                mlflow.end_run(status="KILLED")
                raise
            mlflow.end_run(status="FAILED")
            reraise(e)


def training_run_exists(run_id: str) -> bool:
    """Whether the MLflow run `run_id` (a finished job's) still exists in the configured tracking store."""
    configure_mlflow()
    try:
        mlflow.get_run(run_id)
    except MlflowException:
        return False
    return True


def rank_zero_callbacks(run_id: str, run_dir: RunDir, world_size: int, phases: int = 1):
    """Rank 0's `log_params` / `log_metrics` of a distributed job: into the job's run through the client (the run's
    status is left alone; tag `world_size`), via `ResilientMetricLogger` (an unreachable server spools into the
    job's folder; the launching task flushes); the loop's metrics under their MLflow names
    (`cse.tracking.run_pages.curve_metrics`, for a job of `phases` phases), as the single-process job logs them."""
    configure_mlflow()
    client = mlflow.MlflowClient()
    client.set_tag(run_id, "world_size", str(world_size))
    metrics_log = ResilientMetricLogger(run_id, run_dir, client=client)

    def log_params(params: dict) -> None:
        try:
            metrics_log.log_params(params)
        except MlflowException as e:  # a resumed run that logged other values before
            log.warning("params not logged (%s): %s", e, params)

    def log_metrics(metrics: dict, step: int) -> None:
        metrics_log.log_metrics(curve_metrics(metrics, phases), step)

    return log_params, log_metrics


# The MLflow tag that nests a run under another in the UI (what `mlflow.start_run(nested=True)` sets), and ours naming
# the training run a re-evaluation scored (searchable: `tags.cse.evaluates_run = '<id>'`).
PARENT_RUN_TAG = "mlflow.parentRunId"
EVALUATES_RUN_TAG = "cse.evaluates_run"
JOB_RUN_TAGS = ("method", "run_dir")  # every training job's run has them (tasks/train.py job_tags)


@dataclass(frozen=True)
class TrainingRunRef:
    """A training job's MLflow run as a re-evaluation of its checkpoint needs it: where it lives, and the `sts` dataset
    (key and content hash) it was evaluated on (None when the run records none)."""

    run_id: str
    run_name: str
    experiment: str
    sts_key: str | None
    sts_hash: str | None

    def link_tags(self) -> dict[str, str]:
        """The tags that nest a run under this one in the MLflow UI (same experiment) and name it."""
        return {PARENT_RUN_TAG: self.run_id, EVALUATES_RUN_TAG: self.run_id}


def _sts_of(run: mlflow.entities.Run) -> tuple[str | None, str | None]:
    """The `sts` dataset a training run read: its test evaluation's tags (`sts_source` `dataset:<key>`, `sts_hash`),
    else its evaluation-context dataset input `sts/<key>` (the profile holds the full content hash)."""
    source = run.data.tags.get("sts_source", "")
    if source.startswith("dataset:"):
        return source.removeprefix("dataset:"), run.data.tags.get("sts_hash")
    for inp in run.inputs.dataset_inputs if run.inputs else []:
        context = {t.key: t.value for t in inp.tags}.get(MLFLOW_DATASET_CONTEXT)
        if context == CONTEXT_EVAL and inp.dataset.name.startswith("sts/"):
            profile = json.loads(inp.dataset.profile or "{}")
            return inp.dataset.name.removeprefix("sts/"), profile.get("content_hash")
    return None, None


def training_run_ref(run_id: str) -> TrainingRunRef | None:
    """The training job's run `run_id` (`TrainingRunRef`); None when that run is not a training job's (no job tags:
    a checkpoint logged by hand). A FileNotFoundError naming the store when no such run exists."""
    configure_mlflow()
    client = mlflow.MlflowClient()
    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        raise FileNotFoundError(f"MLflow run {run_id} not found in {redact(mlflow.get_tracking_uri())}: {e}") from None
    if not all(t in run.data.tags for t in JOB_RUN_TAGS):
        return None
    sts_key, sts_hash = _sts_of(run)
    return TrainingRunRef(
        run_id=run_id,
        run_name=run.info.run_name or run_id,
        experiment=client.get_experiment(run.info.experiment_id).name,
        sts_key=sts_key,
        sts_hash=sts_hash,
    )
