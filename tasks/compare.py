"""Compare stage: chosen training runs beside the papers' published numbers (config/published.py).

`select_runs` reads finished, test-evaluated training runs from MLflow (by method, tags, experiment, parent
group or run id); `build_comparison` turns them into long-form rows of five tables — STS (7 tasks + avg),
retrieval, alignment/uniformity, trainable parameters, and the SentEval transfer tasks (runs that were
test-evaluated on them: `transfer_evaluation`) — each run followed by the published row of the same
method, backbone and setting and by their difference (run − published). A run on a backbone no paper reports
(the packaged MiniLM of the smoke presets) is compared with the BERT-base row of its method and setting, and
the published row's `source` says so. `record_comparison` writes the Parquet dataset, the MLflow artifacts
(markdown, CSV and the same rows as an MLflow table) and the Prefect artifacts, and points the registry alias `best`
of each compared model at its version with the best STS-B dev.
"""

from __future__ import annotations

import json
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from cse.config import published
from cse.storage.comparisons import write_comparison
from cse.storage.hashing import stable_hash
from cse.storage.layout import DataRoot
from cse.storage.readers import SEVEN_TASKS, TASK_TITLES
from cse.storage.settings import get_settings
from cse.tracking.group_runs import COMPARISON_CHART, COMPARISON_TABLE, log_comparison
from cse.tracking.model_export import set_best_alias
from cse.tracking.reporting import compact_number, csv_table, markdown_table, publish_artifacts, two_decimals
from cse.tracking.run_pages import BACKBONE_LABEL, read_backbone_tag
from cse.tracking.store import experiment_ids, get_runs, search_runs

TABLES: dict[str, tuple[str, ...]] = {
    "sts": (*SEVEN_TASKS, "sts_avg"),
    "retrieval": ("retrieval_r1", "retrieval_r3", "retrieval_r5", "retrieval_r10"),
    "align_uniform": ("alignment", "uniformity", "sts_avg"),
    "parameters": ("trainable_parameters",),
    "transfer": (*published.TRANSFER_TASKS, "transfer_avg"),
}
_SOURCES = {
    "sts": published.STS,
    "retrieval": published.RETRIEVAL,
    "align_uniform": published.ALIGN_UNIFORM,
    "transfer": published.TRANSFER,
}


class RunRecord(BaseModel):
    """A training run selected for a comparison: ids, method, backbone, preset, setting and its metrics."""

    run_id: str
    label: str
    method: str
    backbone: str
    preset: str
    supervised: bool
    metrics: dict[str, float]
    backbone_metrics: dict[str, float] = {}  # the backbone's own scores before training (tag `cse.backbone`)
    backbone_pooler: str | None = None

    @property
    def setting(self) -> str:
        return published.setting_of(self.method, self.preset, self.supervised)


def select_runs(
    methods: list[str] | None = None,
    run_ids: list[str] | None = None,
    tags: dict[str, str] | None = None,
    experiments: list[str] | None = None,
    group: str | None = None,
    latest_per_label: bool = True,
) -> list[RunRecord]:
    """Finished training runs with test STS metrics, oldest first; parent runs (sweeps, seeds) are skipped."""
    from cse.config.methods import METHODS

    if run_ids:
        runs = get_runs(run_ids)
    else:
        exp_ids = experiment_ids(experiments or list(methods or METHODS))
        if not exp_ids:
            return []
        runs = search_runs(
            exp_ids, {**(tags or {}), **({"cse.group": group} if group else {})}, finished=True, newest_first=False
        )
    records = []
    for run in runs:
        t, p, m = run.data.tags, run.data.params, run.data.metrics
        if t.get("cse.parent") == "true" or "sts_avg" not in m or "method" not in t:
            continue
        if methods and t["method"] not in methods:
            continue
        label = t.get("cse.child") or run.info.run_name or run.info.run_id
        before = read_backbone_tag(t) or {}
        metrics = dict(m)
        if "trainable_parameters" in p:
            metrics["trainable_parameters"] = float(p["trainable_parameters"])
        records.append(
            RunRecord(
                run_id=run.info.run_id,
                label=label,
                method=t["method"],
                backbone=t.get("backbone", "?"),
                preset=t.get("preset", "?"),
                supervised=p.get("supervised", "False") == "True",
                metrics=metrics,
                backbone_metrics=before.get("metrics") or {},
                backbone_pooler=before.get("pooler"),
            )
        )
    if latest_per_label:  # (oldest first: the last record of a label is its newest)
        records = list({r.label: r for r in records}.values())
    return records


