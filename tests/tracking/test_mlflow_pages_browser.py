"""The MLflow pages in a real browser: a real MLflow server (MLflow's own app under uvicorn, as `mlflow server` runs
it) on this test's SQLite store and a free port, a run recorded through the project's tracking functions, and its
pages opened in headless Chromium (Debian's `chromium`, driven by Playwright; CI installs it).

The run's numbers are fabricated inputs of the page (no training runs here): what is checked is what the pages show.
The test fails (never skips) when Chromium or Playwright is missing. A screenshot of each page is left in
`$TMPDIR/cse-mlflow-pages/` to look at.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cse.config import published
from cse.config.methods import DEFAULT_METHOD
from cse.config.settings import get_settings
from cse.config.training import resolve_train_config
from cse.storage.readers import SEVEN_TASKS
from cse.storage.runs import RunDir
from cse.tracking.run_pages import (
    experiment_url,
    page_metrics,
    preset_differences,
    run_name,
    run_url,
    set_description,
    start_description,
    sts_description,
)
from cse.tracking.stage_runs import log_dataset_metrics, log_run_results
from cse.tracking.training_runs import training_run

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(store_uri: str, artifacts: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """MLflow's server app (`mlflow.server.fastapi_app:app`, what `mlflow server` starts) under uvicorn, one
    process: half the start-up of `mlflow server`, which imports MLflow twice (its CLI, then uvicorn's worker)."""
    port = _free_port()
    env = {
        **os.environ,
        "_MLFLOW_SERVER_FILE_STORE": store_uri,  # mlflow.server.constants.BACKEND_STORE_URI_ENV_VAR
        "_MLFLOW_SERVER_ARTIFACT_ROOT": str(artifacts),  # ... ARTIFACT_ROOT_ENV_VAR
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    cmd = [sys.executable, "-m", "uvicorn", "--host", "127.0.0.1", "--port", str(port), "mlflow.server.fastapi_app:app"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen, base: str, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the MLflow server exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    pytest.fail(f"the MLflow server was not healthy after {timeout}s: {log.read_text()[-3000:]}")


def _record_run() -> tuple[str, str, dict[str, float]]:
    """A smoke job's run with a learning-rate override, recorded as tasks/train.py records one: its name, start
    description, a loss curve, the test metrics (per-subset scores left out as for a training run) and the final
    description. Returns (experiment id, run id, metrics)."""
    cfg = resolve_train_config("smoke", {"learning_rate": 0.03}, method=DEFAULT_METHOD)
    diffs = preset_differences(cfg)
    metrics = {t: 60.0 + 2.5 * i for i, t in enumerate(SEVEN_TASKS)}
    metrics["sts_avg"] = round(sum(metrics.values()) / 7, 2)
    subsets = {"sts12/MSRpar": 55.0, "sts12/MSRpar_pearson": 56.0, "sts14/images": 70.0}
    run_dir = RunDir(cfg.method, "browser-test")
    with training_run(cfg.method, run_dir, run_name(cfg), {"method": cfg.method}, {"lr": 0.03}, False) as run:
        run_id, experiment_id = run.info.run_id, run.info.experiment_id
        set_description(run_id, start_description(cfg.method, cfg.preset, cfg.backbone, diffs))
        for step in range(1, 9):
            log_dataset_metrics({"loss": 2.0 / step, "stsb_dev": 50.0 + step}, run_id=run_id, step=step * 5)
    log_run_results(run_id, metrics=page_metrics({**metrics, **subsets}))
    setting = published.setting_of(cfg.method, cfg.preset, cfg.supervised)
    description = sts_description(
        metrics, method=cfg.method, preset=cfg.preset, backbone=cfg.backbone, setting=setting, differences=diffs
    )
    set_description(run_id, description)
    return experiment_id, run_id, metrics


def test_mlflow_pages_show_the_sts_table_and_open_in_the_model_training_view(tmp_path):
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: install Debian's `chromium` package"
    store = get_settings().mlflow_tracking_uri
    proc, base = _start_server(store, tmp_path / "artifacts", tmp_path / "server.log")
    try:
        experiment_id, run_id, metrics = _record_run()  # while the server starts
        _wait_healthy(proc, base, tmp_path / "server.log")
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
            # the experiment: the model-training runs table with the STS columns (the shared scores view)
            page.goto(experiment_url(base, experiment_id))
            page.get_by_text(f"{cfg.method}-smoke lr=0.03").first.wait_for(timeout=20_000)
            page.screenshot(path=str(SHOTS / "experiment.png"))
            page.get_by_role("columnheader", name="sts_avg").first.wait_for(timeout=10_000)
            page.screenshot(path=str(SHOTS / "experiment.png"))
            body = page.inner_text("body")
            assert "workflowType=machine_learning" in page.url and "/runs" in page.url
            assert "Token usage" not in body and "Latency" not in body, "the experiment opened in the GenAI view"
            for task in ("sts12", "sickr"):
                assert page.get_by_role("columnheader", name=task).count() >= 1, f"no {task} column"
            # the run: its description is the STS table beside the paper's row (BERT-base, labelled as such)
            page.goto(run_url(base, experiment_id, run_id))
            label = "published (BERT-base; this run uses packaged:minilm)"
            cell = page.get_by_role("cell", name=label)
            cell.wait_for(timeout=20_000)
            if (more := page.get_by_text("Show more", exact=True)).count():
                more.first.click()  # the whole description, for the screenshot
            page.screenshot(path=str(SHOTS / "run.png"))
            rows = {r.split("\t")[0].strip(): r for r in page.locator("table tr").all_inner_texts()}
            assert f"{metrics['sts_avg']:.2f}" in rows["this run"]
            assert f"{paper['sts_avg']:.2f}" in rows[label] and f"{paper['sts12']:.2f}" in rows[label]
            assert f"{metrics['sts_avg'] - paper['sts_avg']:+.2f}" in rows["difference (run − published)"]
            # its charts: the loss curve's section is not preceded by per-subset sections
            page.goto(run_url(base, experiment_id, run_id).replace("?", "/model-metrics?"))
            page.get_by_text("Model metrics", exact=False).first.wait_for(timeout=20_000)
            page.get_by_text("loss", exact=True).first.wait_for(timeout=20_000)
            page.screenshot(path=str(SHOTS / "model-metrics.png"))
            charts = page.inner_text("body")
            assert "MSRpar" not in charts and "images" not in charts
            browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
