"""Training stage: one Prefect task per training job, one MLflow run per job (resumed jobs continue it).

A job with `nproc_per_node × nnodes` > 1 trains under torchrun (tasks/distributed_train.py: every rank runs `fit`
on its slice of each global batch, rank 0 logs into this job's MLflow run); the task waits for it and then does
the rest (test evaluation, artifacts, export) as for a single-process job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

import mlflow
import torch
from prefect import task
from pydantic import BaseModel

from config.settings import get_settings
from config.training import LAUNCH_FIELDS, TrainConfig
from models.loading import load_tokenizer, pick_device
from storage.datasets import DatasetRef
from storage.hashing import stable_hash
from storage.layout import DataRoot
from storage.runs import RunDir
from storage.training_data import load_corruption_rows, load_token_rows
from tasks.ingest import _logger
from tasks.tracking import (
    ResilientMetricLogger,
    configure_mlflow,
    ensure_experiment,
    flatten,
    git_commit,
    prefect_flow_run_id,
)
from tasks.train_data import TrainingRows
from tasks.trainer import LoopConfig, LoopResult, Phase, Trainer, TrainingInterrupted, set_seed

log = logging.getLogger(__name__)


class TrainResult(BaseModel):
    run_id: str
    run_dir: str
    best_checkpoint: str
    steps: int
    best_stsb_dev: float | None
    resumed_from: int | None
    test_metrics: dict[str, float] = {}


def run_key(cfg: TrainConfig, tokens: DatasetRef, corruption: DatasetRef | None, nli_tokens: DatasetRef | None = None) -> str:
    """The job's identity: its resolved config (without the launch fields) and the content of every dataset it reads."""
    key = {"config": cfg.model_dump(exclude=set(LAUNCH_FIELDS)), "tokens": tokens.content_hash,
           "corruption": corruption.content_hash if corruption is not None else None}
    if nli_tokens is not None:
        key["nli_tokens"] = nli_tokens.content_hash
    return stable_hash(key)


def resolve_precision(cfg: TrainConfig, device: torch.device) -> str:
    if cfg.precision != "auto":
        return cfg.precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def start_or_resume_run(cfg: TrainConfig, run_dir: RunDir, tags: dict[str, str]) -> mlflow.ActiveRun:
    exp_id = ensure_experiment(cfg.method)
    previous = run_dir.mlflow_run_id()
    if previous is not None:
        try:
            return mlflow.start_run(run_id=previous, log_system_metrics=cfg.system_metrics)
        except mlflow.exceptions.MlflowException:
            log.warning("MLflow run %s of %s not found; starting a new run", previous, run_dir.path)
    run = mlflow.start_run(experiment_id=exp_id, run_name=f"{cfg.method}-{cfg.preset}", tags=tags,
                           log_system_metrics=cfg.system_metrics)
    run_dir.set_mlflow_run_id(run.info.run_id)
    mlflow.log_params(flatten(cfg.model_dump()))
    return run


def gpu_slot(device: torch.device, occupy: int = 1):
    """Hold `occupy` slots (one per GPU) of the Prefect global concurrency limit `$CSE_GPU_SLOT` (default `gpu`)
    while training on CUDA, so two jobs never share a GPU unless the limit allows it."""
    if device.type != "cuda" or not prefect_flow_run_id():
        return contextlib.nullcontext()
    from prefect.concurrency.sync import concurrency

    return concurrency(os.environ.get("CSE_GPU_SLOT", "gpu"), occupy=occupy)


def build_model(cfg: TrainConfig, device: torch.device):
    from models.registry import build_model as build

    return build(cfg.method, {"backbone": cfg.backbone, **cfg.model}).to(device)


