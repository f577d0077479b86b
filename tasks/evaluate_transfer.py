"""Evaluation stage, mode `transfer`: SentEval's seven transfer tasks (evaluation/transfer.py) for an encoder or a
training checkpoint, recorded as the STS evaluation is: MLflow metrics (`mr` … `mrpc`, `transfer_avg`, accuracy ×100
with two decimals; SentEval's devacc as `<task>_devacc` and `transfer_devacc_avg`, `mrpc_f1`, `<task>_seconds`), result files and a Table 2 row as artifacts, a
Prefect table artifact, and a Parquet row in `evaluations`.

`record_transfer_evaluation` is also what a training job calls (inside its own MLflow run) after scoring its
selected checkpoint.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from cse.config.evaluation import EvalConfig
from cse.evaluation.transfer import TransferEvaluator, TransferResult
from cse.storage.evaluations import row_identity
from cse.storage.layout import DataRoot
from cse.storage.secrets import redact
from cse.storage.settings import get_settings
from cse.storage.transfer import TransferInput, load_transfer_input
from cse.tasks.evaluate_common import EvalSummary, build_embedder, evaluation_run, record_result
from cse.tasks.log import stage_logger
from cse.tracking.lineage import CONTEXT_EVAL, log_dataset_inputs
from cse.tracking.reporting import csv_table, markdown_table

TRANSFER_COLUMNS = ("mr", "cr", "subj", "mpqa", "sst2", "trec", "mrpc")


def table2_row(result: TransferResult, label: str, dev: bool = False) -> str:
    """The papers' Table 2 row of `result` (test accuracy, or SentEval's devacc), header included, as markdown."""
    return markdown_table([result.table_record(label, dev)])


def transfer_evaluation_row(
    result: TransferResult,
    *,
    evaluation_id: str,
    label: str,
    what: dict[str, Any],
    source: TransferInput,
    mlflow_run_id: str | None,
) -> dict[str, Any]:
    """The Parquet row (schema cse.storage.schemas.EVALUATIONS) of a transfer result; STS columns stay null."""
    return {
        **row_identity(
            evaluation_id=evaluation_id,
            mode="transfer",
            label=label,
            what=what,
            embedder=result.embedder,
            mlflow_run_id=mlflow_run_id,
            source=f"transfer:{source.origin}:{source.location}",
            source_hash=source.content_hash,
        ),
        **{t: result.tasks[t].acc if t in result.tasks else None for t in TRANSFER_COLUMNS},
        "transfer_avg": result.transfer_avg,
        "transfer_devacc_avg": result.transfer_devacc_avg,
        "mrpc_f1": result.tasks["mrpc"].f1 if "mrpc" in result.tasks else None,
        "sentences": result.timing.sentences,
        "seconds": result.timing.seconds,
        "details": result.model_dump_json(),
    }


def write_transfer_files(result: TransferResult, label: str, folder: Path) -> dict[str, Path]:
    """Write a transfer result into `folder` (created if missing) as JSON, its Table 2 rows labelled `label` and
    per-task CSV and markdown tables; returns file name → path of each file written."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, text in (
        ("transfer_result.json", result.model_dump_json(indent=2)),
        ("table2.md", table2_row(result, label) + "\n" + table2_row(result, label + " (dev)", dev=True)),
        ("transfer_tasks.csv", csv_table(result.task_rows())),
        ("transfer_tasks.md", markdown_table(result.task_rows())),
    ):
        (folder / name).write_text(text)
        files[name] = folder / name
    return files


def record_transfer_evaluation(
    result: TransferResult,
    *,
    label: str,
    what: dict[str, Any],
    source: TransferInput,
    step: int = 0,
) -> str:
    """Log `result` to the active MLflow run (if any; at `step`: a training job's last, so that its charts are lines),
    write its Parquet row, create Prefect artifacts (inside a Prefect run). Returns the evaluation id. `label` is
    stored masked (`redact`), as `cse.tasks.evaluate.record_evaluation` stores it."""
    label = redact(label)
    evaluation_id = f"transfer-{uuid.uuid4().hex[:16]}"

    def write_files(tmp: Path) -> dict[str, Path]:
        write_transfer_files(result, label, tmp)
        return {"transfer": tmp}

    return record_result(
        evaluation_id,
        metrics={k: float(v) for k, v in result.metrics().items()},
        tags={
            "transfer_evaluation_id": evaluation_id,
            "transfer_source": f"{source.origin}:{source.location}",
            "transfer_hash": source.content_hash,
            "transfer_classifier": result.classifier,
        },
        step=step,
        write_files=write_files,
        row=lambda run_id: transfer_evaluation_row(
            result, evaluation_id=evaluation_id, label=label, what=what, source=source, mlflow_run_id=run_id
        ),
        params={"label": label, "mode": "transfer", **{k: v for k, v in what.items() if v is not None}},
        tables={
            "evaluation-transfer": (
                [result.table_record(label)],
                f"{label}: SentEval transfer accuracy ×100 ({result.classifier} settings)",
            )
        },
        markdown={"evaluation-transfer-details": (transfer_markdown(result, label), f"{label}: transfer tasks")},
    )


def transfer_markdown(result: TransferResult, label: str) -> str:
    """The transfer evaluation as one markdown page (the Prefect artifact `evaluation-transfer-details`)."""
    return "\n".join(
        [
            f"# Transfer tasks ({result.classifier} settings): {label}",
            "",
            table2_row(result, label),
            "",
            "## Per task (dev = SentEval's devacc; seconds = classifier time)",
            "",
            markdown_table(result.task_rows()),
            f"Embedding: {result.timing.sentences} unique sentences in {result.timing.embed_seconds:.1f}s; "
            f"total {result.timing.seconds:.1f}s on {result.device}.",
        ]
    )


def run_transfer_evaluation(config: EvalConfig):
    """The transfer stage in one MLflow run (FAILED on any error): of experiment `config.experiment`, or for a training
    job's checkpoint nested under the job's run (tasks/evaluate_common.py)."""
    log = stage_logger()
    label = config.display_label()
    with evaluation_run(config, "transfer") as (run_id, _, workdir):
        source = load_transfer_input(config.transfer, DataRoot(get_settings().data_root), get_settings().shared_data)
        log_dataset_inputs(run_id, [(source, CONTEXT_EVAL)])
        evaluator = TransferEvaluator(source.table, limit=config.transfer_limit)
        embedder, what = build_embedder(config, run_id, workdir)
        result = evaluator.run(
            embedder,
            tasks=config.transfer_tasks,
            classifier=config.transfer_classifier,
            batch_size=config.batch_size,
            precision=config.precision,
            progress=config.progress,
            log=log.info,
        )
        evaluation_id = record_transfer_evaluation(result, label=label, what=what, source=source)
        log.info(
            "transfer evaluation %s: %s",
            evaluation_id,
            json.dumps({t: s.acc for t, s in result.tasks.items()} | {"transfer_avg": result.transfer_avg}),
        )
        return EvalSummary(
            evaluation_id=evaluation_id,
            mlflow_run_id=run_id,
            mode="transfer",
            label=label,
            metrics=result.metrics(),
            table_row=table2_row(result, label),
        )
