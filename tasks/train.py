"""Training stages: one Prefect task per stage of a training job, one MLflow run per job (resumed jobs continue it).

A job runs four stages, each its own task in the Prefect UI with its own retries (composed by flows/train.py
`train_job`, which holds the job's lock across them and checks the finished-job record first, `finished_result`):

- `fit` (`fit_job`): holds the GPU slot, starts or resumes the job's MLflow run (cse.tracking.training_runs), injects
  the MLflow metric logger into `cse.training.job.fit` and trains, selecting the best checkpoint on STS-B dev. No
  retries: a deterministic failure (a non-finite loss, a bad config, out of memory) would only repeat, and a rerun
  resumes from the last saved step anyway.
- `evaluate-test` (`evaluate_test`): the best checkpoint on the STS test sets (plus retrieval, alignment/uniformity).
- `evaluate-transfer` (`evaluate_transfer`): the SentEval transfer tasks, when the job asks for them.
- `export` (`export_model`): the checkpoint and config as MLflow artifacts, the MLflow model and its registry
  version, the sentence-transformers folder, the PEFT adapter (methods whose model exports one) and the model cards.
The evaluation and export stages retry (`RETRIES`) only when the tracking server was unreachable
(`cse.tracking.spool.is_unreachable`); anything else fails the task at once. A failed later stage leaves the job's
training intact: the MLflow run is tagged with the stage that failed (cse.tracking.job_stages), no `result.json` is
written, and a rerun resumes at the last step (no training step runs again) and runs the later stages again.
`record_result` writes `result.json` last, when every stage has finished.

A job with `nproc_per_node × nnodes` > 1 trains under torchrun (`cse.training.distributed.launch`; every rank runs
tasks/distributed_train.py, i.e. `fit` on its slice of each global batch, rank 0 logging into this job's MLflow run);
the fit task waits for it; the later stages are the same as for a single-process job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency
from pydantic import BaseModel

from cse.config.training import TrainConfig
from cse.models.checkpoint import load_checkpoint
from cse.models.loading import load_tokenizer, pick_device
from cse.storage.datasets import DatasetRef
from cse.storage.evaluations import load_sts_input
from cse.storage.layout import DataRoot
from cse.storage.runs import RunDir
from cse.storage.settings import get_settings
from cse.tasks.distributed_train import WORKER_MODULE
from cse.tasks.log import embedding_progress, stage_logger
from cse.tracking.job_stages import job_stage, retry_on_outage
from cse.tracking.lineage import CONTEXT_EVAL, log_dataset_inputs
from cse.tracking.model_export import export_portable, log_encoder_model, registered_model_name
from cse.tracking.provenance import prefect_flow_run_id
from cse.tracking.run_pages import page_metrics, run_name
from cse.tracking.stage_runs import log_run_results
from cse.tracking.training_runs import (
    LogMetrics,
    LogParams,
    describe_tested_run,
    job_tags,
    model_tags,
    record_training_job,
    training_run_exists,
)
from cse.training import job as train_job
from cse.training.distributed import DistributedJob, launch
from cse.training.loop import LoopResult, TrainingInterrupted

log = logging.getLogger(__name__)

# LAZY: the stages import their heavy libraries when they run, not when flows/train.py is imported (deployments,
# the CLI, experiment parents): sentence-transformers and peft (cse.models.export.st_export, ~5 s, and peft_export, ~3 s,
# imported by cse.tracking.model_export.export_portable when it runs), scipy.stats, matplotlib and scikit-learn
# (cse.evaluation.evaluator, cse.evaluation.plots, cse.tasks.evaluate, cse.tasks.evaluate_transfer, ~1.5 s).
RETRIES = 2  # evaluate-test, evaluate-transfer, export: retried on a tracking outage only (`retry_on_outage`)
RETRY_DELAYS: list[float] = [30, 120]  # seconds before the first and the second retry
# The task options of those three stages: the retries above, and never a cached result.
RETRIED_STAGE: dict[str, Any] = {
    "retries": RETRIES,
    "retry_delay_seconds": RETRY_DELAYS,
    "retry_condition_fn": retry_on_outage,
    "cache_policy": NO_CACHE,
}


class TrainResult(BaseModel):
    """A finished job (all stages done), recorded as its `result.json`: a rerun returns it instead of training."""

    run_id: str
    run_dir: str
    best_checkpoint: str
    steps: int
    best_stsb_dev: float | None
    resumed_from: int | None
    test_metrics: dict[str, float] = {}
    backbone: dict[str, Any] = {}  # the backbone before training (`BackboneScore.before()`); {} when not evaluated


class FitResult(BaseModel):
    """What the fit stage hands to the later stages: the job's folder and MLflow run and how training went.

    `best_score` is the selection metric's best value (STS-B dev, or the transfer dev average with
    `selection = "transfer"`) at `best_step`; `git_commit` the commit the job ran."""

    run_id: str
    run_dir: str
    steps: int
    best_score: float | None
    best_step: int | None
    resumed_from: int | None
    git_commit: str

    @property
    def job(self) -> RunDir:
        return RunDir.at(self.run_dir)


def gpu_slot(device: torch.device, occupy: int = 1):
    """Hold `occupy` slots (one per GPU) of the Prefect global concurrency limit `$CSE_GPU_SLOT` (default `gpu`)
    while training on CUDA, so two jobs never share a GPU unless the limit allows it."""
    if device.type != "cuda" or not prefect_flow_run_id():
        return contextlib.nullcontext()
    return concurrency(os.environ.get("CSE_GPU_SLOT", "gpu"), occupy=occupy)


def job_inputs(
    cfg: TrainConfig, corruption: DatasetRef | None, nli_tokens: DatasetRef | None
) -> tuple[DatasetRef | None, DatasetRef | None]:
    """The corruption and NLI token datasets the job reads (None for those its method and preset do not read).

    Args:
        cfg: the job's training config.
        corruption: the corruption dataset (required when the method reads corrupted sentences).
        nli_tokens: the NLI tokens (required when the method or preset also reads NLI rows).
    """
    if cfg.uses_corruption and corruption is None:
        raise ValueError(f"method {cfg.method} reads corrupted sentences: pass the corruption dataset")
    if cfg.needs_nli and nli_tokens is None:
        raise ValueError(f"{cfg.method}/{cfg.preset} also reads NLI rows: pass nli_tokens")
    return (corruption if cfg.uses_corruption else None), (nli_tokens if cfg.needs_nli else None)


def job_dir(
    cfg: TrainConfig, tokens: DatasetRef, corruption: DatasetRef | None, nli_tokens: DatasetRef | None
) -> RunDir:
    """The job's folder, `<home>/runs/<method>/<run key>` (`cse.training.job.run_key`; pass `job_inputs`' datasets)."""
    return RunDir(cfg.method, train_job.run_key(cfg, tokens, corruption, nli_tokens))


@task(name="fit", retries=0, cache_policy=NO_CACHE)
def fit_job(
    cfg: TrainConfig,
    tokens: DatasetRef,
    corruption: DatasetRef | None,
    sts: DatasetRef,
    nli_tokens: DatasetRef | None = None,
    stop_after: int | None = None,
    extra_tags: dict[str, str] | None = None,
    backbone: dict[str, Any] | None = None,
) -> FitResult:
    """Train (or resume) one job, selecting its best checkpoint on STS-B dev (or the transfer dev average).

    Args:
        cfg: the job's training config.
        tokens: the training tokens.
        corruption: the corruption dataset (methods that read corrupted sentences), else None.
        sts: the STS dataset (dev selection).
        nli_tokens: the NLI tokens (methods or presets that also read NLI rows), else None.
        stop_after: interrupt after that many steps (`TrainingInterrupted`; resume tests).
        extra_tags: tags added to the job's MLflow run (experiment membership, sweeps' parents).
        backbone: the backbone's score before training (`cse.tasks.backbone.BackboneScore.before()`), recorded on the
            run (tag `cse.backbone`, its Avg. as a score tag, the description) when given.
    """
    plog = stage_logger()
    corruption, nli_tokens = job_inputs(cfg, corruption, nli_tokens)
    run_dir = job_dir(cfg, tokens, corruption, nli_tokens)
    datasets = (tokens, corruption, nli_tokens, sts)
    train = _training(cfg, datasets, run_dir, stop_after, plog)
    tags = job_tags(cfg, tokens, corruption, nli_tokens, run_dir, extra_tags)
    run_id, result = record_training_job(
        cfg,
        run_dir,
        tags,
        datasets,
        train,
        backbone=backbone,
        logger=plog,
        killed=(KeyboardInterrupt, TrainingInterrupted),
    )
    plog.info(
        "trained %d steps; best %s %.2f at step %s",
        result.steps,
        "STS-B dev" if cfg.selection == "stsb" else "transfer dev average",
        result.best_score or float("nan"),
        result.best_step,
    )
    return FitResult(
        run_id=run_id,
        run_dir=str(run_dir.path),
        steps=result.steps,
        best_score=result.best_score,
        best_step=result.best_step,
        resumed_from=result.resumed_from,
        git_commit=tags["git_commit"],
    )


def _training(
    cfg: TrainConfig,
    datasets: tuple[DatasetRef, DatasetRef | None, DatasetRef | None, DatasetRef],
    run_dir: RunDir,
    stop_after: int | None,
    plog: logging.Logger | logging.LoggerAdapter,
) -> Callable[[str, LogParams, LogMetrics], LoopResult]:
    """The job's training as `record_training_job` calls it (run id, the run's params and curve loggers): in this
    process (`cse.training.job.fit`; its rows, RTD probe and dev evaluator loaded now, before the run starts), or
    under torchrun (`cse.training.distributed.launch`), in the GPU slot."""
    from cse.evaluation.evaluator import Evaluator  # lazy: see LAZY

    tokens, corruption, nli_tokens, sts = datasets
    root = DataRoot(get_settings().data_root)
    device = pick_device(cfg.device)
    precision = train_job.resolve_precision(cfg, device)
    pad_id = load_tokenizer(cfg.backbone).pad_token_id
    if not cfg.distributed:  # (the ranks of a distributed job load their own)
        rows, nli_rows = train_job.load_training_rows(cfg, root, tokens, corruption, nli_tokens, pad_id)
        probe = train_job.rtd_probe(cfg, root, tokens, corruption, pad_id)
    evaluator = Evaluator(load_sts_input(sts.key, root).table)

    def train(run_id: str, log_params: LogParams, log_curves: LogMetrics) -> LoopResult:
        if cfg.distributed:  # (rank 0 logs through its own ResilientMetricLogger into the same spool)
            job = DistributedJob(
                config=cfg,
                tokens=tokens,
                corruption=corruption,
                nli_tokens=nli_tokens,
                sts=sts,
                run_dir=str(run_dir.path),
                run_id=run_id,
                precision=precision,
                stop_after=stop_after,
            )
            return launch(job, WORKER_MODULE, gpu_slot(device, occupy=cfg.nproc_per_node), plog)
        return train_job.fit(
            cfg,
            rows,
            nli_rows,
            run_dir,
            run_id,
            device,
            precision,
            evaluator,
            log_params,
            log_curves,
            stop_after=stop_after,
            slot=gpu_slot(device),
            logger=plog,
            probe=probe,
        )

    return train


def _what(cfg: TrainConfig, fitted: FitResult) -> dict[str, str]:
    """The evaluation rows' description of the job's best checkpoint."""
    return {"method": cfg.method, "checkpoint": str(fitted.job.best), "run_id": fitted.run_id, "backbone": cfg.backbone}


@task(name="evaluate-test", **RETRIED_STAGE)
def evaluate_test(
    cfg: TrainConfig, fitted: FitResult, sts: DatasetRef, backbone: dict[str, Any] | None = None
) -> dict[str, float]:
    """The job's best checkpoint on the STS test sets, recorded on the job's MLflow run (its headline scores at the
    job's last step, the backbone's before training at step 0: a line from before to after on the Model metrics tab;
    the score tags; the chart and the description) and as an evaluation row labelled with the run's name.

    Args:
        cfg: the job's training config (evaluation batch size and precision).
        fitted: the fit stage's result.
        sts: the STS dataset.
        backbone: the backbone's score before training (`BackboneScore.before()`), None when not evaluated.

    Returns the test metrics (the seven STS tasks, `sts_avg`, retrieval, alignment/uniformity)."""
    from cse.evaluation.evaluator import Evaluator  # lazy: see LAZY
    from cse.evaluation.plots import sts_scores_plot
    from cse.tasks.evaluate import record_evaluation

    root = DataRoot(get_settings().data_root)
    sts_input = load_sts_input(sts.key, root)
    with job_stage(fitted.run_id, "evaluate-test"):
        best = load_checkpoint(fitted.job.best, device=pick_device(cfg.device))
        res = Evaluator(sts_input.table).run(
            best,
            mode="test",
            batch_size=cfg.eval_batch_size,
            precision=cfg.eval_precision,
            on_progress=embedding_progress("evaluate-test"),
        )
        metrics = res.metrics()
        record_evaluation(
            res,
            label=run_name(cfg),
            sts=sts_input,
            what={**_what(cfg, fitted), **({"backbone_evaluation": backbone["evaluation_id"]} if backbone else {})},
            subset_metrics=False,
            step=fitted.steps,
        )
        if backbone:
            log_run_results(fitted.run_id, metrics=page_metrics(backbone["metrics"]), step=0)
        describe_tested_run(cfg, fitted.run_id, metrics, backbone, plot=sts_scores_plot)
    return metrics


@task(name="evaluate-transfer", **RETRIED_STAGE)
def evaluate_transfer(cfg: TrainConfig, fitted: FitResult) -> dict[str, float]:
    """The job's best checkpoint on the SentEval transfer tasks (test settings), recorded like `evaluate_test`.

    Args:
        cfg: the job's training config (evaluation batch size and precision).
        fitted: the fit stage's result.

    Returns the transfer metrics (`mr` … `mrpc`, `transfer_avg`)."""
    from cse.tasks.evaluate_transfer import record_transfer_evaluation  # lazy: see LAZY

    plog = stage_logger()
    with job_stage(fitted.run_id, "evaluate-transfer"):
        transfer, source = train_job.transfer_evaluator(get_settings().data_root)
        log_dataset_inputs(fitted.run_id, [(source, CONTEXT_EVAL)])
        best = load_checkpoint(fitted.job.best, device=pick_device(cfg.device))
        tres = transfer.run(
            best, classifier="test", batch_size=cfg.eval_batch_size, precision=cfg.eval_precision, log=plog.info
        )
        record_transfer_evaluation(tres, label=run_name(cfg), source=source, what=_what(cfg, fitted), step=fitted.steps)
    return tres.metrics()


@task(name="export", **RETRIED_STAGE)
def export_model(
    cfg: TrainConfig,
    fitted: FitResult,
    test_metrics: dict[str, float],
    tokens: DatasetRef,
    corruption: DatasetRef | None,
    nli_tokens: DatasetRef | None = None,
    backbone: dict[str, Any] | None = None,
) -> None:
    """Record and export the job's best checkpoint: the checkpoint and config as MLflow artifacts, the MLflow model
    and its registry version (`cse-<method>-<backbone>-<preset>`), the sentence-transformers folder, the PEFT adapter
    (`cse.tracking.model_export.export_portable`) and a model card in each export (also logged as artifacts).

    Args:
        cfg: the job's training config.
        fitted: the fit stage's result.
        test_metrics: the evaluation stages' metrics (for the model cards; empty without test evaluation).
        tokens: the training tokens (their hash goes on the registry version and the cards).
        corruption: the corruption dataset the job read, else None.
        nli_tokens: the NLI tokens the job read, else None.
        backbone: the backbone's score before training (for the model cards), None when not evaluated.
    """
    corruption, nli_tokens = job_inputs(cfg, corruption, nli_tokens)
    run_dir = fitted.job
    with job_stage(fitted.run_id, "export"):
        log_run_results(
            fitted.run_id,
            folders={"checkpoint": run_dir.best},
            texts={"config.json": json.dumps(cfg.model_dump(), indent=2)},
        )
        logged = log_encoder_model(
            run_dir.best,
            registered_name=registered_model_name(cfg.method, cfg.backbone, cfg.preset),
            version_tags=model_tags(cfg, tokens, corruption),
        )
        export_portable(
            cfg,
            fitted.run_id,
            run_dir,
            test_metrics,
            {
                "tokens": tokens,
                "corruption": corruption,
                "nli_tokens": nli_tokens,
                "run_id": fitted.run_id,
                "registered_name": logged.registered_name if logged.version else None,
                "version": logged.version,
                "logged_model_uri": logged.model_uri,
                "git_commit": fitted.git_commit,
                "checkpoint": run_dir.best,
                "steps": fitted.steps,
                "best_stsb_dev": fitted.best_score,
                "backbone": backbone,
            },
            stage_logger(),
        )


def record_result(
    fitted: FitResult, test_metrics: dict[str, float], backbone: dict[str, Any] | None = None
) -> TrainResult:
    """Write the finished job's `result.json` (every stage done; with its best checkpoint's file records) and return
    it: from now on a rerun returns it (`finished_result`)."""
    out = TrainResult(
        run_id=fitted.run_id,
        run_dir=fitted.run_dir,
        best_checkpoint=str(fitted.job.best),
        steps=fitted.steps,
        best_stsb_dev=fitted.best_score,
        resumed_from=fitted.resumed_from,
        test_metrics=test_metrics,
        backbone=backbone or {},
    )
    fitted.job.set_result(out.model_dump())
    return out


def note_membership(result: TrainResult, extra_tags: dict[str, str] | None) -> None:
    """Tag a finished job's run with the membership tags (`cse.member.*`) of the experiment that asked for it again."""
    log_run_results(result.run_id, tags={k: v for k, v in (extra_tags or {}).items() if k.startswith("cse.member.")})


