"""Training stage: one Prefect task per training job, one MLflow run per job (resumed jobs continue it)."""

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
from config.training import TrainConfig
from models.loading import load_tokenizer, pick_device
from storage.datasets import DatasetRef
from storage.hashing import stable_hash
from storage.layout import DataRoot
from storage.runs import RunDir
from storage.training_data import load_corruption_rows, load_token_rows
from tasks.ingest import _logger
from tasks.tracking import ensure_experiment, flatten, git_commit, prefect_flow_run_id
from tasks.train_data import TrainingRows
from tasks.trainer import LoopConfig, Trainer, TrainingInterrupted

log = logging.getLogger(__name__)


class TrainResult(BaseModel):
    run_id: str
    run_dir: str
    best_checkpoint: str
    steps: int
    best_stsb_dev: float | None
    resumed_from: int | None
    test_metrics: dict[str, float] = {}


def run_key(cfg: TrainConfig, tokens: DatasetRef, corruption: DatasetRef) -> str:
    return stable_hash({"config": cfg.model_dump(), "tokens": tokens.content_hash, "corruption": corruption.content_hash})


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


def gpu_slot(device: torch.device):
    """Hold one slot of the Prefect global concurrency limit `$CSE_GPU_SLOT` (default `gpu`) while
    training on CUDA, so two jobs never share a GPU unless the limit allows it."""
    if device.type != "cuda" or not prefect_flow_run_id():
        return contextlib.nullcontext()
    from prefect.concurrency.sync import concurrency

    return concurrency(os.environ.get("CSE_GPU_SLOT", "gpu"), occupy=1)


def _model_config(cfg: TrainConfig):
    from models.d2cse import D2CSEModelConfig

    return D2CSEModelConfig(backbone=cfg.backbone, **cfg.model.model_dump())


def build_model(cfg: TrainConfig, device: torch.device):
    from models.d2cse import D2CSE

    return D2CSE(_model_config(cfg)).to(device)


@task(name="train")
def train_model(cfg: TrainConfig, tokens: DatasetRef, corruption: DatasetRef, sts: DatasetRef,
                stop_after: int | None = None) -> TrainResult:
    """Train (or resume) one job; select on STS-B dev; test-evaluate the best checkpoint; log everything."""
    from evaluation.evaluator import Evaluator
    from models.checkpoint import load_checkpoint, save_checkpoint
    from models.st_export import export_sentence_transformer
    from tasks.model_export import log_encoder_model
    from storage.evaluations import load_sts_input
    from tasks.evaluate import record_evaluation

    plog = _logger()
    root = DataRoot(get_settings().data_root)
    device = pick_device(cfg.device)
    precision = resolve_precision(cfg, device)
    run_dir = RunDir(cfg.method, run_key(cfg, tokens, corruption))
    tokenizer = load_tokenizer(cfg.backbone)

    token_rows = load_token_rows(root, tokens.key, ("sent0", "sent1", "hard_neg") if cfg.supervised else ("text",),
                                 limit=cfg.max_train_sentences)
    rows = TrainingRows(token_rows, load_corruption_rows(root, corruption.key, token_rows), cfg.supervised, tokenizer.pad_token_id)
    sts_input = load_sts_input(sts.key, root)
    evaluator = Evaluator(sts_input.table)

    tags = {"method": cfg.method, "backbone": cfg.backbone, "preset": cfg.preset, "dataset": cfg.dataset,
            "tokens_hash": tokens.content_hash, "corruption_hash": corruption.content_hash, "git_commit": git_commit(),
            "run_dir": str(run_dir.path)}
    if (fr := prefect_flow_run_id()) is not None:
        tags["prefect_flow_run_id"] = str(fr)

    with start_or_resume_run(cfg, run_dir, tags) as run:
        try:
            model = build_model(cfg, device)
            n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            mlflow.log_params({"trainable_parameters": n_trainable, "resolved_precision": precision, "resolved_device": str(device),
                               "train_rows": len(rows), "corruption_reuse": rows.reuse_description(cfg.epochs)})

            def save_best(m, step, score):
                save_checkpoint(m, run_dir.best, extra_meta={"step": step, "stsb_dev": score, "run_id": run.info.run_id})

            def evaluate_dev(m) -> float:
                return evaluator.run(m, mode="dev", batch_size=cfg.eval_batch_size).metrics()["stsb_dev"]

            loop = LoopConfig(batch_size=cfg.batch_size, learning_rate=cfg.learning_rate, epochs=cfg.epochs,
                              max_steps=cfg.max_steps, grad_clip=cfg.grad_clip, seed=cfg.seed, eval_steps=cfg.eval_steps,
                              checkpoint_steps=cfg.checkpoint_steps or cfg.eval_steps, log_steps=cfg.log_steps,
                              precision=precision, deterministic=cfg.deterministic)
            trainer = Trainer(model, rows, loop, device, run_dir.state, save_best, evaluate_dev,
                              lambda metrics, step: mlflow.log_metrics(metrics, step=step), stop_after=stop_after)
            if trainer.step == 0 and run_dir.has_state():
                plog.info("resuming %s from %s", run.info.run_id, run_dir.state)
            with gpu_slot(device):
                result = trainer.run()
            mlflow.log_metrics({"train_seconds": result.seconds, "train_sentences_per_s": result.sentences_per_s})
            if result.resumed_from is not None:
                mlflow.set_tag("resumed_from_step", str(result.resumed_from))

            test_metrics: dict[str, float] = {}
            if cfg.test_evaluation:
                best = load_checkpoint(run_dir.best, device=device)
                res = evaluator.run(best, mode="test", batch_size=cfg.eval_batch_size)
                record_evaluation(res, label=f"{cfg.method}-{cfg.preset}", sts=sts_input,
                                  what={"method": cfg.method, "checkpoint": str(run_dir.best), "run_id": run.info.run_id,
                                        "backbone": cfg.backbone})
                test_metrics = res.metrics()
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
    plog.info("trained %d steps; best STS-B dev %.2f at step %s", result.steps, result.best_score or float("nan"), result.best_step)
    return TrainResult(run_id=run.info.run_id, run_dir=str(run_dir.path), best_checkpoint=str(run_dir.best), steps=result.steps,
                       best_stsb_dev=result.best_score, resumed_from=result.resumed_from, test_metrics=test_metrics)
