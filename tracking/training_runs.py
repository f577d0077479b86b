"""A training job's MLflow run (tasks/train.py, tasks/distributed_train.py): started, or resumed from the run its
folder records; ended FINISHED, KILLED or FAILED; what the fit stage records on it around training
(`record_training_job`: tags, params, description, dataset inputs, the curves, the training time) and after its test
evaluation (`describe_tested_run`: the STS chart and table); rank 0's callbacks of a distributed job; read back for a
re-evaluation of its checkpoint (`training_run_ref`: its experiment, the `sts` dataset it used, the tags that nest
the re-evaluation's run under it)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from cse.config import published
from cse.config.training import TrainConfig
from cse.storage.datasets import DatasetRef
from cse.storage.runs import RunDir
from cse.storage.secrets import redact
from cse.tracking.lineage import CONTEXT_CORRUPTION, CONTEXT_EVAL, CONTEXT_TRAIN, log_dataset_inputs
from cse.tracking.provenance import git_commit, prefect_flow_run_id
from cse.tracking.run_pages import (
    BACKBONE_TAG,
    OVERRIDES_PARAM,
    STS_CHART,
    artifact_image,
    backbone_row_label,
    backbone_tag,
    curve_metrics,
    overrides_text,
    preset_differences,
    run_name,
    score_tags,
    set_description,
    start_description,
    sts_description,
    with_rtd_probe,
)
from cse.tracking.spool import ResilientMetricLogger
from cse.tracking.stage_runs import log_run_results
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


def model_tags(cfg: TrainConfig, tokens: DatasetRef, corruption: DatasetRef | None) -> dict[str, str]:
    """What the job's run and its registered model version are both tagged with: method, backbone, preset, data."""
    return {
        "method": cfg.method,
        "backbone": cfg.backbone,
        "preset": cfg.preset,
        "tokens_hash": tokens.content_hash,
        "corruption_hash": corruption.content_hash if corruption else "none",
    }


def job_tags(
    cfg: TrainConfig,
    tokens: DatasetRef,
    corruption: DatasetRef | None,
    nli_tokens: DatasetRef | None,
    run_dir: RunDir,
    extra_tags: dict[str, str] | None = None,
) -> dict[str, str]:
    """The tags of the job's MLflow run (method, backbone, preset, data hashes, commit, folder, worker, flow run)."""
    tags = {
        **model_tags(cfg, tokens, corruption),
        "dataset": cfg.dataset,
        "git_commit": git_commit(),
        "run_dir": str(run_dir.path),
    }
    if nli_tokens is not None:
        tags["nli_tokens_hash"] = nli_tokens.content_hash
    if worker := os.environ.get("CSE_WORKER_NAME"):  # set per worker by scripts/team.sh
        tags["worker"] = worker
    tags.update(extra_tags or {})
    if (fr := prefect_flow_run_id()) is not None:
        tags["prefect_flow_run_id"] = str(fr)
    return tags


class TrainedJob(Protocol):
    """What training returns that the run records (`cse.training.loop.LoopResult`)."""

    steps: int
    seconds: float
    sentences_per_s: float
    resumed_from: int | None


Trained = TypeVar("Trained", bound=TrainedJob)
LogParams = Callable[[dict[str, Any]], None]
LogMetrics = Callable[[dict[str, float], int], None]


