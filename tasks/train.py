"""Training stage: one Prefect task per training job, one MLflow run per job (resumed jobs continue it).

The task is the seam between the training engine (training/: rows, loop, job, distributed) and orchestration and
tracking: it holds the GPU slot, starts or resumes the job's MLflow run (tracking.runs), injects the MLflow metric
logger into `training.job.fit`, then test-evaluates the best checkpoint and records artifacts and the result.

A job with `nproc_per_node × nnodes` > 1 trains under torchrun (`training.distributed.launch`; every rank runs
tasks/distributed_train.py, i.e. `fit` on its slice of each global batch, rank 0 logging into this job's MLflow run);
the task waits for it and then does the rest (test evaluation, artifacts, export) as for a single-process job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

import torch
from prefect import task
from pydantic import BaseModel

from config.settings import get_settings
from config.training import TrainConfig
from models.loading import load_tokenizer, pick_device
from storage.datasets import DatasetRef
from storage.layout import DataRoot
from storage.runs import RunDir
from tasks.distributed_train import WORKER_MODULE
from tasks.log import stage_logger
from tracking.lineage import CONTEXT_CORRUPTION, CONTEXT_EVAL, CONTEXT_TRAIN, log_dataset_inputs
from tracking.provenance import git_commit, prefect_flow_run_id
from tracking.spool import ResilientMetricLogger
from tracking.stage_runs import log_run_results
from tracking.training_runs import training_run, training_run_exists
from training import job as train_job
from training.distributed import DistributedJob, launch
from training.loop import TrainingInterrupted

log = logging.getLogger(__name__)


class TrainResult(BaseModel):
    run_id: str
    run_dir: str
    best_checkpoint: str
    steps: int
    best_stsb_dev: float | None
    resumed_from: int | None
    test_metrics: dict[str, float] = {}


def gpu_slot(device: torch.device, occupy: int = 1):
    """Hold `occupy` slots (one per GPU) of the Prefect global concurrency limit `$CSE_GPU_SLOT` (default `gpu`)
    while training on CUDA, so two jobs never share a GPU unless the limit allows it."""
    if device.type != "cuda" or not prefect_flow_run_id():
        return contextlib.nullcontext()
    from prefect.concurrency.sync import concurrency

    return concurrency(os.environ.get("CSE_GPU_SLOT", "gpu"), occupy=occupy)


@task(name="train")
def train_model(cfg: TrainConfig, tokens: DatasetRef, corruption: DatasetRef | None, sts: DatasetRef,
                nli_tokens: DatasetRef | None = None, stop_after: int | None = None,
                extra_tags: dict[str, str] | None = None) -> TrainResult:
    """Train (or resume) one job; select on STS-B dev; test-evaluate the best checkpoint; log everything."""
    from evaluation.evaluator import Evaluator
    from models.checkpoint import load_checkpoint
    from models.st_export import export_sentence_transformer
    from storage.evaluations import load_sts_input
    from tasks.evaluate import record_evaluation
    from tracking.model_card import CardFacts, write_model_card
    from tracking.model_export import log_encoder_model, registered_model_name

    plog = stage_logger()
    root = DataRoot(get_settings().data_root)
    device = pick_device(cfg.device)
    precision = train_job.resolve_precision(cfg, device)
    if cfg.uses_corruption and corruption is None:
        raise ValueError(f"method {cfg.method} reads corrupted sentences: pass the corruption dataset")
    if cfg.needs_nli and nli_tokens is None:
        raise ValueError(f"{cfg.method}/{cfg.preset} also reads NLI rows: pass nli_tokens")
    corruption = corruption if cfg.uses_corruption else None
    nli_tokens = nli_tokens if cfg.needs_nli else None
    run_dir = RunDir(cfg.method, train_job.run_key(cfg, tokens, corruption, nli_tokens))
    tokenizer = load_tokenizer(cfg.backbone)

    if not cfg.distributed:  # (the ranks of a distributed job load their own)
        rows, nli_rows = train_job.load_training_rows(cfg, root, tokens, corruption, nli_tokens, tokenizer.pad_token_id)
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
        if (done := finished_result(run_dir, plog)) is not None:
            plog.info("job %s already finished (MLflow run %s): returning its result", run_dir.path, done.run_id)
            # membership of the experiment that asked again for it
            log_run_results(done.run_id, tags={k: v for k, v in (extra_tags or {}).items() if k.startswith("cse.member.")})
            return done

        with training_run(cfg.method, run_dir, f"{cfg.method}-{cfg.preset}", tags, cfg.model_dump(), cfg.system_metrics,
                          killed=(KeyboardInterrupt, TrainingInterrupted)) as run:
            log_dataset_inputs(run.info.run_id, [(tokens, CONTEXT_TRAIN), *([(corruption, CONTEXT_CORRUPTION)] if corruption else []),
                                                 *([(nli_tokens, CONTEXT_TRAIN)] if nli_tokens else []), (sts, CONTEXT_EVAL)])
            # per-step metrics survive an unreachable tracking server (spooled in run_dir, delivered later; warns in this log)
            metrics_log = ResilientMetricLogger(run.info.run_id, run_dir, logger=plog)
            try:
                if cfg.distributed:  # (rank 0 logs through its own ResilientMetricLogger into the same spool)
                    job = DistributedJob(config=cfg, tokens=tokens, corruption=corruption, nli_tokens=nli_tokens, sts=sts,
                                         run_dir=str(run_dir.path), run_id=run.info.run_id, precision=precision,
                                         stop_after=stop_after)
                    result = launch(job, WORKER_MODULE, gpu_slot(device, occupy=cfg.nproc_per_node), plog)
                else:
                    result = train_job.fit(cfg, rows, nli_rows, run_dir, run.info.run_id, device, precision, evaluator,
                                           metrics_log.log_params, metrics_log.log_metrics, stop_after=stop_after,
                                           slot=gpu_slot(device), logger=plog)
            finally:
                metrics_log.flush()  # deliver what is left, or warn how much stays in the spool and how to deliver it
            log_run_results(run.info.run_id, metrics={"train_seconds": result.seconds,
                                                      "train_sentences_per_s": result.sentences_per_s},
                            tags={} if result.resumed_from is None else {"resumed_from_step": result.resumed_from})

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

                    transfer, source = train_job.transfer_evaluator(root.root)
                    log_dataset_inputs(run.info.run_id, [(source, CONTEXT_EVAL)])
                    tres = transfer.run(best, classifier="test", batch_size=cfg.eval_batch_size, precision=cfg.eval_precision,
                                        log=plog.info)
                    record_transfer_evaluation(tres, label=f"{cfg.method}-{cfg.preset}", source=source,
                                               what={"method": cfg.method, "checkpoint": str(run_dir.best),
                                                     "run_id": run.info.run_id, "backbone": cfg.backbone})
                    test_metrics.update(tres.metrics())
            log_run_results(run.info.run_id, folders={"checkpoint": run_dir.best},
                            texts={"config.json": json.dumps(cfg.model_dump(), indent=2)})
            logged = log_encoder_model(run_dir.best, registered_name=registered_model_name(cfg.method, cfg.backbone, cfg.preset),
                                       version_tags={k: tags[k] for k in ("method", "backbone", "preset", "tokens_hash", "corruption_hash")})
            export_sentence_transformer(run_dir.best, run_dir.export)
            adapter = export_adapter(cfg.method, run_dir, plog)
            facts = CardFacts.from_training(
                cfg, test_metrics, tokens=tokens, corruption=corruption, nli_tokens=nli_tokens, run_id=run.info.run_id,
                registered_name=logged.registered_name if logged.version else None, version=logged.version,
                logged_model_uri=logged.model_uri, git_commit=tags["git_commit"], checkpoint=run_dir.best,
                adapter=adapter, steps=result.steps, best_stsb_dev=result.best_score)
            folders = {"sentence-transformers": write_model_card(run_dir.export, facts).parent}
            if adapter is not None:
                folders["peft-adapter"] = write_model_card(adapter.folder, facts).parent
            log_run_results(run.info.run_id, folders=folders)
        plog.info("trained %d steps; best %s %.2f at step %s", result.steps,
                  "STS-B dev" if cfg.selection == "stsb" else "transfer dev average", result.best_score or float("nan"), result.best_step)
        out = TrainResult(run_id=run.info.run_id, run_dir=str(run_dir.path), best_checkpoint=str(run_dir.best), steps=result.steps,
                          best_stsb_dev=result.best_score, resumed_from=result.resumed_from, test_metrics=test_metrics)
        run_dir.set_result(out.model_dump())
        return out


def export_adapter(method: str, run_dir: RunDir, logger):
    """The best checkpoint of a prompt method as a PEFT prefix-tuning adapter (`models.peft_export`), or None.

    Only prompt methods have one. A backbone PEFT cannot prefix (e.g. DistilBERT: no past key/values) or a feature it
    cannot hold exactly is refused by the export with its reason, which is logged: the sentence-transformers export
    and the MLflow model stand either way."""
    from models.peft_export import PROMPT_METHODS, PeftExportError, export_peft_adapter

    if method not in PROMPT_METHODS:
        return None
    try:
        return export_peft_adapter(run_dir.best, run_dir.peft_adapter)
    except PeftExportError as e:
        logger.warning("no PEFT adapter for %s: %s", run_dir.path, e)
        return None


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
        say("finished job %s: its recorded result is damaged (%s; moved to %s); its checkpoint and training state are "
            "intact: evaluating and recording it again", run_dir.path, "; ".join(check.result_problems), moved)
        return None
    record = check.record
    if not training_run_exists(record["run_id"]):
        log.warning("finished job %s names MLflow run %s, which is gone: running it again", run_dir.path, record["run_id"])
        return None
    return TrainResult.model_validate(record)
