"""The MLflow pages in a real browser: a real MLflow server (tests/tracking/mlflow_server.py) on this test's SQLite
store, a run recorded through the project's tracking functions, and its pages opened in headless Chromium (Debian's
`chromium`, driven by Playwright; CI installs it).

The runs' numbers are fabricated inputs of the page (no training runs here), recorded through the same functions the
training, evaluation and compare stages call: what is checked is what the pages show.
The test fails (never skips) when Chromium or Playwright is missing. A screenshot of each page is left in
`$TMPDIR/cse-mlflow-pages/` to look at.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import mlflow
import pytest

from cse.config import published
from cse.config.methods import DEFAULT_METHOD
from cse.config.training import resolve_train_config
from cse.evaluation.plots import sts_scores_plot
from cse.storage.readers import SEVEN_TASKS
from cse.storage.runs import RunDir
from cse.storage.settings import get_settings
from cse.tracking.group_runs import COMPARISON_CHART
from cse.tracking.run_pages import (
    BACKBONE_AVG_TAG,
    BACKBONE_TAG,
    OVERRIDES_PARAM,
    STS_CHART,
    backbone_tag,
    curve_metrics,
    experiment_url,
    overrides_text,
    page_metrics,
    preset_differences,
    run_name,
    run_url,
    score_tags,
    set_description,
    start_description,
)
from cse.tracking.stage_runs import log_dataset_metrics, log_run_results, stage_run
from cse.tracking.training_runs import describe_tested_run, training_run, training_run_ref
from tests.tracking.mlflow_server import MlflowServer

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SHOTS = Path(tempfile.gettempdir()) / "cse-mlflow-pages"


LOOP_METRICS = (  # what the training loop logs every log_steps (training/loop.py), by its own names
    "loss",
    "loss_contrastive",
    "loss_rtd",
    "rtd_accuracy",
    "learning_rate",
    "grad_norm",
    "epoch",
    "phase",
    "sentences_per_s",
    "tokens_per_s",
    "host_wait_share",
    "peak_memory_gb",
)
STEPS = 40


def _record_runs() -> dict[str, str]:
    """Runs recorded through the project's tracking functions as tasks/train.py, tasks/evaluate.py and tasks/compare.py
    record them: a smoke job with a learning-rate override (curves every 5 steps in their sections, the test scores at
    the last step beside the backbone's at step 0, the score tags, the overrides param, the chart and the description),
    a second job on the preset (every score 1.0 lower), a re-evaluation of the first nested under it, and a comparison
    of both. Returns the ids (experiment `experiment`, runs `run`, `other`, `evaluation`, `comparison`) and the first
    run's test metrics."""
    from cse.tasks.compare import record_comparison, select_runs

    cfg = resolve_train_config("smoke", {"learning_rate": 0.03}, method=DEFAULT_METHOD)
    metrics = {t: 60.0 + 2.5 * i + 0.123456 for i, t in enumerate(SEVEN_TASKS)}
    metrics["sts_avg"] = round(sum(metrics.values()) / 7, 2)
    metrics |= {"retrieval_r1": 40.0, "retrieval_r5": 70.0, "alignment": 0.2, "uniformity": -2.1}
    subsets = {"sts12/MSRpar": 55.0, "sts12/MSRpar_pearson": 56.0, "sts14/images": 70.0, "eval_seconds": 3.0}
    before = {
        "evaluation_id": "backbone-test",
        "pooler": "cls_before_pooler",
        "metrics": {k: v - 3.0 for k, v in metrics.items()},
    }
    ids: dict[str, str] = {}
    for key, c, lower in (("run", cfg, 0.0), ("other", resolve_train_config("smoke", method=DEFAULT_METHOD), 1.0)):
        scores = {k: v - lower if k in (*SEVEN_TASKS, "sts_avg") else v for k, v in metrics.items()}
        run_dir = RunDir(c.method, f"browser-{key}")
        tags = {"method": c.method, "backbone": c.backbone, "preset": c.preset, "run_dir": str(run_dir.path)}
        params = {"supervised": False, OVERRIDES_PARAM: overrides_text(c)}
        with training_run(c.method, run_dir, run_name(c), tags, params, False) as run:
            run_id = ids[key] = run.info.run_id
            ids["experiment"] = run.info.experiment_id
            log_run_results(run_id, tags={BACKBONE_TAG: backbone_tag(before), **score_tags({}, before["metrics"])})
            set_description(run_id, start_description(c.method, c.preset, c.backbone, preset_differences(c), before))
            for step in range(5, STEPS + 1, 5):
                loop = {name: 1.0 + (i + 1) / step for i, name in enumerate(LOOP_METRICS)}
                log_dataset_metrics(curve_metrics(loop), run_id=run_id, step=step)
                if step % 10 == 0:
                    dev = {"stsb_dev": 50.0 + step / 10}
                    log_dataset_metrics(curve_metrics(dev), run_id=run_id, step=step)
                    log_dataset_metrics({"best_stsb_dev": dev["stsb_dev"]}, run_id=run_id, step=step)
        log_run_results(run_id, metrics={"train_seconds": 90.0}, step=STEPS)
        log_run_results(run_id, metrics=page_metrics({**scores, **subsets}), tags=score_tags(scores), step=STEPS)
        log_run_results(run_id, metrics=page_metrics(before["metrics"]), step=0)
        describe_tested_run(c, run_id, scores, before, plot=sts_scores_plot)  # the chart and the description
    # a re-evaluation of the first job's checkpoint: placed as tasks/evaluate_common.py places one (nested)
    parent = training_run_ref(ids["run"])
    with stage_run(
        parent.experiment, f"evaluate-test-{parent.run_name}", tags={"stage": "evaluate", **parent.link_tags()}
    ) as ev:
        ids["evaluation"] = ev.info.run_id
        log_run_results(ev.info.run_id, metrics=page_metrics(metrics), tags=score_tags(metrics))
    ids["comparison"] = record_comparison(
        select_runs(methods=[DEFAULT_METHOD]), {"methods": [DEFAULT_METHOD]}
    ).mlflow_run_id
    ids["comparison_experiment"] = mlflow.get_run(ids["comparison"]).info.experiment_id
    return ids, metrics


def _chart_state(page) -> dict:
    """The Model metrics tab's chart layout as the page generated it (MLflow keeps it in the browser's local storage,
    key `...RunPage-<run id>-model-chartUIState`): its sections and its charts (type, metric, section)."""
    store = page.evaluate("() => Object.fromEntries(Object.keys(localStorage).map(k => [k, localStorage.getItem(k)]))")
    [state] = [json.loads(v) for k, v in store.items() if k.endswith("-model-chartUIState")]
    return state


def test_mlflow_pages_read_at_a_glance(tmp_path):
    """Issue 34: the runs table's score columns in the paper's order with two decimals (the score tags) and the
    overrides column; the run's description with the table beside the backbone and the paper and its chart (an
    artifact the server serves); no chart a single bar; the comparison's chart in its description. Issue 44: the runs
    table sorted by the STS Avg., best first (the re-evaluation, under that order, a row of its own); the Model
    metrics tab starting with the test scores in the paper's order, then the dev and loss curves."""
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: install Debian's `chromium` package"
    server = MlflowServer(get_settings().mlflow_tracking_uri, tmp_path)
    server.launch()
    base = server.uri
    try:
        ids, metrics = _record_runs()  # while the server starts
        server.wait_healthy()
        SHOTS.mkdir(exist_ok=True)
        cfg = resolve_train_config("smoke", method=DEFAULT_METHOD)
        paper = published.STS[(cfg.method, published.REFERENCE_FAMILY, "unsup")]
        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"),
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_FLAGS,
                viewport={"width": 2200, "height": 1000},
            )
            page = browser.new_page()
            # the experiment: the model-training runs table with the shared scores view
            page.goto(experiment_url(base, ids["experiment"]))
            page.get_by_text(f"{cfg.method}-smoke lr=0.03").first.wait_for(timeout=20_000)
            page.get_by_role("columnheader", name=f"{BACKBONE_AVG_TAG}").first.wait_for(timeout=10_000)
            page.screenshot(path=str(SHOTS / "experiment.png"))
            body = page.inner_text("body")
            assert "workflowType=machine_learning" in page.url and "/runs" in page.url
            assert "Token usage" not in body and "Latency" not in body, "the experiment opened in the GenAI view"
            headers = [h.strip() for h in page.get_by_role("columnheader").all_inner_texts() if h.strip()]
            scores = ["1 STS12", "2 STS13", "3 STS14", "4 STS15", "5 STS16", "6 STS-B", "7 SICK-R", "8 Avg."]
            shown = [h for h in dict.fromkeys(headers) if h in {OVERRIDES_PARAM, *scores, BACKBONE_AVG_TAG}]
            assert shown == [OVERRIDES_PARAM, *scores, BACKBONE_AVG_TAG], headers  # the paper's order
            job = page.get_by_role("row").filter(has_text=f"{cfg.method}-smoke lr=0.03")
            row = job.filter(has_not_text="evaluate-test-").first  # (not its re-evaluation's row)
            # (AG Grid draws a row's pinned and scrolled cells as two row elements with the same row-id)
            cells = [
                c.strip()
                for c in page.locator(f"[row-id='{row.get_attribute('row-id')}'] [role=gridcell]").all_inner_texts()
            ]
            assert "lr=0.03" in cells and f"{metrics['sts12']:.2f}" in cells and f"{metrics['sts_avg']:.2f}" in cells
            assert "60.12" in cells and "60.123456" not in " ".join(cells)  # two decimals, not the float's digits
            # the best STS Avg. first: the job on the preset (every score 1.0 lower) after the lr=0.03 job and its
            # re-evaluation, which the score order shows as a row of its own (MLflow nests only under a date order)
            assert page.get_by_test_id("sort-select-dropdown").first.inner_text().strip() == "Sort: sts_avg"
            names = [n for n in page.get_by_role("row").all_inner_texts() if f"{cfg.method}-smoke" in n]
            order = [n for n in dict.fromkeys(" ".join(n.split()) for n in names)]
            first_other = next(i for i, n in enumerate(order) if "lr=0.03" not in n)
            assert all("lr=0.03" in n for n in order[:first_other]) and first_other >= 2, order
            assert any(f"evaluate-test-{cfg.method}-smoke lr=0.03" in n for n in order[:first_other]), order
            # the run: the STS table beside the backbone before training and the paper's row, and its chart
            page.goto(run_url(base, ids["experiment"], ids["run"]))
            label = "published (BERT-base; this run uses packaged:minilm)"
            page.get_by_role("cell", name=label).wait_for(timeout=20_000)
            if (more := page.get_by_text("Show more", exact=True)).count():
                more.first.click()  # the whole description, for the screenshot
            chart = page.locator(f"img[src*='get-artifact?path={STS_CHART}']")
            chart.wait_for(timeout=20_000)
            page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=chart.element_handle())
            page.screenshot(path=str(SHOTS / "run.png"), full_page=True)
            rows = {r.split("\t")[0].strip(): r for r in page.locator("table tr").all_inner_texts()}
            assert f"{metrics['sts_avg']:.2f}" in rows["this run"]
            assert f"{metrics['sts_avg'] - 3.0:.2f}" in rows["backbone before training (cls_before_pooler)"]
            assert f"{paper['sts_avg']:.2f}" in rows[label] and f"{paper['sts12']:.2f}" in rows[label]
            assert f"{metrics['sts_avg'] - paper['sts_avg']:+.2f}" in rows["difference (run − published)"]
            assert "+3.00" in rows["difference (run − backbone)"]
            # its charts: the test scores first (the paper's order), then the dev and loss curves; no chart a single
            # bar, no per-subset score
            page.goto(run_url(base, ids["experiment"], ids["run"]).replace("?", "/model-metrics?"))
            page.get_by_text("1 STS12", exact=True).first.wait_for(timeout=20_000)  # (the curves lie below the fold)
            page.get_by_text("8 Avg.", exact=True).first.wait_for(timeout=20_000)
            page.get_by_text("Step", exact=True).first.wait_for(timeout=20_000)  # (a drawn chart's x axis)
            page.screenshot(path=str(SHOTS / "model-metrics.png"))
            state = _chart_state(page)
            sections = {s["uuid"]: s["name"] for s in state["compareRunSections"]}
            assert [s["name"] for s in state["compareRunSections"]][:3] == ["STS test", "dev", "loss"]
            charts = [
                (sections[c["metricSectionId"]], c.get("metricKey"), c["type"]) for c in state["compareRunCharts"]
            ]
            in_order = sorted(charts, key=lambda c: list(sections.values()).index(c[0]))
            titles = ("STS12", "STS13", "STS14", "STS15", "STS16", "STS-B", "SICK-R", "Avg.")
            assert [c[1] for c in in_order[:10]] == [
                *(f"STS test/{i} {t}" for i, t in enumerate(titles, 1)),
                "dev/stsb_dev",
                "loss/loss",
            ], in_order
            assert not [c for c in charts if c[2] != "LINE"], charts  # every metric a line: before → after, curves
            keys = {c[1] for c in charts}
            assert {"sts_avg", "sts12", "train_seconds", "best_stsb_dev"} <= keys and "progress/phase" not in keys
            assert not [k for k in keys if k.startswith(("sts12/", "sts14/")) or k == "eval_seconds"]
            charts_text = page.inner_text("body")
            assert "MSRpar" not in charts_text and "images" not in charts_text
            # the comparison: its description holds the chart of all its runs
            page.goto(run_url(base, ids["comparison_experiment"], ids["comparison"]))
            page.get_by_text("Show more", exact=True).first.click()  # (a long description starts folded)
            chart = page.locator(f"img[src*='get-artifact?path={COMPARISON_CHART}']")
            chart.wait_for(timeout=20_000)
            page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=chart.element_handle())
            page.screenshot(path=str(SHOTS / "comparison.png"), full_page=True)
            browser.close()
    finally:
        server.stop()