def training_phases(cfg: TrainConfig, rows: TrainingRows, nli_rows: TrainingRows | None) -> list[Phase]:
    """One phase for every method but DiffAug: prefix-only NLI steps, then joint tuning (methods.md §6)."""
    joint = Phase("main", rows, cfg.batch_size, cfg.learning_rate, cfg.epochs, cfg.max_steps)
    if cfg.prefix_phase is None:
        return [joint]
    joint.name = "joint"
    if cfg.aux_nli_batch_size:
        joint.aux_rows, joint.aux_batch_size = nli_rows, cfg.aux_nli_batch_size
    pp = cfg.prefix_phase
    prefix = Phase("prefix", nli_rows, pp.batch_size, pp.learning_rate, max_steps=pp.steps, cycle=True,
                   schedule_steps=joint.total_steps if pp.schedule_over_joint_steps else None)
    return [prefix, joint]


def load_training_rows(cfg: TrainConfig, root: DataRoot, tokens: DatasetRef, corruption: DatasetRef | None,
                       nli_tokens: DatasetRef | None, pad_id: int) -> tuple[TrainingRows, TrainingRows | None]:
    """The job's training rows and, for DiffAug, its NLI rows."""
    token_rows = load_token_rows(root, tokens.key, ("sent0", "sent1", "hard_neg") if cfg.supervised else ("text",),
                                 limit=cfg.max_train_sentences)
    corruption_rows = load_corruption_rows(root, corruption.key, token_rows) if corruption is not None else None
    rows = TrainingRows(token_rows, corruption_rows, cfg.supervised, pad_id)
    nli_rows = None
    if nli_tokens is not None:
        nli_token_rows = load_token_rows(root, nli_tokens.key, ("sent0", "sent1", "hard_neg"), limit=cfg.max_train_sentences)
        nli_rows = TrainingRows(nli_token_rows, None, True, pad_id)
    return rows, nli_rows


def transfer_evaluator(data_root):
    """The SentEval transfer tasks (shared mirror, else the newest ingested `transfer` dataset) and their source."""
    from evaluation.transfer import TransferEvaluator
    from storage.transfer import load_transfer_input

    source = load_transfer_input(None, DataRoot(data_root), get_settings().shared_data)
    return TransferEvaluator(source.table), source


def fit(cfg: TrainConfig, rows: TrainingRows, nli_rows: TrainingRows | None, run_dir: RunDir, run_id: str,
        device: torch.device, precision: str, evaluator, log_params, log_metrics, stop_after: int | None = None,
        hold_gpu_slot: bool = True) -> LoopResult:
    """Build the model and run the training loop: the single-process job, or one rank of a distributed job
    (tasks/distributed_train.py; only rank 0 calls the callbacks, so `evaluator` may be None elsewhere)."""
    from models.checkpoint import save_checkpoint

    set_seed(cfg.seed)  # the initial prompts, MLPs and heads follow the job's seed (the references seed before building)
    model = build_model(cfg, device)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log_params({"trainable_parameters": n_trainable, "resolved_precision": precision, "resolved_device": str(device),
                "train_rows": len(rows), "corruption_reuse": rows.reuse_description(cfg.epochs)})

    metric = "transfer_dev_avg" if cfg.selection == "transfer" else "stsb_dev"
    transfer_dev = None

    def save_best(m, step, score):
        save_checkpoint(m, run_dir.best, extra_meta={"step": step, metric: score, "run_id": run_id})

    def evaluate_dev(m) -> float:
        nonlocal transfer_dev
        stsb = evaluator.run(m, mode="dev", batch_size=cfg.eval_batch_size, precision=cfg.eval_precision).metrics()["stsb_dev"]
        if cfg.selection != "transfer":
            return stsb
        # SimCSE's trainer with eval_transfer: SentEval fasttest settings, the mean devacc of the 7 tasks
        if transfer_dev is None:
            transfer_dev = transfer_evaluator(get_settings().data_root)[0]
        res = transfer_dev.run(m, classifier="fasttest", batch_size=cfg.eval_batch_size, precision=cfg.eval_precision)
        log_metrics({"stsb_dev": stsb, **{f"{t}_dev": s.devacc for t, s in res.tasks.items()}}, trainer.step)
        return res.dev_score

    loop = LoopConfig(batch_size=cfg.batch_size, learning_rate=cfg.learning_rate, epochs=cfg.epochs,
                      max_steps=cfg.max_steps, grad_clip=cfg.grad_clip, seed=cfg.seed, eval_steps=cfg.eval_steps,
                      checkpoint_steps=cfg.checkpoint_steps or cfg.eval_steps, log_steps=cfg.log_steps,
                      precision=precision, deterministic=cfg.deterministic)
    trainer = Trainer(model, training_phases(cfg, rows, nli_rows), loop, device, run_dir.state, save_best, evaluate_dev,
                      log_metrics, stop_after=stop_after)
    trainer.selection_metric = metric
    if trainer.step == 0 and run_dir.has_state():
        _logger().info("resuming %s from %s", run_id, run_dir.state)
    with gpu_slot(device) if hold_gpu_slot else contextlib.nullcontext():
        return trainer.run()


