"""What `cse run` reads back from MLflow while a flow run goes on and after it ended (cse.ops.follow): the MLflow runs
the flow run made (the tag `prefect_flow_run_id` every stage run and training run carries), a training run's progress
(its step of `total_steps`, its latest loss and dev score, the pace from the metrics' own timestamps), and the summary
of each run (its STS table beside the backbone before training and the paper's row, its id and its page).

Read-only: nothing here writes to the store. Training progress is read from the metrics the loop logs every
`log_steps` (cse.tracking.run_pages.curve_name: `loss/loss`, `dev/stsb_dev`), never from the training process.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException

from cse.config import published
from cse.storage.settings import get_settings
from cse.tracking.data_warnings import DATA_WARNING_TAG
from cse.tracking.run_pages import (
    HEADLINE,
    NOTE_TAG,
    curve_name,
    experiment_url,
    read_backbone_tag,
    run_url,
    sts_table,
)
from cse.tracking.store import configure_mlflow
from cse.tracking.training_runs import EVALUATES_RUN_TAG

FLOW_RUN_TAG = "prefect_flow_run_id"  # set on every run a flow run makes (cse.tracking.provenance)
LOSS, DEV = curve_name("loss"), curve_name("stsb_dev")


@dataclass(frozen=True)
class RunView:
    """One MLflow run as `cse run` shows it: what kind of run it is (`training`, `evaluation`, `comparison` or
    `stage`), its experiment, name, status, tags, params and latest metrics."""

    run_id: str
    experiment_id: str
    name: str
    status: str
    kind: str
    start_ms: int
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, run: mlflow.entities.Run) -> RunView:
        tags = dict(run.data.tags)
        if "method" in tags and "run_dir" in tags:
            kind = "training"
        elif "cse.comparison_id" in tags:
            kind = "comparison"
        elif tags.get("stage") == "evaluate":
            kind = "evaluation"
        else:
            kind = "stage"
        return cls(
            run_id=run.info.run_id,
            experiment_id=run.info.experiment_id,
            name=run.info.run_name or run.info.run_id,
            status=run.info.status,
            kind=kind,
            start_ms=int(run.info.start_time or 0),
            tags=tags,
            params=dict(run.data.params),
            metrics=dict(run.data.metrics),
        )

    def url(self, base: str | None = None) -> str:
        """The run's page in the MLflow UI (model-training view)."""
        return run_url(base or get_settings().mlflow_ui_url, self.experiment_id, self.run_id)

    def experiment_url(self, base: str | None = None) -> str:
        """Its experiment's runs table (the scores view)."""
        return experiment_url(base or get_settings().mlflow_ui_url, self.experiment_id)


def runs_of_flow_runs(flow_run_ids: Sequence[str]) -> list[RunView]:
    """The MLflow runs that the flow runs `flow_run_ids` made (every experiment), oldest first; none when the store
    cannot be read."""
    configure_mlflow()
    found: dict[str, RunView] = {}
    for flow_run_id in flow_run_ids:
        try:
            runs = mlflow.search_runs(
                search_all_experiments=True,
                filter_string=f"tags.`{FLOW_RUN_TAG}` = '{flow_run_id}'",
                output_format="list",
            )
        except MlflowException:
            continue
        found.update({r.info.run_id: RunView.of(r) for r in runs})
    return sorted(found.values(), key=lambda r: r.start_ms)


def runs_by_id(run_ids: Sequence[str]) -> list[RunView]:
    """The MLflow runs `run_ids` (a cache-hit rerun names the finished job's run in its log: it makes none of its
    own), in the order given; a run the store does not hold is left out."""
    configure_mlflow()
    client = mlflow.MlflowClient()
    found = []
    for run_id in dict.fromkeys(run_ids):
        try:
            found.append(RunView.of(client.get_run(run_id)))
        except MlflowException:
            continue
    return found


