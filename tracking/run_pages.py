"""What the MLflow pages show a researcher: experiments that open in the model-training view, run names that say
what differs from the preset, a run description with the STS table (this run, the backbone before training, the
paper's row) and its chart, score columns in the paper's order with two decimals, and a Model metrics tab that
starts with the loss and dev curves.

How MLflow 3 (3.17) decides what a page shows, and what this module does about it:

- **The view** (GenAI: Traces/Latency/Token usage, or Model training: runs and charts) is the sidebar switch, kept
  in the browser (local storage `mlflow.workflowType`, default GenAI); the URL parameter `workflowType` overrides it.
  Every link this project prints carries `workflowType=machine_learning` (`experiment_url`, `run_url`). Experiments
  are also tagged `mlflow.experimentKind = custom_model_development` (`MODEL_TRAINING`, set by
  `cse.tracking.store.ensure_experiment` on new experiments and on existing ones when next used), which MLflow 3
  versions that read the tag honour and which stops the "Choose experiment type" pop-up.
- **The runs table** shows no metric, param or tag column until one is chosen (a per-browser choice), so each
  experiment holds the shared view `SCORES_VIEW` (experiment tag `mlflow.sharedViewState.<key>`; `experiment_url`
  opens it). Its metric columns would come in name order (`sickr, sts12, …, sts_avg, stsb`) with every digit of the
  float, and MLflow offers no column format: the view shows instead the run's score tags (`score_tags`: `1 STS12`
  … `8 Avg.`, `9 backbone Avg.`; the leading digit keeps the paper's order, the value is text with two decimals)
  and the param `overrides` (what differs from the preset). The metrics stay as they are, for search and the API.
  The view sorts by the metric `sts_avg`, best first (runs without a test score last). Under any order but date
  MLflow draws child runs as rows of their own, so a re-evaluation stands in the table beside its training run
  (`evaluate-test-<run name>`) instead of under it.
- **Model-metrics tab**: one chart per metric, grouped into sections by the name's prefix before the last "/";
  the prefixed sections come first, in name order (JavaScript's: capitals before lower case), and the unprefixed
  metrics last, each section in name order; a metric whose latest step is 0 is drawn as a single bar, any other as
  a line. So the test evaluation's headline scores are logged twice: under their own names (`sts_avg`, for search,
  the API and the runs table's order; unprefixed, so at the end of the tab) and in the section `STS test/`, named
  as the score tags (`STS test/1 STS12` … `STS test/8 Avg.`, `score_charts`), which sorts before every other
  section: the tab opens on the test scores in the paper's order. Both at the job's last step, beside the
  backbone's at step 0 (`page_metrics`): a line from before to after training instead of a bar. The training
  loop's curves follow in the sections `dev/` (STS-B dev), `loss/` (the loss and the method's terms),
  `optimizer/`, `progress/` and `throughput/` (`curve_metrics`). Per-subset scores (`sts12/MSRpar`, 48 charts
  with their Pearson twins) and the evaluator's other single values stay in the run's `evaluation/` files; a
  stand-alone evaluation run, which has no curves, keeps them as metrics.
- **The description** (tag `mlflow.note.content`, markdown, shown on the run's Overview) is the STS table of the run
  beside the backbone before training and the published row of its method (`sts_description`), and the chart
  `evaluation/sts_chart.png` as an image served by the tracking server (`artifact_image`); a comparison run's is its
  side-by-side table and the chart of all its runs.
  A run of a method with a conditional discriminator (D2CSE, DiffCSE) adds the RTD mechanism probe of each
  evaluation (`with_rtd_probe`; its curves in the section `rtd_probe/`): does the discriminator use which sentence
  h describes?
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import mlflow

from cse.config import published
from cse.models.methods.crtd import GRAD_GROUPS, PROBE_METRICS
from cse.storage.readers import SEVEN_TASKS, TASK_TITLES
from cse.tracking.reporting import markdown_table

NOTE_TAG = "mlflow.note.content"  # the run description MLflow shows (markdown)
HEADLINE = (*SEVEN_TASKS, "sts_avg")  # the headline metrics: the runs table's columns, the description's table
# the test metrics a training run logs (at its last step, the backbone's at step 0; `*_dev`: a re-evaluation in dev
# mode); the rest stays in its files
PAGE_METRICS = (
    *HEADLINE,
    *(f"retrieval_r{k}" for k in (1, 3, 5, 10)),
    "alignment",
    "uniformity",
    "stsb_dev",
    "sickr_dev",
)
BACKBONE_AVG_TAG = "9 backbone Avg."  # the score tag of the backbone's Avg. before training (`score_tags`)
OVERRIDES_PARAM = "overrides"  # the training run's param: what differs from the preset (`overrides_text`)
BACKBONE_TAG = "cse.backbone"  # a training run's backbone before training, JSON (`backbone_tag`)
# the training loop's metrics by section of the Model metrics tab (`curve_metrics`); the rest is the method's loss
CURVE_SECTIONS = {
    **dict.fromkeys(("learning_rate", "grad_norm"), "optimizer"),
    **dict.fromkeys(("epoch", "phase"), "progress"),
    **dict.fromkeys(("sentences_per_s", "tokens_per_s", "host_wait_share", "peak_memory_gb"), "throughput"),
}
SCORES_VIEW = "cse-scores"  # the shared runs-table view of every experiment (`scores_view_state`)
SCORES_ORDER = "metrics.`sts_avg`"  # ... sorted by the STS Avg. (descending), as the UI writes a metric's sort key
SCORE_CHARTS = "STS test"  # the Model-metrics section of the headline test scores (`score_charts`): sorts first
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # MLflow 3's experiment type
MODEL_TRAINING = "custom_model_development"  # ... "model training" (not GenAI)
SHARED_VIEW_PREFIX = "mlflow.sharedViewState."  # MLflow's experiment tag of a shared view
ML_VIEW = "workflowType=machine_learning"  # the URL parameter that opens MLflow's model-training view
RTD_GAP_READ = 0.01  # |rtd_h_gap| below this (nats per token) is read as no measurable use of h
GRAD_METRIC = "rtd_grad_"  # the RTD term's gradient share (`rtd_grad_share_<group>`, `rtd_grad_norm_<group>`)
GRAD_CURVES = f"rtd_probe/{GRAD_METRIC}"
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


def score_tag(metric: str) -> str:
    """The run tag holding `metric`'s score as text (`sts12` → `1 STS12`, `sts_avg` → `8 Avg.`): the leading digit is
    the paper's column order, which the runs table keeps because it orders tag columns by name."""
    return f"{HEADLINE.index(metric) + 1} {TASK_TITLES[metric]}"