def record_training_job(
    cfg: TrainConfig,
    run_dir: RunDir,
    tags: Mapping[str, str],
    datasets: tuple[DatasetRef, DatasetRef | None, DatasetRef | None, DatasetRef],
    train: Callable[[str, LogParams, LogMetrics], Trained],
    *,
    backbone: dict[str, Any] | None,
    logger: logging.Logger | logging.LoggerAdapter,
    killed: tuple[type[BaseException], ...],
) -> tuple[str, Trained]:
    """Train one job inside its MLflow run (`training_run`) and record it there; returns (run id, `train`'s result).

    Before training: the backbone's score before training when given (tag `cse.backbone`, its Avg. as a score tag;
    its metrics come with the test scores, so a run has both or neither), the description and the dataset inputs.
    `train(run_id, log_params, log_curves)` trains: its per-step metrics survive an unreachable tracking server
    (spooled in `run_dir`, delivered after training or said in `logger`), under their Model-metrics names. After:
    the RTD probe in the description (a method reading corrupted sentences) and the training time at the last step.

    Args:
        cfg: the job's training config.
        run_dir: the job's folder (its run id, the spool).
        tags: the run's tags (`job_tags`).
        datasets: the tokens, corruption, NLI tokens and STS datasets the job reads (None: not read).
        train: trains the job.
        backbone: the backbone's score before training (`BackboneScore.before()`), None when not evaluated.
        logger: the stage's log.
        killed: the exceptions that end the run KILLED rather than FAILED.
    """
    params = {**cfg.model_dump(), OVERRIDES_PARAM: overrides_text(cfg)}
    with training_run(cfg.method, run_dir, run_name(cfg), tags, params, cfg.system_metrics, killed=killed) as run:
        run_id = run.info.run_id
        description = _start_job_run(cfg, run_id, datasets, backbone)
        metrics_log = ResilientMetricLogger(run_id, run_dir, logger=logger)
        phases = 2 if cfg.prefix_phase is not None else 1

        def log_curves(metrics: dict[str, float], step: int) -> None:  # in their Model-metrics sections (run_pages)
            metrics_log.log_metrics(curve_metrics(metrics, phases), step)

        try:
            result = train(run_id, metrics_log.log_params, log_curves)
        finally:
            metrics_log.flush()  # deliver what is left, or warn how much stays in the spool and how to deliver it
        if cfg.uses_corruption:  # the RTD mechanism probe of every evaluation, in the description while untested
            set_description(run_id, with_rtd_probe(description, run_id))
        log_run_results(  # at the last step: a line on the Model metrics tab, not a one-bar chart
            run_id,
            metrics={"train_seconds": result.seconds, "train_sentences_per_s": result.sentences_per_s},
            tags={} if result.resumed_from is None else {"resumed_from_step": result.resumed_from},
            step=result.steps,
        )
    return run_id, result


def _start_job_run(
    cfg: TrainConfig,
    run_id: str,
    datasets: tuple[DatasetRef, DatasetRef | None, DatasetRef | None, DatasetRef],
    backbone: dict[str, Any] | None,
) -> str:
    """Record the backbone's score before training (when given), the run's description (returned) and the datasets
    the job reads (`record_training_job`)."""
    tokens, corruption, nli_tokens, sts = datasets
    if backbone:  # its scores as metrics come with the test scores (evaluate_test): a run has both or neither
        log_run_results(run_id, tags={BACKBONE_TAG: backbone_tag(backbone), **score_tags({}, backbone["metrics"])})
    description = start_description(cfg.method, cfg.preset, cfg.backbone, preset_differences(cfg), before=backbone)
    set_description(run_id, description)
    log_dataset_inputs(
        run_id,
        [
            (tokens, CONTEXT_TRAIN),
            *([(corruption, CONTEXT_CORRUPTION)] if corruption else []),
            *([(nli_tokens, CONTEXT_TRAIN)] if nli_tokens else []),
            (sts, CONTEXT_EVAL),
        ],
    )
    return description


def describe_tested_run(
    cfg: TrainConfig,
    run_id: str,
    metrics: Mapping[str, float],
    backbone: dict[str, Any] | None,
    plot: Callable[[dict[str, Mapping[str, Any]], Path, str], Any],
) -> None:
    """The run's STS chart (this run, the backbone before training, the paper's row; `STS_CHART`), drawn by
    `plot(rows, path, title)` and logged as an artifact, and its description after the test evaluation: the STS
    table beside the backbone before training and the published row, and the chart."""
    rows: dict[str, Mapping[str, Any]] = {"this run": metrics}
    if backbone:
        rows[backbone_row_label(backbone.get("pooler"))] = backbone["metrics"]
    setting = published.setting_of(cfg.method, cfg.preset, cfg.supervised)
    if (ref := published.reference_row(published.STS, cfg.method, cfg.backbone, setting)) is not None:
        rows[ref.label] = ref.row
    with tempfile.TemporaryDirectory(prefix="cse-chart-") as tmp:
        folder, name = Path(tmp) / Path(STS_CHART).parent, Path(STS_CHART).name
        folder.mkdir()
        plot(rows, folder / name, f"{run_name(cfg)}: STS test (Spearman ×100)")
        log_run_results(run_id, folders={str(Path(STS_CHART).parent): folder})
    description = sts_description(
        metrics,
        method=cfg.method,
        preset=cfg.preset,
        backbone=cfg.backbone,
        setting=setting,
        differences=preset_differences(cfg),
        before=backbone,
        chart=artifact_image(run_id, STS_CHART, "STS test: this run, the backbone before training, the paper"),
    )
    set_description(run_id, with_rtd_probe(description, run_id))


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
