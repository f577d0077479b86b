"""What both modes of the evaluation stage share (STS: tasks/evaluate.py, SentEval transfer:
tasks/evaluate_transfer.py): the embedder a config names, where its MLflow run goes, how a result is recorded
(`record_result`: the run, the Parquet row, the Prefect artifacts) and the summary the stage returns.

A re-evaluation of a training job's checkpoint (`runs:/<id>`, a bare run id, or the job folder's `best/`) is logged in
the training run's experiment, nested under that run (`TrainingRunRef.link_tags`), and scores the ingested `sts`
dataset the job was evaluated on, whose content hash must be the run's `sts_hash`."""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from cse.config.evaluation import DEFAULT_EXPERIMENT, EvalConfig
from cse.models.checkpoint import load_checkpoint_folder, read_checkpoint_config
from cse.models.embedder import PooledEncoder, SentenceEmbedder
from cse.models.loading import pick_device
from cse.storage.evaluations import StsInput, write_evaluation_row
from cse.storage.layout import DataRoot
from cse.storage.runs import checkpoint_job_run_id
from cse.storage.settings import get_settings
from cse.tracking.reporting import publish_artifacts
from cse.tracking.stage_runs import active_run_id, log_run_results, stage_run
from cse.tracking.store import download_checkpoint
from cse.tracking.training_runs import TrainingRunRef, training_run_ref

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
CHECKPOINT_ARTIFACT = "checkpoint"


class EvalSummary(BaseModel):
    """What the stage returns: where the result lives and its headline numbers."""

    evaluation_id: str
    mlflow_run_id: str | None
    mode: str
    label: str
    metrics: dict[str, float]
    table_row: str


def checkpoint_run_id(spec: str) -> str | None:
    """The MLflow run a checkpoint spec names: `runs:/<id>[/path]`, a bare run id, or (a local folder) the run of the
    training job whose `best/` it is; None for any other folder."""
    if spec.startswith("runs:/"):
        return spec[len("runs:/") :].strip("/").partition("/")[0] or None
    if _RUN_ID.match(spec) and not Path(spec).expanduser().is_dir():
        return spec
    return checkpoint_job_run_id(spec) if Path(spec).expanduser().is_dir() else None


class EvalPlacement(BaseModel):
    """Where an evaluation's MLflow run goes: its experiment, run name and extra tags, the `sts` input to read (None:
    the stage's default) and the training run it re-evaluates (None: a plain model or a checkpoint of no job)."""

    experiment: str
    run_name: str
    tags: dict[str, str]
    sts: str | None
    parent: TrainingRunRef | None


def placement(config: EvalConfig) -> EvalPlacement:
    """The experiment, run name, link tags and `sts` input of an evaluation (module docstring). A checkpoint whose run
    cannot be read back is placed as a plain checkpoint (its download then names the problem)."""
    parent = None
    if config.checkpoint is not None and (run_id := checkpoint_run_id(config.checkpoint)) is not None:
        try:
            parent = training_run_ref(run_id)
        except FileNotFoundError:
            parent = None
    label = config.label or (parent.run_name if parent else config.display_label())
    return EvalPlacement(
        experiment=config.experiment or (parent.experiment if parent else DEFAULT_EXPERIMENT),
        run_name=f"evaluate-{config.mode}-{label}"[:250],
        tags=parent.link_tags() if parent else {},
        sts=config.sts if config.sts is not None or parent is None else parent.sts_key,
        parent=parent,
    )


def check_training_sts(where: EvalPlacement, config: EvalConfig, root: DataRoot) -> None:
    """Before reading it: the `sts` dataset a re-evaluated job used is in the data root (else a FileNotFoundError
    naming it and the fixes)."""
    parent = where.parent
    if parent is None or config.sts is not None or parent.sts_key is None:
        return
    if root.find("sts", parent.sts_key) is None:
        raise FileNotFoundError(
            f"training run {parent.run_id} ({parent.run_name}) was evaluated on the sts dataset {parent.sts_key}, "
            f"which is not under {root.root}: ingest the same SentEval source again (flow `ingest`), or pass "
            "config.sts (a SentEval folder or another sts dataset key) to score other data"
        )


def check_same_sts(where: EvalPlacement, sts: StsInput) -> None:
    """The `sts` data read for a re-evaluated job has the content hash the job's run records (`sts_hash`)."""
    parent = where.parent
    if parent is None or parent.sts_hash is None or sts.location != parent.sts_key:
        return
    if sts.content_hash != parent.sts_hash:
        raise ValueError(
            f"sts dataset {parent.sts_key} now has content hash {sts.content_hash}, but training run "
            f"{parent.run_id} recorded {parent.sts_hash}: the scores would not be comparable"
        )


