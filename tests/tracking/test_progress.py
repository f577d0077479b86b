"""tracking/progress.py: what `cse run` reads back from MLflow, on a real (SQLite) store written through the tracking
functions the stages use: a flow run's runs, a training run's progress from its logged curves, and the summary of a
training run, of a re-evaluation of it and of a comparison (`cse run evaluate/...`, `cse run compare/...`)."""

from __future__ import annotations

import re

import mlflow
import pytest

from cse.config import published
from cse.config.methods import DEFAULT_METHOD
from cse.ops.follow import Printer, progress_bar, summary
from cse.storage.readers import SEVEN_TASKS
from cse.storage.runs import RunDir
from cse.tasks.compare import record_comparison, select_runs
from cse.tracking.progress import RunView, runs_of_flow_runs, summary_lines, training_progress
from cse.tracking.run_pages import BACKBONE_TAG, backbone_tag, curve_metrics, page_metrics
from cse.tracking.stage_runs import log_dataset_metrics, log_run_results, stage_run
from cse.tracking.training_runs import training_run, training_run_ref

FLOW_RUN = "0b7c4c1e-0000-4000-8000-000000000001"
SCORES = {t: 60.0 + i for i, t in enumerate(SEVEN_TASKS)} | {"sts_avg": 63.0}
BEFORE = {"evaluation_id": "backbone-x", "pooler": "cls_before_pooler", "metrics": {"sts_avg": 61.5, "sts12": 59.0}}


def _training(steps: int = 4, total: int = 8) -> str:
    run_dir = RunDir(DEFAULT_METHOD, f"progress-{steps}")
    tags = {
        "method": DEFAULT_METHOD,
        "backbone": "packaged:minilm",
        "preset": "smoke",
        "run_dir": str(run_dir.path),
        "prefect_flow_run_id": FLOW_RUN,
        BACKBONE_TAG: backbone_tag(BEFORE),
    }
    with training_run(DEFAULT_METHOD, run_dir, "d2cse-smoke lr=0.0001", tags, {"total_steps": total}, False) as run:
        for step in range(1, steps + 1):
            log_dataset_metrics(curve_metrics({"loss": 2.0 / step}), run_id=run.info.run_id, step=step)
        log_dataset_metrics(curve_metrics({"stsb_dev": 70.123}), run_id=run.info.run_id, step=2)
    return run.info.run_id


def test_training_progress_is_read_from_the_logged_curves():
    run_id = _training()
    p = training_progress(run_id)
    assert (p.step, p.total, p.loss, p.dev) == (4, 8, 0.5, pytest.approx(70.123))
    assert p.seconds_per_step is not None and p.eta_s == pytest.approx(4 * p.seconds_per_step)
    line = progress_bar(p, tty=False)
    # the bar's width is what the line leaves it (the rate's digits vary): an odd width ends half a cell, tqdm's digit
    assert re.search(r"train:\s+50%\|#+\d?\s*\| 4/8 \[.*loss=0\.5000, dev=70\.12\]  ETA \d+:\d\d:\d\d$", line), line
    assert [v.kind for v in runs_of_flow_runs([FLOW_RUN])] == ["training"]
    assert training_progress(_training(steps=0)) is None  # nothing logged yet: no bar


def test_the_summaries_of_a_training_run_a_re_evaluation_and_a_comparison():
    run_id = _training()
    log_run_results(run_id, metrics=page_metrics(SCORES), step=8)
    [view] = [v for v in runs_of_flow_runs([FLOW_RUN]) if v.run_id == run_id]
    text = "\n".join(summary_lines(view, base="http://mlflow:5000"))
    paper = published.STS[(DEFAULT_METHOD, "bert-base", "unsup")]
    assert "| this run | 60.00 | 61.00 |" in text and "| backbone before training (cls_before_pooler) | 59.00 |" in text
    assert f"| published (BERT-base; this run uses packaged:minilm) | {paper['sts12']:.2f} |" in text
    assert f"MLflow run {run_id} (d2cse-smoke lr=0.0001): http://mlflow:5000/#/experiments/" in text
    assert f"/runs/{run_id}?workflowType=machine_learning" in text and "job folder: " in text

    # `cse run evaluate/default -p 'config={"checkpoint": "runs:/<id>"}'`: nested under the job, shown beside its rows
    parent = training_run_ref(run_id)
    tags = {"stage": "evaluate", "prefect_flow_run_id": FLOW_RUN, **parent.link_tags()}
    with stage_run(parent.experiment, "evaluate-test-d2cse-smoke", tags=tags) as ev:
        log_run_results(ev.info.run_id, metrics=page_metrics({**SCORES, "sts12": 70.0}))
    evaluation = RunView.of(mlflow.get_run(ev.info.run_id))
    assert evaluation.kind == "evaluation"
    text = "\n".join(summary_lines(evaluation))
    assert f"re-evaluation of d2cse-smoke lr=0.0001 (MLflow run {run_id}):" in text
    assert "| this run | 70.00 |" in text and "| backbone before training (cls_before_pooler) | 59.00 |" in text
    assert "| published (BERT-base; this run uses packaged:minilm) |" in text

    # `cse run compare/default`: the comparison's side-by-side table (its description without the chart)
    comparison = record_comparison(select_runs(methods=[DEFAULT_METHOD]), {"methods": [DEFAULT_METHOD]})
    client = mlflow.MlflowClient()
    client.set_tag(comparison.mlflow_run_id, "prefect_flow_run_id", FLOW_RUN)
    lines: list[str] = []
    summary([FLOW_RUN], Printer(lines.append), "http://prefect:4200/runs/flow-run/x")
    text = "\n".join(lines)
    assert lines[0] == "    Prefect flow run: http://prefect:4200/runs/flow-run/x"
    assert len([x for x in lines if x.startswith("    MLflow run ")]) == 3  # the job, the re-evaluation, the comparison
    assert "    ### STS (Spearman ×100, test)" in text and "| d2cse-smoke lr=0.0001 | backbone | 59.00 |" in text
    assert "![" not in text  # (the chart is for the page)