def _published_row(table: str, run: RunRecord) -> tuple[dict[str, Any] | None, str]:
    """The published numbers for this run's table row, and the backbone family they belong to (the BERT-base row
    for a backbone no paper reports: `cse.config.published.reference_row`)."""
    if table == "parameters":
        params = {(m, f, run.setting): row for (m, f), row in published.PARAMETERS.items()}
        ref = published.reference_row(params, run.method, run.backbone, run.setting)
    else:
        ref = published.reference_row(_SOURCES[table], run.method, run.backbone, run.setting)
    if ref is None:
        return None, published.reference_family(run.backbone)[0]
    row = ref.row
    if ref.stand_in:
        row = {**row, "source": f"{row['source']}; reference BERT-base (no published numbers for {run.backbone})"}
    return row, ref.family


def build_comparison(runs: list[RunRecord]) -> list[dict[str, Any]]:
    """Long-form rows (schema `cse.storage.schemas.COMPARISONS` minus id/created) for every table."""
    rows: list[dict[str, Any]] = []
    for table, metrics in TABLES.items():
        for run in runs:
            common = {
                "table": table,
                "label": run.label,
                "method": run.method,
                "backbone": run.backbone,
                "setting": run.setting,
                "mlflow_run_id": run.run_id,
            }
            ours = {k: run.metrics.get(k) for k in metrics}
            if all(v is None for v in ours.values()):
                continue
            rows += _metric_rows(common, "run", "this project", ours)
            if table == "sts" and run.backbone_metrics:  # the backbone before training, beside the run
                source = f"{BACKBONE_LABEL} ({run.backbone_pooler})" if run.backbone_pooler else BACKBONE_LABEL
                rows += _metric_rows(common, "backbone", source, {k: run.backbone_metrics.get(k) for k in metrics})
            pub, fam = _published_row(table, run)
            if pub is None:
                continue
            rows += _metric_rows(common, "published", pub["source"], {k: pub.get(k) for k in metrics})
            if table == "parameters" and published.backbone_family(run.backbone) is None:
                continue  # a parameter count of another backbone size: shown, but a difference would mean nothing
            diff = {
                k: None if (v := ours[k]) is None or pub.get(k) is None else round(v - float(pub[k]), 4)
                for k in metrics
            }
            rows += _metric_rows(common, "difference", f"run − published ({fam})", diff)
    return rows


def _metric_rows(common: dict[str, Any], kind: str, source: str, values: dict[str, Any]) -> list[dict[str, Any]]:
    """The long-form rows of one row of a table: `common` with the row's kind and source, one per metric → value."""
    return [{**common, "row_kind": kind, "source": source, "metric": k, "value": v} for k, v in values.items()]


