"""Training survives an unreachable MLflow server: a real MLflow server (tests/tracking/mlflow_server.py; started,
killed and restarted by the test, SQLite store) under a tiny Trainer logging through `ResilientMetricLogger`. Nothing
is lost or duplicated, the outage is warned about once and tagged on the run, and a spool left at the end is delivered
by `deliver_spool` / `cse deliver-metrics`."""

from __future__ import annotations

import logging
import time

import mlflow
import pytest
import torch

from cse.ops.cli import main as cse
from cse.storage.runs import RunDir
from cse.storage.spool import metric_count, read_records
from cse.tracking.spool import DELAYED_TAG, ResilientMetricLogger, deliver_spool
from cse.tracking.store import configure_mlflow
from cse.training.loop import LoopResult, Trainer
from tests.tracking.mlflow_server import MlflowServer
from tests.training.test_loop import Recorder, _loop, _model, probe, rows  # noqa: F401  (the tiny trainer's fixtures)

STEPS = 10  # log every step; dev evaluation at 5 and 10
pytestmark = pytest.mark.slow  # a real MLflow server killed and restarted during training


@pytest.fixture(scope="module")
def module_server(tmp_path_factory):
    """One server and store for the module (only the first start migrates it): a test that finds it running (the
    previous test restarted it) uses it as it is (each start costs seconds), one that finds it stopped starts it; it is
    killed after the last test."""
    root = tmp_path_factory.mktemp("mlflow_server")
    srv = MlflowServer(f"sqlite:///{root / 'mlflow.db'}", root)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def server(module_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", module_server.uri)
    return module_server


class Outage:
    """The Trainer's log callback: logs through `metrics_log`, stops the server after the call at step `down_at`,
    starts it again after the call at step `up_at` (if any), and remembers what was produced and what was logged
    while the server was down."""

    def __init__(self, metrics_log: ResilientMetricLogger, server: MlflowServer, down_at: int, up_at: int | None):
        self.metrics_log, self.server, self.down_at, self.up_at = metrics_log, server, down_at, up_at
        self.produced: dict[str, list[tuple[int, float]]] = {}
        self.logged_while_down, self.stopped, self.restarted_ms = 0, False, None

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.produced.setdefault(k, []).append((step, float(v)))
        self.metrics_log.log_metrics(metrics, step)
        if self.stopped and not self.server.running:
            self.logged_while_down += len(metrics)
        if step >= self.down_at and not self.stopped:
            self.server.stop()
            self.stopped = True
        elif self.up_at is not None and step >= self.up_at and self.stopped and not self.server.running:
            self.restarted_ms = int(time.time() * 1000)
            self.server.start()


def _new_run(name: str) -> str:
    configure_mlflow()
    client = mlflow.MlflowClient()
    return client.create_run(client.create_experiment(f"{name}-{time.time_ns()}")).info.run_id


@pytest.fixture
def train(rows, probe, tiny_bert_dir, tmp_path):  # noqa: F811  (rows, probe: tests/training/test_loop.py)
    """Run the tiny D2CSE Trainer of tests/training/test_loop.py for STEPS steps with `log` as its log callback."""

    def run(log) -> LoopResult:
        rec = Recorder(probe)
        loop = _loop(max_steps=STEPS, log_steps=1, eval_steps=5, checkpoint_steps=STEPS)
        return Trainer(
            _model(tiny_bert_dir), rows, loop, torch.device("cpu"), tmp_path / "state", rec.save_best, rec.evaluate, log
        ).run()

    return run


def _history(run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    client = mlflow.MlflowClient()
    return {
        k: [
            (m.step, m.value) for m in sorted(client.get_metric_history(run_id, k), key=lambda m: (m.step, m.timestamp))
        ]
        for k in keys
    }


def _tracking_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cse.tracking.spool" and r.levelno == logging.WARNING]


def test_server_killed_and_restarted_during_training(server, train, tmp_path, caplog):
    if not server.running:
        server.start()
    run_id = _new_run("outage")
    run_dir = RunDir("d2cse", "outage", home=tmp_path)
    run_dir.set_mlflow_run_id(run_id)
    metrics_log = ResilientMetricLogger(run_id, run_dir, retry_seconds=0)
    metrics_log.log_params({"learning_rate": 0.02})
    outage = Outage(metrics_log, server, down_at=3, up_at=7)
    with caplog.at_level(logging.INFO, logger="cse.tracking.spool"):
        result = train(outage)
        assert metrics_log.flush() == 0

    assert result.steps == STEPS  # training went on through the outage
    assert outage.restarted_ms is not None
    assert outage.logged_while_down == sum(
        4 <= s <= 7 for vals in outage.produced.values() for s, _ in vals
    )  # steps 4-7
    assert not run_dir.metrics_spool.exists()
    history = _history(run_id, outage.produced)
    assert history == outage.produced  # every step's values, in order, exactly once
    assert history["stsb_dev"] == outage.produced["stsb_dev"] and [s for s, _ in history["stsb_dev"]] == [5, 10]
    client = mlflow.MlflowClient()
    delayed = [m for m in client.get_metric_history(run_id, "loss") if 4 <= m.step <= 7]
    assert len(delayed) == 4 and all(m.timestamp < outage.restarted_ms for m in delayed)  # stamped when produced
    run = client.get_run(run_id)
    assert run.data.tags[DELAYED_TAG] == str(outage.logged_while_down)
    assert run.data.params["learning_rate"] == "0.02"

    warnings = _tracking_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert server.uri in warnings[0] and str(run_dir.metrics_spool) in warnings[0] and "unreachable" in warnings[0]
    assert any("delivered" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)

    with pytest.raises(mlflow.exceptions.MlflowException):  # a real error is not mistaken for an outage
        metrics_log.log_params({"learning_rate": 0.5})
    assert not run_dir.metrics_spool.exists()


def test_server_down_until_the_end_then_delivered(server, train, caplog, capsys):
    if not server.running:  # (running: the previous test restarted it)
        server.start()
    run_id = _new_run("late")
    run_dir = RunDir("d2cse", "late")  # under $CSE_HOME: `cse deliver-metrics` refuses a folder outside it
    run_dir.set_mlflow_run_id(run_id)
    metrics_log = ResilientMetricLogger(run_id, run_dir, retry_seconds=3600)  # after the first failure: spool only
    outage = Outage(metrics_log, server, down_at=3, up_at=None)
    with caplog.at_level(logging.WARNING, logger="cse.tracking.spool"):
        result = train(outage)
        left = metrics_log.flush()

    assert result.steps == STEPS
    assert left == outage.logged_while_down == metric_count(read_records(run_dir.metrics_spool)) > 0
    outage_warning, final_warning = _tracking_warnings(caplog)
    assert server.uri in outage_warning and str(run_dir.metrics_spool) in outage_warning
    assert f"{left} metric values" in final_warning and str(run_dir.metrics_spool) in final_warning
    assert f"cse deliver-metrics {run_dir.path}" in final_warning

    assert cse(["deliver-metrics", str(run_dir.path)]) == 1  # still down: nothing lost, nothing delivered
    assert "not delivered" in (err := capsys.readouterr().err) and "refused" not in err
    assert metric_count(read_records(run_dir.metrics_spool)) == left

    server.start()
    assert deliver_spool(run_dir) == left
    assert not run_dir.metrics_spool.exists()
    assert _history(run_id, outage.produced) == outage.produced
    assert mlflow.MlflowClient().get_run(run_id).data.tags[DELAYED_TAG] == str(left)

    assert cse(["deliver-metrics", str(run_dir.path)]) == 0  # again: nothing left, nothing duplicated
    assert "nothing to deliver" in capsys.readouterr().out
    assert _history(run_id, outage.produced) == outage.produced
