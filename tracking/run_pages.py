"""What the MLflow pages show a researcher: experiments that open in the model-training view, run names that say
what differs from the preset, a run description with the STS table beside the paper's row, the headline metrics as
the runs table's columns, and the per-subset scores kept out of the way of the loss curves.

How MLflow 3 (3.17) decides what a page shows, and what this module does about it:

- **The view** (GenAI: Traces/Latency/Token usage, or Model training: runs and charts) is the sidebar switch, kept
  in the browser (local storage `mlflow.workflowType`, default GenAI); the URL parameter `workflowType` overrides it.
  Every link this project prints carries `workflowType=machine_learning` (`experiment_url`, `run_url`). Experiments
  are also tagged `mlflow.experimentKind = custom_model_development` (`MODEL_TRAINING`, set by
  `cse.tracking.store.ensure_experiment` on new experiments and on existing ones when next used), which MLflow 3
  versions that read the tag honour and which stops the "Choose experiment type" pop-up.
- **The runs table** shows no metric column until one is chosen (a per-browser choice), so each experiment holds
  the shared view `SCORES_VIEW` (experiment tag `mlflow.sharedViewState.<key>`): the seven STS tasks and `sts_avg`
  as columns, best `sts_avg` first. `experiment_url` opens it.
- **Model-metrics tab**: charts are grouped into sections by the metric name's prefix before the last "/", the
  sections in name order and the unprefixed metrics (the loss curves, `sts_avg`, ...) last. Per-subset scores
  (`sts12/MSRpar`, 48 one-bar charts with their Pearson twins) would come first and bury the loss curve, so a
  training run keeps them as the table `evaluation/sts_subsets.md` (and `.csv`) and the headline metrics only
  (`page_metrics`); a stand-alone evaluation run, which has no curves, keeps them as metrics (`sts12/MSRpar`).
- **The description** (tag `mlflow.note.content`, markdown, shown on the run's Overview) is the STS table of the run
  beside the published row of its method (`sts_description`); a comparison run's is its side-by-side table. A run of a
  method with a conditional discriminator (D2CSE, DiffCSE) adds the RTD mechanism probe of each evaluation
  (`with_rtd_probe`): does the discriminator use which sentence h describes?
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import mlflow

from cse.config import published
from cse.models.crtd import PROBE_METRICS
from cse.storage.readers import SEVEN_TASKS, TASK_TITLES
from cse.tracking.reporting import markdown_table

NOTE_TAG = "mlflow.note.content"  # the run description MLflow shows (markdown)
HEADLINE = (*SEVEN_TASKS, "sts_avg")  # the headline metrics: the runs table's columns, the description's table
SCORES_VIEW = "cse-scores"  # the shared runs-table view of every experiment (`scores_view_state`)
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # MLflow 3's experiment type
MODEL_TRAINING = "custom_model_development"  # ... "model training" (not GenAI)
SHARED_VIEW_PREFIX = "mlflow.sharedViewState."  # MLflow's experiment tag of a shared view
ML_VIEW = "workflowType=machine_learning"  # the URL parameter that opens MLflow's model-training view
RTD_GAP_READ = 0.01  # |rtd_h_gap| below this (nats per token) is read as no measurable use of h
RUN_NAME_MAX = 120  # characters of a run name's override part before "+N more"
_SHORT_NAMES = {"learning_rate": "lr"}  # an override's name in a run name (else the last part of its dotted name)


# ------------------------------------------------------------------------------------------------ links and views
def experiment_url(base: str, experiment_id: str, scores_view: bool = True) -> str:
    """The experiment's runs page on the MLflow UI at `base`, in the model-training view (and its `SCORES_VIEW`:
    the STS columns, best first)."""
    query = ML_VIEW + (f"&viewStateShareKey={SCORES_VIEW}" if scores_view else "")
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"


def run_url(base: str, experiment_id: str, run_id: str) -> str:
    """The run's page (its Overview: description, metrics) on the MLflow UI at `base`, in the model-training view."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{ML_VIEW}"


def scores_view_state() -> dict[str, Any]:
    """The runs-table state of `SCORES_VIEW` as MLflow's shared views hold it: the headline metrics as columns,
    sorted by `sts_avg` (best first), all runs."""
    return {
        "searchFilter": "",
        "orderByKey": "metrics.`sts_avg`",
        "orderByAsc": False,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "datasetsFilter": [],
        "modelVersionFilter": "All Runs",
        "selectedColumns": [f"metrics.`{m}`" for m in HEADLINE],
        "runsExpanded": {},
        "runsPinned": [],
        "runsHidden": [],
        "viewMaximized": False,
        "runListHidden": False,
        "isAccordionReordered": False,
        "groupBy": "",
        "groupsExpanded": {},
        "useGroupedValuesInCharts": True,
        "hideEmptyCharts": True,
    }