def finished_result(run_dir: RunDir, logger=None) -> TrainResult | None:
    """The recorded result of a finished job whose MLflow run still exists, checked first (else None: train, resume
    or re-evaluate). The record must read and the best checkpoint must match the sizes and hashes recorded at save:
    - a damaged best checkpoint: the job folder is quarantined (`<home>/quarantine/runs/...`) and the job retrained;
    - an unreadable record with an intact resume state: only the record is moved aside; the job resumes at its last
      step, so only the test evaluation and the recording run again.
    Either is said in the log (`logger`)."""
    say = (logger or log).warning
    check = run_dir.verify_result(required=tuple(k for k, f in TrainResult.model_fields.items() if f.is_required()))
    if check.record is None and not check.result_problems:
        return None
    if check.checkpoint_problems or (check.result_problems and not run_dir.has_state()):
        problems = check.checkpoint_problems + check.result_problems
        moved = run_dir.quarantine(problems)
        say("finished job %s is damaged (%s): moved to %s; training it again", run_dir.path, "; ".join(problems), moved)
        return None
    if check.result_problems:
        moved = run_dir.quarantine_result(check.result_problems)
        say(
            "finished job %s: its recorded result is damaged (%s; moved to %s); its checkpoint and training state are "
            "intact: evaluating and recording it again",
            run_dir.path,
            "; ".join(check.result_problems),
            moved,
        )
        return None
    record = check.record
    if record is None:  # (read no record and found no problem: returned above)
        return None
    if not training_run_exists(record["run_id"]):
        log.warning(
            "finished job %s names MLflow run %s, which is gone: running it again", run_dir.path, record["run_id"]
        )
        return None
    return TrainResult.model_validate(record)