def test_a_reused_job_is_summarised_and_quiet_and_json_name_the_run():
    """Issue 44, item 2: a cache-hit rerun makes no MLflow run of its own (its flow run id tags none): the run its log
    names (`already finished (MLflow run <id>)`) gets the same summary; `--quiet` keeps the id, page and job folder;
    `--json` a record of each. The data warnings the run carries are in both."""
    from cse.ops.follow import reused_runs
    from cse.tracking.data_warnings import data_warning_tags
    from cse.tracking.progress import summary_record

    run_id = _training()
    log_run_results(run_id, metrics=page_metrics(SCORES), step=8)
    mlflow.MlflowClient().set_tag(
        run_id, *next(iter(data_warning_tags(["Wiki1M is a sample; not comparable"]).items()))
    )
    said = [f"job /x/runs/d2cse/k already finished (MLflow run {run_id}): returning its result", "tokens ... cache hit"]
    assert reused_runs(said) == [run_id]
    rerun = "0b7c4c1e-0000-4000-8000-0000000000ff"  # a flow run that made no MLflow run
    lines: list[str] = []
    shown = summary([rerun], Printer(lines.append), None, reused=reused_runs(said), warnings=["malformed line 3"])
    text = "\n".join(lines)
    assert [v.run_id for v in shown] == [run_id]
    assert "| this run | 60.00 | 61.00 |" in text and f"    MLflow run {run_id} (d2cse-smoke lr=0.0001): " in text
    assert "    job folder: " in text and "    warning: Wiki1M is a sample; not comparable" in text
    assert lines[-2:] == ["    warnings the stages logged (the worker log has them whole):", "      malformed line 3"]
    quiet: list[str] = []
    summary([rerun], Printer(quiet.append), None, reused=[run_id], table=False)
    assert quiet[0].startswith(f"    MLflow run {run_id} ") and not any("| this run |" in x for x in quiet)
    record = summary_record(shown[0], base="http://127.0.0.1:5123")
    assert record["mlflow_run_id"] == run_id and record["sts"]["sts_avg"] == 63.0
    assert str(record["url"]).startswith("http://127.0.0.1:5123/#/experiments/")
    assert record["warnings"] == ["Wiki1M is a sample; not comparable"] and record["run_dir"]


class _Tty:
    def __init__(self):
        self.text = ""

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def test_a_finished_bar_is_not_drawn_again_and_a_new_dev_score_is_a_new_line():
    """Issue 44, item 4: on a terminal the bar closed by a later line is not drawn again while it has not changed
    (its clock ran on after every stage line); into a pipe a dev score logged after its step's loss is a new line
    (the last line said a stale dev score)."""
    tty = _Tty()
    lines: list[str] = []
    printer = Printer(lines.append, tty=True, stream=tty)
    printer.bar("train 100% 8/8", key=("r", 8, 0.5, 70.1))
    printer.line("evaluate-test: running")
    printer.bar("train 100% 8/8 [00:31]", key=("r", 8, 0.5, 70.1))
    assert tty.text.count("train 100%") == 1 and lines == ["evaluate-test: running"]
    piped: list[str] = []
    pipe = Printer(piped.append)
    pipe.bar("8/8 dev=70.10", key=("r", 8, 0.5, 70.1))
    pipe.bar("8/8 dev=70.10", key=("r", 8, 0.5, 70.1))
    pipe.bar("8/8 dev=70.52", key=("r", 8, 0.5, 70.52))
    assert piped == ["8/8 dev=70.10", "8/8 dev=70.52"]