def wide_tables(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per table, one dict per (label, row_kind) with a column per metric, in row order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for table, metrics in TABLES.items():
        seen: dict[tuple, dict[str, Any]] = {}
        for r in rows:
            if r["table"] != table:
                continue
            key = (r["mlflow_run_id"], r["row_kind"])
            row = seen.setdefault(
                key,
                {
                    "label": r["label"],
                    "row": r["row_kind"],
                    "method": r["method"],
                    "backbone": r["backbone"],
                    "setting": r["setting"],
                    "source": r["source"],
                    **{m: None for m in metrics},
                },
            )
            row[r["metric"]] = r["value"]
        if seen:
            out[table] = list(seen.values())
    return out


TITLES = {
    "sts": "STS (Spearman ×100, test)",
    "retrieval": "Retrieval (STS-B test)",
    "align_uniform": "Alignment / uniformity (STS-B test, lower is better)",
    "parameters": "Trainable parameters",
    "transfer": "SentEval transfer tasks (accuracy ×100, test; DiffCSE Table 2)",
}


def render_markdown(tables: dict[str, list[dict[str, Any]]]) -> str:
    """One titled markdown table per wide table (columns: label, row, its metrics, source), blank-line separated."""
    return "\n".join(
        markdown_table(rows, ["label", "row", *TABLES[table], "source"], title=TITLES[table], cell=compact_number)
        for table, rows in tables.items()
    )


def flat_rows(tables: dict[str, list[dict[str, Any]]]) -> tuple[list[str], list[dict[str, Any]]]:
    """Every wide table as one list of rows (a `table` column first; the metric columns of all tables) and its
    columns: the CSV's rows and the MLflow table's."""
    fields = [
        "table",
        "label",
        "row",
        "method",
        "backbone",
        "setting",
        "source",
        *dict.fromkeys(m for ms in TABLES.values() for m in ms),
    ]
    return fields, [{"table": table, **r} for table, table_rows in tables.items() for r in table_rows]


def render_csv(tables: dict[str, list[dict[str, Any]]]) -> str:
    """Every wide table in one CSV (`flat_rows`), RFC 4180 line ends."""
    fields, rows = flat_rows(tables)
    return csv_table(rows, fields, line_end="\r\n")


def table_columns(tables: dict[str, list[dict[str, Any]]]) -> dict[str, list[Any]]:
    """`flat_rows` as columns (name → values; a metric a table lacks is None): the MLflow table of the comparison."""
    fields, rows = flat_rows(tables)
    return {f: [r.get(f) for r in rows] for f in fields}


def comparison_description(tables: dict[str, list[dict[str, Any]]], comparison_id: str) -> str:
    """The comparison run's description (markdown): the runs side by side on STS (each run, its backbone before
    training, its published row and the difference; two decimals), then where the other tables are."""
    head = f"**Comparison {comparison_id}**: {len({r['label'] for r in tables.get('sts', [])})} runs side by side."
    sts = tables.get("sts")
    titles = {m: TASK_TITLES[m] for m in TABLES["sts"]}
    body = (
        markdown_table(
            [{k: r[k] for k in ("label", "row", "source")} | {titles[m]: r.get(m) for m in titles} for r in sts],
            ["label", "row", *titles.values(), "source"],
            title=TITLES["sts"],
            cell=two_decimals,
        )
        if sts
        else "No run has STS test scores."
    )
    others = [TITLES[t] for t in tables if t != "sts"]
    tail = f"Also in the artifact `comparison.md` (and the table `{COMPARISON_TABLE}`): " + "; ".join(others) + "."
    return "\n\n".join([head, body.rstrip("\n"), tail] if others else [head, body.rstrip("\n")])


class ComparisonSummary(BaseModel):
    """The outcome of a comparison: its id, run count, MLflow run, markdown table and updated `best` aliases."""

    comparison_id: str
    runs: int
    mlflow_run_id: str
    markdown: str
    best_versions: dict[str, str] = {}  # registered model → the version its alias `best` now names


def record_comparison(runs: list[RunRecord], selection: dict[str, Any]) -> ComparisonSummary:
    """Parquet dataset + MLflow run (experiment `compare`) with markdown, CSV and an MLflow table + Prefect table/markdown
    artifacts; the alias `best` of each compared registered model moves to its version with the best STS-B dev."""
    if not runs:
        raise ValueError(f"no finished, test-evaluated training runs match {json.dumps(selection)}")
    rows = build_comparison(runs)
    tables = wide_tables(rows)
    markdown = render_markdown(tables)
    comparison_id = stable_hash({"runs": [r.run_id for r in runs], "selection": selection})[:16]
    created = datetime.now(UTC).isoformat(timespec="seconds")
    root = DataRoot(get_settings().data_root)
    write_comparison(
        root, comparison_id, [{**r, "comparison_id": comparison_id, "created": created} for r in rows], params=selection
    )
    best_versions = set_best_alias([r.run_id for r in runs])
    from cse.evaluation.plots import sts_scores_plot  # lazy: matplotlib

    with tempfile.TemporaryDirectory(prefix="cse-compare-") as tmp:
        chart = sts_scores_plot(
            {r.label: r.metrics for r in runs if "sts_avg" in r.metrics},
            Path(tmp) / COMPARISON_CHART,
            title=f"comparison {comparison_id}: STS test (Spearman ×100)",
        )
        run_id = log_comparison(
            comparison_id,
            selection,
            markdown,
            render_csv(tables),
            len(runs),
            table=table_columns(tables),
            tags={f"cse.best.{name}": version for name, version in best_versions.items()},
            description=comparison_description(tables, comparison_id),
            chart=chart,
        )
    published_tables = {"sts": "STS vs published", "transfer": "transfer tasks vs published"}
    publish_artifacts(
        tables={
            f"comparison-{t}": (tables[t], f"comparison {comparison_id}: {what}")
            for t, what in published_tables.items()
            if t in tables
        },
        markdown={"comparison": (markdown, f"comparison {comparison_id}")},
    )
    return ComparisonSummary(
        comparison_id=comparison_id,
        runs=len(runs),
        mlflow_run_id=run_id,
        markdown=markdown,
        best_versions=best_versions,
    )