@dataclass(frozen=True)
class Progress:
    """A training run's progress as its logged metrics tell it: the last logged `step` of `total` (None when the run
    records no `total_steps`), the latest loss and STS-B dev score (None before the first), the seconds per step
    measured between the loss points' timestamps (None before two points), and the seconds since the run started."""

    step: int
    total: int | None
    loss: float | None
    dev: float | None
    seconds_per_step: float | None
    elapsed_s: float

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the measured pace (None while unknown)."""
        if self.total is None or self.seconds_per_step is None:
            return None
        return max(self.total - self.step, 0) * self.seconds_per_step


def training_progress(run_id: str, now_s: float | None = None) -> Progress | None:
    """The progress of training run `run_id` (`Progress`), None before its first logged loss."""
    configure_mlflow()
    client = mlflow.MlflowClient()
    try:
        run = client.get_run(run_id)
        loss = sorted(client.get_metric_history(run_id, LOSS), key=lambda m: (m.step, m.timestamp))
        dev = sorted(client.get_metric_history(run_id, DEV), key=lambda m: (m.step, m.timestamp))
    except MlflowException:
        return None
    if not loss:
        return None
    last = loss[-1]
    pace = None
    if len(loss) >= 2 and loss[-1].step > loss[0].step:
        pace = (loss[-1].timestamp - loss[0].timestamp) / 1000 / (loss[-1].step - loss[0].step)
    elif last.step > 0:
        pace = max(last.timestamp - run.info.start_time, 0) / 1000 / last.step
    total = run.data.params.get("total_steps")
    now = time.time() if now_s is None else now_s
    return Progress(
        step=max(last.step, dev[-1].step if dev else 0),
        total=int(total) if total and total.isdigit() else None,
        loss=last.value,
        dev=dev[-1].value if dev else None,
        seconds_per_step=pace,
        elapsed_s=max(now - run.info.start_time / 1000, 0.0),
    )


def _reference(view: RunView) -> published.Reference | None:
    method, backbone = view.tags.get("method"), view.tags.get("backbone")
    if not method or not backbone:
        return None
    preset = view.tags.get("preset", "default")
    setting = published.setting_of(method, preset, view.params.get("supervised") == "True")
    return published.reference_row(published.STS, method, backbone, setting)


def _parent(view: RunView) -> RunView | None:
    """The training run an evaluation re-evaluates (tag `cse.evaluates_run`), None for another evaluation."""
    run_id = view.tags.get(EVALUATES_RUN_TAG)
    if not run_id:
        return None
    try:
        return RunView.of(mlflow.MlflowClient().get_run(run_id))
    except MlflowException:
        return None


JOB_OUTPUTS = ("export", "peft-adapter", "best")  # the folders a finished job may hold, in the order listed


def job_folder_line(run_dir: str) -> str:
    """`job folder: <run_dir> (export/, best/)`: the job's output folders that exist on this machine (a job that
    exports no PEFT adapter, or whose export never ran, lists none it has not); a folder not here (another
    machine's) is said so."""
    folder = Path(run_dir)
    if not folder.is_dir():
        return f"job folder: {run_dir} (not on this machine)"
    held = [f"{name}/" for name in JOB_OUTPUTS if (folder / name).is_dir()]
    return f"job folder: {run_dir}" + (f" ({', '.join(held)})" if held else " (no export, adapter or checkpoint yet)")


def data_warnings(view: RunView) -> list[str]:
    """The data warnings the run carries (tag `cse.data_warning`: e.g. Wiki1M read from the local sample), one a
    line."""
    return [line for line in view.tags.get(DATA_WARNING_TAG, "").splitlines() if line.strip()]


def summary_lines(view: RunView, base: str | None = None, table: bool = True) -> list[str]:
    """What `cse run` prints for an MLflow run its flow run made, once it ended: a training run's STS table (the run,
    the backbone before training, the paper's row, the differences), an evaluation's scores, a comparison's
    side-by-side table (its description without the chart); then the run's id and its page, its job folder and its
    data warnings. `table=False` (`cse run --quiet`): the lines from the id on."""
    lines: list[str] = []
    if table and view.kind in ("training", "evaluation") and any(t in view.metrics for t in HEADLINE):
        scored = view
        if view.kind == "evaluation" and (parent := _parent(view)) is not None:  # a re-evaluation: its job's rows
            scored = parent
            lines.append(f"re-evaluation of {parent.name} (MLflow run {parent.run_id}):")
        before = read_backbone_tag(scored.tags) if scored.kind == "training" else None
        lines += ["STS test, Spearman x100:", sts_table(view.metrics, before, _reference(scored))]
    elif table and view.kind == "comparison":
        note = view.tags.get(NOTE_TAG, "")
        lines.append("\n".join(line for line in note.splitlines() if not line.startswith("![")).strip())
    lines.append(f"MLflow run {view.run_id} ({view.name}): {view.url(base)}")
    if view.kind == "training" and view.tags.get("run_dir"):
        lines.append(job_folder_line(view.tags["run_dir"]))
    lines += [f"warning: {w}" for w in data_warnings(view)]
    return lines


def summary_record(view: RunView, base: str | None = None) -> dict[str, object]:
    """What `cse run --json` gives of one run: its id, name, kind, page, job folder (training runs), headline STS test
    scores (Spearman x100) and data warnings."""
    return {
        "mlflow_run_id": view.run_id,
        "name": view.name,
        "kind": view.kind,
        "url": view.url(base),
        "run_dir": view.tags.get("run_dir"),
        "sts": {t: view.metrics[t] for t in HEADLINE if t in view.metrics},
        "warnings": data_warnings(view),
    }


def summary_runs(views: Sequence[RunView]) -> list[RunView]:
    """The runs worth a summary (training runs, evaluations, comparisons), oldest first."""
    return [v for v in views if v.kind in ("training", "evaluation", "comparison")]