def experiment_page_tags() -> dict[str, str]:
    """The experiment tags that make its pages open as a model-training experiment with the scores view."""
    return {
        EXPERIMENT_KIND_TAG: MODEL_TRAINING,
        SHARED_VIEW_PREFIX + SCORES_VIEW: json.dumps(scores_view_state(), separators=(",", ":")),
    }


# ------------------------------------------------------------------------------------------------ run names
def _value_text(value: Any) -> str:
    """An override's value in a run name: floats short (`0.03`, `5e-05`), lists comma-joined, a local path by its
    last part (the full value is the run's parameter)."""
    if isinstance(value, str) and value.startswith("/"):
        return value.rstrip("/").rsplit("/", 1)[-1]
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(_value_text(v) for v in value)
    return str(value)


def preset_differences(cfg) -> dict[str, Any]:
    """The fields of the training config `cfg` whose values differ from its preset's (its `method`/`preset` resolved
    without overrides), by dotted name in name order (none when the preset cannot be resolved)."""
    from cse.config.training import resolve_train_config

    try:
        base = resolve_train_config(cfg.preset, method=cfg.method)
    except (KeyError, ValueError):
        return {}
    ours, theirs = _flat(cfg.model_dump()), _flat(base.model_dump())
    return {k: ours.get(k) for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)}


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_name(cfg) -> str:
    """A training run's name: `<method>-<preset>` and what differs from the preset, e.g.
    `d2cse-smoke lr=0.03 prefix_len=12` (short names: the last part of the dotted name, `lr` for the learning rate;
    the full dotted name where two would read the same). Deterministic; past `RUN_NAME_MAX` characters the rest is
    counted (`+2 more`). The run key and the job folder do not depend on it."""
    diffs = preset_differences(cfg)
    leaves = [k.rsplit(".", 1)[-1] for k in diffs]
    parts = []
    for key, leaf in zip(diffs, leaves):
        name = _SHORT_NAMES.get(leaf, leaf) if leaves.count(leaf) == 1 else key
        parts.append(f"{name}={_value_text(diffs[key])}")
    head, shown = f"{cfg.method}-{cfg.preset}", []
    for i, part in enumerate(parts):
        if len(" ".join([*shown, part])) > RUN_NAME_MAX:
            shown.append(f"+{len(parts) - i} more")
            break
        shown.append(part)
    return " ".join([head, *shown])


# ------------------------------------------------------------------------------------------------ metrics
def page_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The evaluation metrics a training run logs: all but the per-subset scores (`sts12/MSRpar` and their Pearson
    twins), which would come before the loss curves on the Model-metrics tab; they stay in the run's
    `evaluation/sts_subsets.md` table. The headline names (`sts12` … `sickr`, `sts_avg`) are unchanged."""
    return {k: v for k, v in metrics.items() if "/" not in k}


# ------------------------------------------------------------------------------------------------ descriptions
def _score(value: Any) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "–"
    return "–" if math.isnan(v) else f"{v:.2f}"


def _signed(value: float | None) -> str:
    return "–" if value is None else f"{value:+.2f}"


def sts_table(
    rows: list[tuple[str, Mapping[str, Any]]], reference: published.Reference | None = None, ours: int = 0
) -> str:
    """A markdown table of STS rows (label, scores by metric name: `sts12` … `sickr`, `sts_avg`): one row each, then
    `reference`'s published row and the difference of row `ours` from it."""
    columns = ["", *(TASK_TITLES[t] for t in HEADLINE)]
    table = [{"": label, **{TASK_TITLES[t]: _score(scores.get(t)) for t in HEADLINE}} for label, scores in rows]
    if reference is not None:
        table.append({"": reference.label, **{TASK_TITLES[t]: _score(reference.row.get(t)) for t in HEADLINE}})
        run = rows[ours][1]

        def diff(t: str) -> float | None:
            try:
                return float(run[t]) - float(reference.row[t])
            except (KeyError, TypeError, ValueError):
                return None

        table.append({"": "difference (run − published)", **{TASK_TITLES[t]: _signed(diff(t)) for t in HEADLINE}})
    return markdown_table(table, columns).rstrip("\n")


