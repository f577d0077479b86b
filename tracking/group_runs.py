"""Runs that stand for several others: the parent run of an experiment's children, and a comparison's run."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow

from cse.tracking.run_pages import NOTE_TAG, artifact_image
from cse.tracking.store import ensure_experiment, flatten


def start_group_run(experiment_id: str, run_name: str, tags: Mapping[str, str], params: Mapping[str, Any]) -> str:
    """The parent run of a group of children (flows/children.py), with the group's params (flattened); it ends at
    once (FINISHED), its children nest under it by tag. Returns its id."""
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=dict(tags)) as run:
        mlflow.log_params(flatten(params))
    return run.info.run_id


COMPARISON_TABLE = "comparison_table.json"  # the `compare` run's MLflow table (mlflow.log_table)
COMPARISON_CHART = "comparison_sts.png"  # the `compare` run's chart: every run × the STS tasks


def log_comparison(
    comparison_id: str,
    selection: Mapping[str, Any],
    markdown: str,
    csv_text: str,
    runs: int,
    table: Mapping[str, list[Any]] | None = None,
    tags: Mapping[str, str] | None = None,
    description: str | None = None,
    chart: str | Path | None = None,
) -> str:
    """A run of experiment `compare` for one comparison: `selection.json`, `comparison.md`, `comparison.csv`, the
        metric `runs` (how many training runs it compares), `tags`, and `table` (column name → values, the CSV's rows) as
        the MLflow table `comparison_table.json` (`mlflow.log_table`: the UI shows it as a table), and `description` (markdown:
    the side-by-side STS table) as the run's description, followed by `chart` (a PNG: every run × task), logged as
    `COMPARISON_CHART`. Returns its id."""
    exp_id = ensure_experiment("compare")
    with mlflow.start_run(
        experiment_id=exp_id,
        run_name=f"compare-{comparison_id[:6]}",
        tags={"cse.comparison_id": comparison_id, **(tags or {})},
    ) as run:
        mlflow.log_dict(dict(selection), "selection.json")
        mlflow.log_text(markdown, "comparison.md")
        mlflow.log_text(csv_text, "comparison.csv")
        if table:
            mlflow.log_table(data={k: list(v) for k, v in table.items()}, artifact_file=COMPARISON_TABLE)
        mlflow.log_metric("runs", runs)
        if chart is not None:
            mlflow.log_artifact(str(chart))
            image = artifact_image(run.info.run_id, Path(chart).name, "STS test of every compared run")
            description = f"{description}\n\n{image}" if description else image
        if description:
            mlflow.set_tag(NOTE_TAG, description)
    return run.info.run_id
