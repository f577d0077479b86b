"""Flow `compare`: a table of chosen runs beside the papers' published numbers, with the difference per task.

    prefect deployment run compare/default                                   # every finished run
    prefect deployment run compare/default -p 'methods=["d2cse","dcpcse"]'   # by method
    prefect deployment run compare/default -p 'tags={"preset": "smoke"}'     # by MLflow tag
    prefect deployment run compare/default -p group=<cse.group of a sweep/seeds/ablation>

Outputs: a Prefect table + markdown artifact, an MLflow run in experiment `compare` (comparison.md / .csv and the
MLflow table `comparison_table.json`), the Parquet dataset `comparisons/<id>` (DuckDB view `comparisons`), and the
registry alias `best` on each compared model's version with the best STS-B dev. Tables: STS, retrieval,
alignment/uniformity and trainable parameters (the papers' tables).
"""

from __future__ import annotations

from prefect import flow, task

from cse.flows.deployment_params import deployment_merged
from cse.tasks.compare import ComparisonSummary, record_comparison, select_runs


@task(name="compare-runs")
def compare_task(selection: dict) -> ComparisonSummary:
    """Select runs and record their comparison.

    Args:
        selection: keyword arguments of the run selection.

    Returns:
        The comparison summary.
    """
    runs = select_runs(**selection)
    return record_comparison(runs, selection)


@flow(name="compare", log_prints=True)
def compare(
    methods: list[str] | None = None,
    run_ids: list[str] | None = None,
    tags: dict[str, str] | None = None,
    experiments: list[str] | None = None,
    group: str | None = None,
    latest_per_label: bool = True,
) -> ComparisonSummary:
    """Compare selected training runs and print the comparison table.

    Args:
        methods: methods to select.
        run_ids: MLflow run ids to select.
        tags: MLflow tags the runs must have.
        experiments: MLflow experiments to search.
        group: the flow group the runs belong to.
        latest_per_label: keep only the latest run of each label.

    Returns:
        The comparison summary.
    """
    (tags,) = deployment_merged(tags=tags)  # in a deployment run, merged into the deployment's
    selection = {
        "methods": methods,
        "run_ids": run_ids,
        "tags": tags,
        "experiments": experiments,
        "group": group,
        "latest_per_label": latest_per_label,
    }
    summary = compare_task({k: v for k, v in selection.items() if v is not None})
    print(
        f"comparison {summary.comparison_id}: {summary.runs} runs (MLflow run {summary.mlflow_run_id})\n\n{summary.markdown}"
    )
    for name, version in summary.best_versions.items():
        print(f"models:/{name}@best = version {version}")
    return summary