@task(name="train")
def train_model(cfg: TrainConfig, tokens: DatasetRef, corruption: DatasetRef | None, sts: DatasetRef,
                nli_tokens: DatasetRef | None = None, stop_after: int | None = None,
                extra_tags: dict[str, str] | None = None) -> TrainResult:
    """Train (or resume) one job; select on STS-B dev; test-evaluate the best checkpoint; log everything."""
    from evaluation.evaluator import Evaluator
    from models.checkpoint import load_checkpoint
    from models.st_export import export_sentence_transformer
    from tasks.model_export import log_encoder_model
    from storage.evaluations import load_sts_input
    from tasks.evaluate import record_evaluation

    plog = _logger()
    root = DataRoot(get_settings().data_root)
    device = pick_device(cfg.device)
    precision = resolve_precision(cfg, device)
    if cfg.uses_corruption and corruption is None:
        raise ValueError(f"method {cfg.method} reads corrupted sentences: pass the corruption dataset")
    if cfg.needs_nli and nli_tokens is None:
        raise ValueError(f"{cfg.method}/{cfg.preset} also reads NLI rows: pass nli_tokens")
    corruption = corruption if cfg.uses_corruption else None
    nli_tokens = nli_tokens if cfg.needs_nli else None
    run_dir = RunDir(cfg.method, run_key(cfg, tokens, corruption, nli_tokens))
    tokenizer = load_tokenizer(cfg.backbone)

    if not cfg.distributed:  # (the ranks of a distributed job load their own)
        rows, nli_rows = load_training_rows(cfg, root, tokens, corruption, nli_tokens, tokenizer.pad_token_id)
    sts_input = load_sts_input(sts.key, root)
    evaluator = Evaluator(sts_input.table)

    tags = {"method": cfg.method, "backbone": cfg.backbone, "preset": cfg.preset, "dataset": cfg.dataset,
            "tokens_hash": tokens.content_hash, "corruption_hash": corruption.content_hash if corruption else "none",
            "git_commit": git_commit(), "run_dir": str(run_dir.path)}
    if nli_tokens is not None:
        tags["nli_tokens_hash"] = nli_tokens.content_hash
    if worker := os.environ.get("CSE_WORKER_NAME"):  # set per worker by scripts/team.sh
        tags["worker"] = worker
    tags.update(extra_tags or {})
    if (fr := prefect_flow_run_id()) is not None:
        tags["prefect_flow_run_id"] = str(fr)

    with run_dir.exclusive():  # a second flow of the same job waits, then resumes or returns the result
        if (done := finished_result(run_dir)) is not None:
            plog.info("job %s already finished (MLflow run %s): returning its result", run_dir.path, done.run_id)
            for key, value in (extra_tags or {}).items():  # membership of the experiment that asked again for it
                if key.startswith("cse.member."):
                    mlflow.MlflowClient().set_tag(done.run_id, key, value)
            return done

        with start_or_resume_run(cfg, run_dir, tags) as run:
            # per-step metrics survive an unreachable tracking server (spooled in run_dir, delivered later; warns in this log)
            metrics_log = ResilientMetricLogger(run.info.run_id, run_dir, logger=plog)
            try:
                try:
                    if cfg.distributed:  # (rank 0 logs through its own ResilientMetricLogger into the same spool)
                        from tasks.distributed_train import launch

                        result = launch(cfg, tokens, corruption, nli_tokens, sts, run_dir, run.info.run_id, device, precision,
                                        stop_after)
                    else:
                        result = fit(cfg, rows, nli_rows, run_dir, run.info.run_id, device, precision, evaluator,
                                     metrics_log.log_params, metrics_log.log_metrics, stop_after=stop_after)
                finally:
                    metrics_log.flush()  # deliver what is left, or warn how much stays in the spool and how to deliver it
                mlflow.log_metrics({"train_seconds": result.seconds, "train_sentences_per_s": result.sentences_per_s})
                if result.resumed_from is not None:
                    mlflow.set_tag("resumed_from_step", str(result.resumed_from))

                test_metrics: dict[str, float] = {}
                if cfg.test_evaluation:
                    best = load_checkpoint(run_dir.best, device=device)
                    res = evaluator.run(best, mode="test", batch_size=cfg.eval_batch_size, precision=cfg.eval_precision)
                    record_evaluation(res, label=f"{cfg.method}-{cfg.preset}", sts=sts_input,
                                      what={"method": cfg.method, "checkpoint": str(run_dir.best), "run_id": run.info.run_id,
                                            "backbone": cfg.backbone})
                    test_metrics = res.metrics()
                    if cfg.transfer_evaluation or cfg.selection == "transfer":  # SentEval transfer tasks, test settings
                        from tasks.evaluate_transfer import record_transfer_evaluation

                        transfer, source = transfer_evaluator(root.root)
                        tres = transfer.run(best, classifier="test", batch_size=cfg.eval_batch_size, precision=cfg.eval_precision,
                                            log=plog.info)
                        record_transfer_evaluation(tres, label=f"{cfg.method}-{cfg.preset}", source=source,
                                                   what={"method": cfg.method, "checkpoint": str(run_dir.best),
                                                         "run_id": run.info.run_id, "backbone": cfg.backbone})
                        test_metrics.update(tres.metrics())
                mlflow.log_artifacts(str(run_dir.best), artifact_path="checkpoint")
                mlflow.log_text(json.dumps(cfg.model_dump(), indent=2), "config.json")
                log_encoder_model(run_dir.best)
                export_sentence_transformer(run_dir.best, run_dir.export)
                mlflow.log_artifacts(str(run_dir.export), artifact_path="sentence-transformers")
            except (KeyboardInterrupt, TrainingInterrupted):
                mlflow.end_run(status="KILLED")
                raise
            except BaseException:
                mlflow.end_run(status="FAILED")
                raise
        plog.info("trained %d steps; best %s %.2f at step %s", result.steps,
                  "STS-B dev" if cfg.selection == "stsb" else "transfer dev average", result.best_score or float("nan"), result.best_step)
        out = TrainResult(run_id=run.info.run_id, run_dir=str(run_dir.path), best_checkpoint=str(run_dir.best), steps=result.steps,
                          best_stsb_dev=result.best_score, resumed_from=result.resumed_from, test_metrics=test_metrics)
        run_dir.set_result(out.model_dump())
        return out


def finished_result(run_dir: RunDir) -> TrainResult | None:
    """The recorded result of a finished job whose MLflow run still exists (else None: train or resume)."""
    record = run_dir.result()
    if record is None:
        return None
    configure_mlflow()
    try:
        mlflow.get_run(record["run_id"])
    except mlflow.exceptions.MlflowException:
        log.warning("finished job %s names MLflow run %s, which is gone: running it again", run_dir.path, record["run_id"])
        return None
    return TrainResult.model_validate(record)
