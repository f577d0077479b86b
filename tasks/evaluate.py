"""Evaluation stage: load an embedder (HF model + pooler, or a training checkpoint), score it, and
record the result in MLflow (metrics, tables, plots), a Parquet row and Prefect artifacts.

`record_evaluation` is also what a training flow calls (inside its own MLflow run) after it ran
`evaluation.Evaluator` on its in-memory model.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from prefect import task

from cse.config.evaluation import EvalConfig
from cse.evaluation import Evaluator
from cse.evaluation.plots import alignment_uniformity_plot, cosine_by_gold_plot
from cse.evaluation.results import EvalResult
from cse.storage.evaluations import StsInput, load_sts_input, row_identity
from cse.storage.layout import DataRoot
from cse.storage.secrets import redact
from cse.storage.settings import get_settings
from cse.tasks.evaluate_common import (
    EvalSummary,
    build_embedder,
    check_same_sts,
    check_training_sts,
    evaluation_run,
    record_result,
)
from cse.tasks.log import embedding_progress, stage_logger
from cse.tracking.lineage import CONTEXT_EVAL, log_dataset_inputs
from cse.tracking.reporting import csv_table, markdown_table
from cse.tracking.run_pages import page_metrics, score_tags

# ---------------------------------------------------------------- recording


def table1_row(result: EvalResult, label: str, pearson: bool = False) -> str:
    """The papers' Table 1 row of `result` (Spearman, or Pearson), header included, as markdown."""
    return markdown_table([result.table_record(label, pearson)])


def qualitative_markdown(result: EvalResult) -> str:
    """Per qualitative query: the query (and its answers), then its nearest neighbours as a markdown table."""
    out = []
    for q in result.qualitative:
        answers = f"  (answer: {' | '.join(q.answers)})" if q.answers else ""
        neighbours = [
            {"rank": i + 1, "sentence": n.sentence, "cosine": f"{n.cosine:.4f}", "answer": "✓" if n.is_answer else ""}
            for i, n in enumerate(q.neighbours)
        ]
        out += [f"**Query:** {q.query}{answers}", "", markdown_table(neighbours), ""]
    return "\n".join(out)


def write_result_files(result: EvalResult, label: str, folder: Path) -> dict[str, Path]:
    """Result JSON, tables (CSV + Markdown) and plots under `folder`; returns name → path."""
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}

    def put(name: str, text: str) -> None:
        (folder / name).write_text(text)
        files[name] = folder / name

    put("result.json", result.model_dump_json(indent=2))
    put("table1.md", table1_row(result, label) + "\n" + table1_row(result, label + " (Pearson)", pearson=True))
    for stem, rows in (
        ("sts_tasks", result.task_rows()),
        ("sts_subsets", result.subset_rows()),
        ("retrieval", result.retrieval_rows()),
    ):
        if rows:
            put(f"{stem}.csv", csv_table(rows))
            put(f"{stem}.md", markdown_table(rows))
    if result.align_uniform is not None:
        put("alignment_uniformity.json", result.align_uniform.model_dump_json(indent=2))
    if result.qualitative:
        put("qualitative.md", qualitative_markdown(result))
    if result.stsb_test_pairs is not None:
        files["cosine_by_gold.png"] = cosine_by_gold_plot(
            result.stsb_test_pairs["cosine"],
            result.stsb_test_pairs["gold"],
            folder / "cosine_by_gold.png",
            title=f"{label}: STS-B test cosine per gold bucket",
        )
    if result.align_uniform is not None:
        au = result.align_uniform
        files["alignment_uniformity.png"] = alignment_uniformity_plot(
            (au.alignment, au.uniformity), label, folder / "alignment_uniformity.png"
        )
    return files