def resolve_checkpoint(spec: str, download_to: Path) -> Path:
    """A checkpoint folder for `spec`: a local folder, `runs:/<id>[/path]` or a bare MLflow run id
    (its `checkpoint/` artifact folder is downloaded into `download_to`)."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return p
    if spec.startswith("runs:/"):
        rest = spec[len("runs:/") :].strip("/")
        run_id, _, sub = rest.partition("/")
        uri = f"runs:/{run_id}/{sub or CHECKPOINT_ARTIFACT}"
    elif _RUN_ID.match(spec):
        run_id, uri = spec, f"runs:/{spec}/{CHECKPOINT_ARTIFACT}"
    else:
        raise FileNotFoundError(
            f"checkpoint {spec!r} is neither a local folder nor an MLflow run id (runs:/<id> or 32 hex digits)"
        )
    return download_checkpoint(uri, download_to)


@contextmanager
def evaluation_run(config: EvalConfig, mode: str) -> Iterator[tuple[str, EvalPlacement, Path]]:
    """Yields the id of the stage's MLflow run (params `config`, tag `mode`; FAILED on any error), its `placement` and
    a scratch folder for a downloaded checkpoint; logs the run's `stage_seconds` when the stage's body ends."""
    where = placement(config)
    tags = {"stage": "evaluate", "mode": mode, **where.tags}
    with (
        stage_run(where.experiment, where.run_name, params=config.model_dump(), tags=tags) as run,
        tempfile.TemporaryDirectory(prefix="cse-ckpt-") as workdir,
    ):
        t0 = time.perf_counter()
        yield run.info.run_id, where, Path(workdir)
        log_run_results(run.info.run_id, metrics={"stage_seconds": time.perf_counter() - t0})


def build_embedder(config: EvalConfig, run_id: str, workdir: Path) -> tuple[SentenceEmbedder, dict[str, Any]]:
    """The embedder a config names, on `config.device`, and what it is (model, pooler, checkpoint, method), whose
    known values are also tagged on the stage's run `run_id`."""
    device = pick_device(config.device)
    if config.checkpoint is not None:
        folder = resolve_checkpoint(config.checkpoint, workdir)
        ck = read_checkpoint_config(folder)
        emb = load_checkpoint_folder(folder, device, expect_backbone=config.model, expect_pooler=config.pooler)
        what = dict(model=ck["backbone"], pooler=ck["pooler"], checkpoint=config.checkpoint, method=ck["method"])
    elif config.model is not None and config.pooler is not None:  # (EvalConfig: set both without a checkpoint)
        emb = PooledEncoder.from_pretrained(
            config.model, config.pooler, first_layer=config.first_layer, template=config.template, device=device
        )
        what = {"model": config.model, "pooler": config.pooler, "checkpoint": None, "method": None}
    else:
        raise ValueError("set `model` (with `pooler`) or `checkpoint`")
    log_run_results(run_id, tags={k: v for k, v in what.items() if v is not None})
    return emb, what


def record_result(
    evaluation_id: str,
    *,
    metrics: dict[str, float],
    tags: dict[str, Any],
    step: int,
    write_files: Callable[[Path], dict[str, Path]],
    row: Callable[[str | None], dict[str, Any]],
    params: dict[str, Any],
    tables: dict[str, tuple[list[dict[str, Any]], str]],
    markdown: dict[str, tuple[str, str]],
) -> str:
    """Record one evaluation (STS: tasks/evaluate.py, transfer: tasks/evaluate_transfer.py); returns `evaluation_id`.

    In the active MLflow run (if any): `metrics` and `tags` at `step`, and the files `write_files(folder)` writes
    under a scratch folder (it returns artifact path → folder). Then the Parquet row `row(run id or None)` of the
    `evaluations` dataset (with `params`) and, inside a Prefect run, the `tables` and `markdown` artifacts."""
    run_id = active_run_id()
    if run_id is not None:
        log_run_results(run_id, metrics=metrics, tags=tags, step=step)
        with tempfile.TemporaryDirectory(prefix="cse-eval-") as tmp:
            log_run_results(run_id, folders=write_files(Path(tmp)))
    write_evaluation_row(DataRoot(get_settings().data_root), row(run_id), params=params)
    publish_artifacts(tables=tables, markdown=markdown)
    return evaluation_id
