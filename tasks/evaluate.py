"""Evaluation stage: load an embedder (HF model + pooler, or a training checkpoint), score it, and
record the result in MLflow (metrics, tables, plots), a Parquet row and Prefect artifacts.

`record_evaluation` is also what a training flow calls (inside its own MLflow run) after it ran
`evaluation.Evaluator` on its in-memory model.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlflow
from prefect import task
from pydantic import BaseModel

from config.evaluation import EvalConfig
from config.settings import get_settings, redact
from evaluation import Evaluator
from evaluation.plots import alignment_uniformity_plot, cosine_by_gold_plot
from evaluation.results import EvalResult, csv_table, markdown_table
from models.embedder import PooledEncoder, SentenceEmbedder, load_checkpoint_folder, read_checkpoint_config
from models.loading import pick_device
from storage.evaluations import StsInput, load_sts_input, write_evaluation_row
from storage.layout import DataRoot
from tasks.ingest import _logger
from tasks.tracking import configure_mlflow, stage_run

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


# ---------------------------------------------------------------- loading


def resolve_checkpoint(spec: str, download_to: Path) -> Path:
    """A checkpoint folder for `spec`: a local folder, `runs:/<id>[/path]` or a bare MLflow run id
    (its `checkpoint/` artifact folder is downloaded into `download_to`)."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return p
    if spec.startswith("runs:/"):
        rest = spec[len("runs:/"):].strip("/")
        run_id, _, sub = rest.partition("/")
        uri = f"runs:/{run_id}/{sub or CHECKPOINT_ARTIFACT}"
    elif _RUN_ID.match(spec):
        run_id, uri = spec, f"runs:/{spec}/{CHECKPOINT_ARTIFACT}"
    else:
        raise FileNotFoundError(f"checkpoint {spec!r} is neither a local folder nor an MLflow run id (runs:/<id> or 32 hex digits)")
    configure_mlflow()
    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(download_to))
    except Exception as e:  # MlflowException or an OSError from the artifact store
        raise FileNotFoundError(redact(f"cannot download checkpoint {uri} from MLflow ({mlflow.get_tracking_uri()}): {e}")) from None
    return Path(local)


def build_embedder(config: EvalConfig, device, workdir: Path) -> tuple[SentenceEmbedder, dict[str, Any]]:
    """The embedder a config names, and what it is (model, pooler, checkpoint, method)."""
    if config.checkpoint is not None:
        folder = resolve_checkpoint(config.checkpoint, workdir)
        ck = read_checkpoint_config(folder)
        emb = load_checkpoint_folder(folder, device, expect_backbone=config.model, expect_pooler=config.pooler)
        return emb, {"model": ck["backbone"], "pooler": ck["pooler"], "checkpoint": config.checkpoint, "method": ck["method"]}
    emb = PooledEncoder.from_pretrained(config.model, config.pooler, first_layer=config.first_layer,
                                        template=config.template, device=device)
    return emb, {"model": config.model, "pooler": config.pooler, "checkpoint": None, "method": None}


# ---------------------------------------------------------------- recording


def _in_prefect_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def write_result_files(result: EvalResult, label: str, folder: Path) -> dict[str, Path]:
    """Result JSON, tables (CSV + Markdown) and plots under `folder`; returns name → path."""
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}

    def put(name: str, text: str) -> None:
        (folder / name).write_text(text)
        files[name] = folder / name

    put("result.json", result.model_dump_json(indent=2))
    put("table1.md", result.table_row(label) + "\n" + result.table_row(label + " (Pearson)", pearson=True))
    for stem, rows in (("sts_tasks", result.task_rows()), ("sts_subsets", result.subset_rows()), ("retrieval", result.retrieval_rows())):
        if rows:
            put(f"{stem}.csv", csv_table(rows))
            put(f"{stem}.md", markdown_table(rows))
    if result.align_uniform is not None:
        put("alignment_uniformity.json", result.align_uniform.model_dump_json(indent=2))
    if result.qualitative:
        put("qualitative.md", result.qualitative_markdown())
    if result.stsb_test_pairs is not None:
        files["cosine_by_gold.png"] = cosine_by_gold_plot(
            result.stsb_test_pairs["cosine"], result.stsb_test_pairs["gold"], folder / "cosine_by_gold.png",
            title=f"{label}: STS-B test cosine per gold bucket")
    if result.align_uniform is not None:
        au = result.align_uniform
        files["alignment_uniformity.png"] = alignment_uniformity_plot((au.alignment, au.uniformity), label,
                                                                      folder / "alignment_uniformity.png")
    return files