def evaluation_row(
    result: EvalResult,
    *,
    evaluation_id: str,
    label: str,
    what: dict[str, Any],
    sts: StsInput,
    mlflow_run_id: str | None,
) -> dict[str, Any]:
    """The Parquet row (schema cse.storage.schemas.EVALUATIONS) of one STS result (see `row_identity` for `what`)."""

    def score(name: str) -> float | None:
        return result.tasks[name].spearman if name in result.tasks else None

    row: dict[str, Any] = {
        **row_identity(
            evaluation_id=evaluation_id,
            mode=result.mode,
            label=label,
            what=what,
            embedder=result.embedder,
            mlflow_run_id=mlflow_run_id,
            source=f"{sts.origin}:{sts.location}",
            source_hash=sts.content_hash,
        ),
        **{
            t: score(t) for t in ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr", "stsb_dev", "sickr_dev")
        },
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
    subset_metrics: bool = True,
    step: int = 0,
) -> str:
    """Log `result` to the active MLflow run (if any; at `step`, with its score tags), write its Parquet row, create
    Prefect artifacts (inside a Prefect run). Returns the evaluation id (= the `evaluations` dataset key).

    `subset_metrics=False` (a training run, a re-evaluation nested under one) logs only the headline metrics
    (`cse.tracking.run_pages.page_metrics`): the per-subset scores and the evaluator's other single values stay in the
    run's `evaluation/` files and would bury the curves on its charts (`cse.tracking.run_pages`).

    `label` (free text: a user's, or a training run's name, which may quote a source URL) is stored masked
    (`redact`) in every record: the run's files, the Parquet row, the Prefect artifacts."""
    label = redact(label)
    evaluation_id = f"{result.mode}-{uuid.uuid4().hex[:16]}"
    metrics = result.metrics() if subset_metrics else page_metrics(result.metrics())

    def write_files(tmp: Path) -> dict[str, Path]:  # the result files, their plots in a folder of their own
        files = write_result_files(result, label, tmp / "files")
        plots = tmp / "plots"
        plots.mkdir()
        for name, path in files.items():
            if name.endswith(".png"):
                path.rename(plots / name)
        return {"evaluation": tmp / "files", **({"plots": plots} if any(plots.iterdir()) else {})}

    return record_result(
        evaluation_id,
        metrics={k: float(v) for k, v in metrics.items()},
        tags={
            "evaluation_id": evaluation_id,
            "sts_source": f"{sts.origin}:{sts.location}",
            "sts_hash": sts.content_hash,
            **(score_tags(result.metrics()) if result.mode == "test" else {}),
        },
        step=step,
        write_files=write_files,
        row=lambda run_id: evaluation_row(
            result, evaluation_id=evaluation_id, label=label, what=what, sts=sts, mlflow_run_id=run_id
        ),
        params={"label": label, **what},
        tables={
            f"evaluation-{result.mode}": (
                [result.table_record(label)],
                f"{label}: Spearman ×100 ({'STS12–16 all, STS-B/SICK-R test' if result.mode == 'test' else 'dev'})",
            )
        },
        markdown={
            f"evaluation-{result.mode}-details": (evaluation_markdown(result, label), f"{label}: full evaluation")
        },
    )


def evaluation_markdown(result: EvalResult, label: str) -> str:
    """The full evaluation as one markdown page (the Prefect artifact `evaluation-<mode>-details`)."""
    parts = [
        f"# Evaluation ({result.mode}): {label}",
        "",
        table1_row(result, label),
        table1_row(result, label + " (Pearson)", pearson=True),
    ]
    if result.retrieval is not None:
        parts += [
            "## Retrieval (STS-B test, gold-5.0 pairs, both directions)",
            "",
            markdown_table(result.retrieval_rows()),
        ]
    if result.align_uniform is not None:
        au = result.align_uniform
        parts += [
            f"## Alignment / uniformity\n\nalignment {au.alignment:.4f} ({au.n_positive_pairs} pairs, gold "
            f"{'>=' if au.inclusive else '>'} {au.threshold}), uniformity {au.uniformity:.4f} ({au.n_sentences} sentences, t={au.t})",
            "",
        ]
    if result.qualitative:
        parts += ["## Qualitative retrieval", "", qualitative_markdown(result)]
    return "\n".join(parts)


# ---------------------------------------------------------------- the stage


def run_evaluation(config: EvalConfig) -> EvalSummary:
    """The whole stage in one MLflow run (FAILED on any error): of experiment `config.experiment`, or for a training
    job's checkpoint nested under the job's run, on the `sts` dataset the job used (tasks/evaluate_common.py)."""
    if config.mode == "transfer":  # SentEval's classification tasks: tasks/evaluate_transfer.py
        from cse.tasks.evaluate_transfer import run_transfer_evaluation

        return run_transfer_evaluation(config)
    log = stage_logger()
    label = config.display_label()
    with evaluation_run(config, config.mode) as (run_id, where, workdir):
        root = DataRoot(get_settings().data_root)
        check_training_sts(where, config, root)
        sts = load_sts_input(where.sts, root, get_settings().shared_data)
        check_same_sts(where, sts)
        log_dataset_inputs(run_id, [(sts, CONTEXT_EVAL)])
        evaluator = Evaluator(sts.table, **config.evaluator_kwargs())
        embedder, what = build_embedder(config, run_id, workdir)
        result = evaluator.run(
            embedder,
            mode=config.mode,
            tasks=config.tasks,
            extras=config.extras,
            batch_size=config.batch_size,
            precision=config.precision,
            progress=config.progress,
            on_progress=embedding_progress("evaluate"),
        )
        # nested under a training run: its headline scores only (the subsets would fill the experiment's charts)
        evaluation_id = record_evaluation(result, label=label, what=what, sts=sts, subset_metrics=where.parent is None)
        log.info(
            "evaluation %s (%s): %s",
            evaluation_id,
            config.mode,
            json.dumps({k: round(v, 2) for k, v in result.metrics().items() if "/" not in k}),
        )
        return EvalSummary(
            evaluation_id=evaluation_id,
            mlflow_run_id=run_id,
            mode=config.mode,
            label=label,
            metrics=result.metrics(),
            table_row=table1_row(result, label),
        )


@task(name="evaluate-embedder", retries=0)
def evaluate_task(config: EvalConfig) -> EvalSummary:
    """Prefect task around `run_evaluation`."""
    return run_evaluation(config)