def score_tags(metrics: Mapping[str, Any], backbone: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The score tags of a run with STS test scores: `score_tag(t)` → the score with two decimals for every headline
    metric present, and `BACKBONE_AVG_TAG` → the backbone's Avg. before training when `backbone` (its metrics) gives
    one."""
    tags = {score_tag(t): _score(metrics[t]) for t in HEADLINE if t in metrics}
    if backbone and "sts_avg" in backbone:
        tags[BACKBONE_AVG_TAG] = _score(backbone["sts_avg"])
    return tags


def scores_view_state() -> dict[str, Any]:
    """The runs-table state of `SCORES_VIEW` as MLflow's shared views hold it: the param `overrides`, the score tags in
    the paper's order and the backbone's Avg. as columns, the best STS Avg. first (`SCORES_ORDER`), all runs."""
    columns = [
        f"params.`{OVERRIDES_PARAM}`",
        *(f"tags.`{score_tag(m)}`" for m in HEADLINE),
        f"tags.`{BACKBONE_AVG_TAG}`",
    ]
    return {
        "searchFilter": "",
        "orderByKey": SCORES_ORDER,
        "orderByAsc": False,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "datasetsFilter": [],
        "modelVersionFilter": "All Runs",
        "selectedColumns": columns,
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
    diffs = {k: ours.get(k) for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)}

    def leaf(key: str) -> str:  # a mapping of the preset replaced by a value (`expected_rows: null`): that one key
        parts = key.split(".")
        return next((".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in ours), key)

    return {leaf(k): ours.get(leaf(k)) for k in diffs}


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
    head = f"{cfg.method}-{cfg.preset}"
    shown: list[str] = []
    for i, part in enumerate(parts):
        if len(" ".join([*shown, part])) > RUN_NAME_MAX:
            shown.append(f"+{len(parts) - i} more")
            break
        shown.append(part)
    return " ".join([head, *shown])


# ------------------------------------------------------------------------------------------------ metrics
def curve_name(name: str) -> str:
    """The MLflow name of a metric the training loop logs: in its Model-metrics section (`CURVE_SECTIONS`; dev scores
    in `dev/`, the method's loss and terms in `loss/`); the selection's best (`best_stsb_dev`), which the registry's
    alias and the experiments read, keeps its name."""
    if name.startswith("best_"):
        return name
    if "_dev" in name:
        return f"dev/{name}"
    if name in (*PROBE_METRICS.values(), "rtd_probe_seconds") or name.startswith(GRAD_METRIC):  # the RTD probe
        # (cse.training.job: the h probe and the RTD term's gradient share)
        return f"rtd_probe/{name}"
    section = CURVE_SECTIONS.get(name) or ("optimizer" if name.startswith("learning_rate_") else "loss")
    return f"{section}/{name}"


def curve_metrics(metrics: Mapping[str, float], phases: int = 1) -> dict[str, float]:
    """The training loop's metrics under their MLflow names (`curve_name`); `phase` only for a job of more than one
    phase (a flat zero line otherwise)."""
    return {curve_name(k): v for k, v in metrics.items() if not (k == "phase" and phases < 2)}


def score_chart(metric: str) -> str:
    """The Model-metrics chart of a headline test score: `sts12` → `STS test/1 STS12`, `sts_avg` → `STS test/8 Avg.`
    (the section `SCORE_CHARTS`, the chart named as the run's score tag, `score_tag`)."""
    return f"{SCORE_CHARTS}/{score_tag(metric)}"


def score_charts(metrics: Mapping[str, float]) -> dict[str, float]:
    """The headline test scores of `metrics` (`HEADLINE`: the seven tasks and Avg.) under their chart names
    (`score_chart`), the section the Model metrics tab shows first."""
    return {score_chart(k): v for k, v in metrics.items() if k in HEADLINE}


def page_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The test metrics a training run logs: `PAGE_METRICS` (the seven tasks, Avg., recall@k, alignment and
    uniformity, unchanged names) and the headline scores again as the first charts of the Model metrics tab
    (`score_charts`). The per-subset scores (`sts12/MSRpar`), the Pearson and mean variants and the timings stay in
    the run's `evaluation/` files (`sts_subsets.md`, `result.json`)."""
    return {k: v for k, v in metrics.items() if k in PAGE_METRICS} | score_charts(metrics)


def backbone_tag(backbone: Mapping[str, Any]) -> str:
    """The `BACKBONE_TAG` value: the backbone's evaluation before training (its evaluation id, pooler and headline
    scores, two decimals) as JSON, read back by `compare` and `cse run`."""
    keep = {k: backbone[k] for k in ("evaluation_id", "pooler", "template", "label") if backbone.get(k) is not None}
    keep["metrics"] = {k: round(float(v), 4) for k, v in (backbone.get("metrics") or {}).items() if k in PAGE_METRICS}
    return json.dumps(keep, separators=(",", ":"))


def read_backbone_tag(tags: Mapping[str, str]) -> dict[str, Any] | None:
    """The backbone's evaluation recorded on a training run (`backbone_tag`), or None."""
    text = tags.get(BACKBONE_TAG)
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# ------------------------------------------------------------------------------------------------ descriptions
def _score(value: Any) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return "–"
    return "–" if math.isnan(v) else f"{v:.2f}"


BACKBONE_LABEL = "backbone before training"  # the row of the backbone's own score in every STS table


def backbone_row_label(pooler: str | None) -> str:
    """The label of the backbone's row: `backbone before training (cls_before_pooler)`."""
    return f"{BACKBONE_LABEL} ({pooler})" if pooler else BACKBONE_LABEL


def _difference(a: Mapping[str, Any], b: Mapping[str, Any], t: str) -> str:
    try:
        return f"{float(a[t]) - float(b[t]):+.2f}"
    except (KeyError, TypeError, ValueError):
        return "–"


def sts_table(
    metrics: Mapping[str, Any],
    backbone: Mapping[str, Any] | None = None,
    reference: published.Reference | None = None,
) -> str:
    """The STS table of one run in markdown (no final newline): this run, the backbone before training (`backbone`:
    its `metrics` and `pooler`), the paper's row (`reference`), and the differences of the run from the paper and from
    the backbone; two decimals, `–` where a value is missing."""

    def row(label: str, values: Mapping[str, Any], difference: bool = False) -> dict[str, str]:
        cell = (lambda t: _difference(metrics, values, t)) if difference else (lambda t: _score(values.get(t)))
        return {"": label, **{TASK_TITLES[t]: cell(t) for t in HEADLINE}}

    rows = [row("this run", metrics)]
    scores = backbone or {}
    base = scores.get("metrics") or {}
    if base:
        rows.append(row(backbone_row_label(scores.get("pooler")), base))
    if reference is not None:
        rows += [row(reference.label, reference.row), row("difference (run − published)", reference.row, True)]
    if base:
        rows.append(row("difference (run − backbone)", base, True))
    return markdown_table(rows, ["", *(TASK_TITLES[t] for t in HEADLINE)]).rstrip("\n")


def artifact_image(run_id: str, path: str, alt: str) -> str:
    """Markdown showing the PNG artifact `path` of run `run_id` in a description: the tracking server serves it at
    `get-artifact?path=…&run_uuid=…`, relative to the UI's own address (so the link holds for any host and port)."""
    return f"![{alt}](get-artifact?path={quote(path)}&run_uuid={run_id})"


STS_CHART = "evaluation/sts_chart.png"  # a test-evaluated training run's chart: this run, the backbone, the paper


def sts_description(
    metrics: Mapping[str, float],
    *,
    method: str,
    preset: str,
    backbone: str,
    setting: str,
    differences: Mapping[str, Any] | None = None,
    before: Mapping[str, Any] | None = None,
    chart: str | None = None,
) -> str:
    """The description of a test-evaluated training run: its STS table (Spearman ×100) beside the backbone before
    training and the published row of its method and setting (the BERT-base row, labelled so, when no paper reports
    its backbone), the differences, and the chart. `setting`: the published setting
    (`cse.config.published.setting_of`); `differences`: what differs from the preset (`preset_differences`); `before`:
    the backbone's evaluation before training (`metrics`, `pooler`), None when not evaluated; `chart`: markdown of the
    run's chart (`artifact_image`), None for none."""
    ref = published.reference_row(published.STS, method, backbone, setting)
    lines = [
        f"**{method} / {preset}** on `{backbone}`" + _differences_text(differences),
        "",
        'STS test, Spearman ×100 (STS12–16 "all", STS-B and SICK-R test; Avg. over the seven):',
        "",
        sts_table(metrics, before, ref),
        "",
    ]
    if before:
        lines += [
            f"The backbone before training: `{backbone}` itself with the job's pooler "
            f"(`{before.get('pooler')}`), no training (cached per backbone and STS data).",
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
    if chart:
        lines += ["", chart]
    lines += ["", "Per-subset scores: artifact `evaluation/sts_subsets.md`; every metric: the Model metrics tab."]
    return "\n".join(lines)


def start_description(
    method: str,
    preset: str,
    backbone: str,
    differences: Mapping[str, Any] | None = None,
    before: Mapping[str, Any] | None = None,
) -> str:
    """The description of a training run while it trains (replaced by `sts_description` after its test evaluation);
    with the backbone's score before training when it was evaluated (`before`)."""
    head = f"**{method} / {preset}** on `{backbone}`{_differences_text(differences)}"
    lines = [head, ""]
    scores = before or {}
    base = scores.get("metrics") or {}
    if "sts_avg" in base:
        lines += [
            f"{backbone_row_label(scores.get('pooler'))}: STS Avg. {_score(base['sts_avg'])} (Spearman ×100).",
            "",
        ]
    lines.append(
        "Training: the loss and STS-B dev curves are on the Model metrics tab. The STS test table, beside the "
        "backbone and the published row, appears here when the test evaluation finishes."
    )
    return "\n".join(lines)


def overrides_text(cfg) -> str:
    """The param `overrides` of a training run: what differs from its preset as in its name (`lr=0.03
    prefix_len=12`), or `(preset)`."""
    name = run_name(cfg)
    head = f"{cfg.method}-{cfg.preset}"
    return name[len(head) :].strip() or "(preset)"


def _differences_text(differences: Mapping[str, Any] | None) -> str:
    if not differences:
        return " (the preset as defined in config/presets.py)"
    return "; differs from the preset: " + ", ".join(f"`{k}={_value_text(v)}`" for k, v in differences.items())


def set_description(run_id: str, markdown: str) -> None:
    """Set run `run_id`'s description (tag `mlflow.note.content`) to `markdown` (MLflow pointed at the store)."""
    mlflow.MlflowClient().set_tag(run_id, NOTE_TAG, markdown)


# ------------------------------------------------------------------------------------------------ the RTD probe
def rtd_probe_history(run_id: str) -> list[tuple[int, dict[str, float]]]:
    """The RTD mechanism probe's figures of run `run_id` at each evaluation step (`cse.models.methods.crtd.PROBE_METRICS`,
    read back from the run's metric history), in step order; empty when the run logged none."""
    client = mlflow.MlflowClient()
    by_step: dict[int, dict[str, float]] = {}
    grads = [k.removeprefix("rtd_probe/") for k in client.get_run(run_id).data.metrics if k.startswith(GRAD_CURVES)]
    for key, name in [*PROBE_METRICS.items(), *((g, g) for g in grads)]:
        for m in client.get_metric_history(run_id, curve_name(name)):
            by_step.setdefault(m.step, {})[key] = m.value
    return sorted(by_step.items())


def _grad_columns(history: Sequence[tuple[int, Mapping[str, float]]]) -> dict[str, str]:
    """The gradient-share metrics of `history`, in `GRAD_GROUPS` order → their column titles."""
    names = {k for _, v in history for k in v if k.startswith(GRAD_METRIC)}
    columns = {}
    for group in GRAD_GROUPS:
        if f"{GRAD_METRIC}share_{group}" in names:
            columns[f"{GRAD_METRIC}share_{group}"] = f"‖λ∇RTD‖ / ‖∇CL‖, {group}"
        if f"{GRAD_METRIC}norm_{group}" in names:
            columns[f"{GRAD_METRIC}norm_{group}"] = f"‖λ∇RTD‖, {group}"
    return columns


def rtd_probe_section(history: Sequence[tuple[int, Mapping[str, float]]]) -> str:
    """The description's section on the RTD mechanism probe: a table of each evaluation's held-out RTD loss with the
    true, the rolled and no h, the gap rolled − true, and what the last gap says."""
    if not history:
        return ""
    grads = _grad_columns(history)
    rows = [
        {
            "step": str(step),
            "loss, true h": f"{v.get('true_h', math.nan):.4f}",
            "loss, rolled h": f"{v.get('rolled_h', math.nan):.4f}",
            "loss, no h": f"{v.get('no_h', math.nan):.4f}",
            "rtd_h_gap (rolled − true)": f"{v.get('gap', math.nan):+.4f}",
            **{title: f"{v.get(name, math.nan):.2e}" for name, title in grads.items()},
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
            "with no h."
            + (
                " The RTD term's gradient share on the same rows (one training batch, train mode): ‖λ∇L_RTD‖ / "
                "‖∇L_CL‖ in each trainable group the contrastive loss reaches, ‖λ∇L_RTD‖ in those it does not."
                if grads
                else ""
            ),
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