def row_identity(*, evaluation_id: str, mode: str, label: str, what: dict[str, Any], embedder: dict[str, Any],
                 mlflow_run_id: str | None, source: str, source_hash: str) -> dict[str, Any]:
    """The columns every evaluation row shares (STS and transfer): which model, evaluated on which data, when.
    `what` names the evaluated model (keys model or backbone, pooler, checkpoint, method); missing keys come from
    the result's `embedder` description."""
    return {
        "evaluation_id": evaluation_id,
        "created": datetime.now(timezone.utc).isoformat(),
        "mode": mode,
        "label": label,
        "model": what.get("model") or what.get("backbone") or embedder.get("model") or embedder.get("backbone"),
        "pooler": what.get("pooler") or embedder.get("pooler"),
        "checkpoint": what.get("checkpoint"),
        "method": what.get("method") or embedder.get("method"),
        "mlflow_run_id": mlflow_run_id,
        "sts_source": source,
        "sts_hash": source_hash,
    }


def evaluation_row(result: EvalResult, *, evaluation_id: str, label: str, what: dict[str, Any], sts: StsInput,
                   mlflow_run_id: str | None) -> dict[str, Any]:
    """The Parquet row (schema storage.schemas.EVALUATIONS) of one STS result (see `row_identity` for `what`)."""
    def score(name: str) -> float | None:
        return result.tasks[name].spearman if name in result.tasks else None

    row: dict[str, Any] = {
        **row_identity(evaluation_id=evaluation_id, mode=result.mode, label=label, what=what, embedder=result.embedder,
                       mlflow_run_id=mlflow_run_id, source=f"{sts.origin}:{sts.location}", source_hash=sts.content_hash),
        **{t: score(t) for t in ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr", "stsb_dev", "sickr_dev")},
        "sts_avg": result.sts_avg,
        "sts_avg_pearson": result.sts_avg_pearson,
        "alignment": result.align_uniform.alignment if result.align_uniform else None,
        "uniformity": result.align_uniform.uniformity if result.align_uniform else None,
        "sentences": result.timing.sentences,
        "seconds": result.timing.seconds,
        "details": result.model_dump_json(),
    }
    if result.retrieval is not None:
        row["retrieval_match"] = result.retrieval.match
        for k, v in result.retrieval.headline().items():
            row[f"retrieval_r{k}"] = v
    return row


def record_evaluation(
    result: EvalResult,
    *,
    label: str,
    what: dict[str, Any],
    sts: StsInput,
    metric_prefix: str = "",
    artifact_path: str = "evaluation",
    write_row: bool = True,
) -> str:
    """Log `result` to the active MLflow run (if any), write its Parquet row, create Prefect artifacts
    (inside a Prefect run). Returns the evaluation id (= the `evaluations` dataset key)."""
    evaluation_id = f"{result.mode}-{uuid.uuid4().hex[:16]}"
    run = mlflow.active_run()
    run_id = run.info.run_id if run is not None else None
    if run is not None:
        mlflow.log_metrics({f"{metric_prefix}{k}": float(v) for k, v in result.metrics().items()})
        mlflow.set_tags({"evaluation_id": evaluation_id, "sts_source": f"{sts.origin}:{sts.location}", "sts_hash": sts.content_hash})
        with tempfile.TemporaryDirectory(prefix="cse-eval-") as tmp:
            files = write_result_files(result, label, Path(tmp) / "files")
            plots = Path(tmp) / "plots"
            plots.mkdir()
            for name, path in files.items():
                if name.endswith(".png"):
                    path.rename(plots / name)
            mlflow.log_artifacts(str(Path(tmp) / "files"), artifact_path=artifact_path)
            if any(plots.iterdir()):
                mlflow.log_artifacts(str(plots), artifact_path="plots")
    if write_row:
        root = DataRoot(get_settings().data_root)
        write_evaluation_row(root, evaluation_row(result, evaluation_id=evaluation_id, label=label, what=what, sts=sts,
                                                  mlflow_run_id=run_id), params={"label": label, **what})
    if _in_prefect_run():
        from prefect.artifacts import create_markdown_artifact, create_table_artifact

        create_table_artifact(table=[result.table_record(label)], key=f"evaluation-{result.mode}",
                              description=f"{label}: Spearman ×100 ({'STS12–16 all, STS-B/SICK-R test' if result.mode == 'test' else 'dev'})")
        parts = [f"# Evaluation ({result.mode}): {label}", "", result.table_row(label), result.table_row(label + " (Pearson)", pearson=True)]
        if result.retrieval is not None:
            parts += ["## Retrieval (STS-B test, gold-5.0 pairs, both directions)", "", markdown_table(result.retrieval_rows())]
        if result.align_uniform is not None:
            au = result.align_uniform
            parts += [f"## Alignment / uniformity\n\nalignment {au.alignment:.4f} ({au.n_positive_pairs} pairs, gold "
                      f"{'>=' if au.inclusive else '>'} {au.threshold}), uniformity {au.uniformity:.4f} ({au.n_sentences} sentences, t={au.t})", ""]
        if result.qualitative:
            parts += ["## Qualitative retrieval", "", result.qualitative_markdown()]
        create_markdown_artifact(markdown="\n".join(parts), key=f"evaluation-{result.mode}-details",
                                 description=f"{label}: full evaluation")
    return evaluation_id


# ---------------------------------------------------------------- the stage


def run_evaluation(config: EvalConfig) -> EvalSummary:
    """The whole stage in one MLflow run of experiment `config.experiment` (FAILED on any error)."""
    if config.mode == "transfer":  # SentEval's classification tasks: tasks/evaluate_transfer.py
        from tasks.evaluate_transfer import run_transfer_evaluation

        return run_transfer_evaluation(config)
    log = _logger()
    label = config.display_label()
    run_name = f"evaluate-{config.mode}-{label}"[:250]
    with stage_run(config.experiment, run_name, params=config.model_dump(), tags={"stage": "evaluate", "mode": config.mode}) as run, \
            tempfile.TemporaryDirectory(prefix="cse-ckpt-") as workdir:
        t0 = time.perf_counter()
        sts = load_sts_input(config.sts, DataRoot(get_settings().data_root), get_settings().shared_data)
        evaluator = Evaluator(sts.table, **config.evaluator_kwargs())
        device = pick_device(config.device)
        embedder, what = build_embedder(config, device, Path(workdir))
        mlflow.set_tags({k: str(v) for k, v in what.items() if v is not None})
        result = evaluator.run(embedder, mode=config.mode, tasks=config.tasks, extras=config.extras,
                               batch_size=config.batch_size, precision=config.precision, progress=config.progress)
        evaluation_id = record_evaluation(result, label=label, what=what, sts=sts)
        mlflow.log_metric("stage_seconds", time.perf_counter() - t0)
        log.info("evaluation %s (%s): %s", evaluation_id, config.mode,
                 json.dumps({k: round(v, 2) for k, v in result.metrics().items() if "/" not in k}))
        return EvalSummary(evaluation_id=evaluation_id, mlflow_run_id=run.info.run_id, mode=config.mode, label=label,
                           metrics=result.metrics(), table_row=result.table_row(label))


@task(name="evaluate-embedder", retries=0)
def evaluate_task(config: EvalConfig) -> EvalSummary:
    """Prefect task around `run_evaluation`."""
    return run_evaluation(config)