def sts_description(
    metrics: Mapping[str, float],
    *,
    method: str,
    preset: str,
    backbone: str,
    setting: str,
    differences: Mapping[str, Any] | None = None,
) -> str:
    """The description of a test-evaluated training run: its STS table (Spearman ×100) beside the published row of
    its method and setting (the BERT-base row, labelled so, when no paper reports its backbone) and the difference.

    Args:
        metrics: the run's test metrics (`sts12` … `sickr`, `sts_avg`).
        method: the method.
        preset: the preset.
        backbone: the backbone.
        setting: the published setting (`cse.config.published.setting_of`).
        differences: what differs from the preset (`preset_differences`).
    """
    ref = published.reference_row(published.STS, method, backbone, setting)
    lines = [
        f"**{method} / {preset}** on `{backbone}`" + _differences_text(differences),
        "",
        'STS test, Spearman ×100 (STS12–16 "all", STS-B and SICK-R test; Avg. over the seven):',
        "",
        sts_table([("this run", metrics)], ref),
        "",
    ]
    if ref is None:
        lines.append(f"No paper reports {method} at setting {setting}: no published row to compare with.")
    else:
        lines.append(
            f"Published: {ref.row.get('source', '?')}, {method} / {ref.family} / {setting} (config/published.py)."
            + (
                f" No paper reports `{backbone}`: the {published.FAMILY_TITLES[ref.family]} row is the reference."
                if ref.stand_in
                else ""
            )
        )
    lines += ["", "Per-subset scores: artifact `evaluation/sts_subsets.md`; every metric: the Model metrics tab."]
    return "\n".join(lines)


def start_description(method: str, preset: str, backbone: str, differences: Mapping[str, Any] | None = None) -> str:
    """The description of a training run while it trains (replaced by `sts_description` after its test evaluation)."""
    return (
        f"**{method} / {preset}** on `{backbone}`{_differences_text(differences)}\n\n"
        "Training: the loss and STS-B dev curves are on the Model metrics tab. The STS test table, beside the "
        "published row, appears here when the test evaluation finishes."
    )


def _differences_text(differences: Mapping[str, Any] | None) -> str:
    if not differences:
        return " (the preset as defined in config/presets.py)"
    return "; differs from the preset: " + ", ".join(f"`{k}={_value_text(v)}`" for k, v in differences.items())


def set_description(run_id: str, markdown: str) -> None:
    """Set run `run_id`'s description (tag `mlflow.note.content`) to `markdown` (MLflow pointed at the store)."""
    mlflow.MlflowClient().set_tag(run_id, NOTE_TAG, markdown)


# ------------------------------------------------------------------------------------------------ the RTD probe
def rtd_probe_history(run_id: str) -> list[tuple[int, dict[str, float]]]:
    """The RTD mechanism probe's figures of run `run_id` at each evaluation step (`cse.models.crtd.PROBE_METRICS`,
    read back from the run's metric history), in step order; empty when the run logged none."""
    client = mlflow.MlflowClient()
    by_step: dict[int, dict[str, float]] = {}
    for key, name in PROBE_METRICS.items():
        for m in client.get_metric_history(run_id, name):
            by_step.setdefault(m.step, {})[key] = m.value
    return sorted(by_step.items())


def rtd_probe_section(history: list[tuple[int, Mapping[str, float]]]) -> str:
    """The description's section on the RTD mechanism probe: a table of each evaluation's held-out RTD loss with the
    true, the rolled and no h, the gap rolled − true, and what the last gap says."""
    if not history:
        return ""
    rows = [
        {
            "step": str(step),
            "loss, true h": f"{v.get('true_h', math.nan):.4f}",
            "loss, rolled h": f"{v.get('rolled_h', math.nan):.4f}",
            "loss, no h": f"{v.get('no_h', math.nan):.4f}",
            "rtd_h_gap (rolled − true)": f"{v.get('gap', math.nan):+.4f}",
        }
        for step, v in history
    ]
    step, gap = history[-1][0], history[-1][1].get("gap", math.nan)
    if gap >= RTD_GAP_READ:
        reading = (
            f"At step {step} the discriminator's loss is {gap:.4f} lower with its own sentence's h than with another "
            "sentence's: it reads the sentence in h."
        )
    elif gap > -RTD_GAP_READ:
        reading = (
            f"At step {step} the gap is {gap:+.4f}, below {RTD_GAP_READ}: the discriminator does not measurably use "
            "which sentence h describes, so the CRTD term sends little or no sentence-specific signal into h."
        )
    else:
        reading = (
            f"At step {step} the loss is {-gap:.4f} higher with its own sentence's h than with another sentence's: "
            "the conditioning looks misaligned with the rows."
        )
    return "\n".join(
        [
            "**RTD mechanism probe** (the discriminator on a fixed batch of 64 sentences, eval mode; parameter "
            "`rtd_probe_rows` says which): RTD loss with the true h, with h rolled by one row (another sentence's) and "
            "with no h.",
            "",
            markdown_table(rows, list(rows[0])).rstrip("\n"),
            "",
            reading,
        ]
    )


def with_rtd_probe(markdown: str, run_id: str) -> str:
    """`markdown` followed by run `run_id`'s RTD probe section (`rtd_probe_section`), if the run logged the probe."""
    section = rtd_probe_section(rtd_probe_history(run_id))
    return f"{markdown}\n\n{section}" if section else markdown
