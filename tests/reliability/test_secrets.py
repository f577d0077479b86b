"""Issue 23 item 2: a password in the tracking URI is never printed: not by a task's error, the flow's error, the
Failed state's message, Prefect's or MLflow's logs, MLflow's "View run" lines, nor a `cse` command's error line.
Issue 32 adds the campaign's forms the pattern missed: a password holding `'`, and a raw `@` in a PostgreSQL DSN's
password (the driver then names the password's tail as the host, once per retry)."""

from __future__ import annotations

import logging
import os
import traceback

import pytest

from tests.ports import free_ports

SECRET = "pw-S3cr3t-23"
# the tracking URIs of the end-to-end cases: the password of each holds SECRET
URIS = {
    "plain": "http://alice:{secret}@127.0.0.1:{port}",
    "quote": "http://alice:Pw'{secret}@127.0.0.1:{port}",
    "raw @": "postgresql+psycopg://alice:p@ss{secret}@127.0.0.1:{port}/mlflow",
}


@pytest.fixture(params=list(URIS))
def dead_tracking(request, monkeypatch) -> str:
    uri = URIS[request.param].format(secret=SECRET, port=free_ports()[0])
    monkeypatch.setattr("mlflow.store.db.utils.MAX_RETRY_COUNT", 2)  # the DSN's store: 2 tries, not 10 (100 s)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    return uri


def test_dead_server_task_flow_and_state_never_show_the_password(
    prefect_harness, dead_tracking, ingest_config, capfd, caplog
):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    from cse.tasks.ingest import ingest_dataset

    @flow(name="reliability-secret")
    def ingest_flow():
        return ingest_dataset("nli", ingest_config)

    with caplog.at_level(logging.DEBUG):
        state = ingest_flow(return_state=True)
    assert state.is_failed()
    exc = state.result(raise_on_failure=False)
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        api_logs = [
            lg.message
            for lg in client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
            )
        ]
    out = capfd.readouterr()
    shown = {
        "state message": state.message,
        "flow error": "".join(traceback.format_exception(exc)),
        "stdout": out.out,
        "stderr": out.err,
        "log records": caplog.text,
        "Prefect API logs": "\n".join(api_logs),
    }
    assert {name: SECRET in text for name, text in shown.items()} == {name: False for name in shown}
    # the error was shown and logged, masked (the DSN's driver names only the password's tail, as the host)
    masked = "'***@127.0.0.1'" if dead_tracking.startswith("postgresql") else "alice:***@127.0.0.1"
    assert masked in state.message and masked in shown["flow error"]
    assert masked in shown["Prefect API logs"] + shown["stderr"]


def test_cse_errors_and_third_party_log_records_are_masked(dead_tracking, capsys, caplog):
    """New cases of the class: a `cse` command that reads MLflow, and any library logging an exception whose text
    holds a DSN password (the record factory masks the message and the traceback)."""
    from cse.ops.cli import main as cse
    from cse.storage.runs import RunDir

    job = RunDir("d2cse", "k1")
    (job.export).mkdir()
    (job.export / "modules.json").write_text("[]")
    job.set_result(
        {
            "run_id": "0" * 32,
            "run_dir": str(job.path),
            "best_checkpoint": str(job.best),
            "steps": 1,
            "best_stsb_dev": 1.0,
            "resumed_from": None,
        }
    )
    assert cse(["card", str(job.path)]) == 2
    assert SECRET not in capsys.readouterr().err
    with caplog.at_level(logging.WARNING):
        try:
            raise ConnectionError(f"could not connect to postgresql://cse:{SECRET}@db:5432/prefect?token={SECRET}")
        except ConnectionError:
            logging.getLogger("sqlalchemy.pool").exception("pool failed for %s", f"host=db password={SECRET}")
    assert SECRET not in caplog.text and "cse:***@db" in caplog.text and "password=***" in caplog.text
    formatted = logging.Formatter().format(caplog.records[-1])
    assert SECRET not in formatted and "token=***" in formatted


def test_cse_card_on_an_unreachable_server_answers_in_seconds_and_masked(monkeypatch, capsys):
    """The campaign's `cse card` printed the quoted password after 4.5 minutes of silent retries (MLflow's 7 HTTP
    retries with backoff): a command someone waits on bounds them (`cse.ops.cli.INTERACTIVE_MLFLOW`)."""
    import time

    from cse.ops.cli import main as cse
    from cse.storage.runs import RunDir

    monkeypatch.setenv("MLFLOW_TRACKING_URI", URIS["quote"].format(secret=SECRET, port=free_ports()[0]))
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    job = RunDir("simcse", "k1")
    job.export.mkdir()
    (job.export / "modules.json").write_text("[]")
    job.set_result({"run_id": "0" * 32, "run_dir": str(job.path), "steps": 1, "resumed_from": None})
    t0 = time.monotonic()
    assert cse(["card", str(job.path)]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - t0 < 30 and SECRET not in err and "alice:***@127.0.0.1" in err
    assert "cannot read MLflow run 00000000000000000000000000000000" in err
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # restored after the command


def test_view_run_lines_never_show_the_password(monkeypatch, capfd):
    """MLflow writes "View run <name> at: <tracking URI>/#/..." straight to stdout when a run ends (a REST store:
    a server). MLflow's own code runs here against a REST store whose URI holds the password; only the server's
    answer to `get_run` is stood in for. The lines are switched off when the URI carries credentials."""
    from mlflow.entities import Run, RunData, RunInfo
    from mlflow.tracking._tracking_service.client import TrackingServiceClient

    from cse.tracking.store import configure_mlflow

    uri = f"http://alice:{SECRET}@127.0.0.1:{free_ports()[0]}"
    run = Run(
        RunInfo(
            run_id="r" * 32,
            experiment_id="1",
            user_id="u",
            status="FINISHED",
            start_time=0,
            end_time=1,
            lifecycle_stage="active",
            run_name="reliability-view-run",
        ),
        RunData(),
    )

    def print_view_run_lines():
        client = TrackingServiceClient(uri)
        monkeypatch.setattr(client.store, "get_run", lambda run_id: run)
        client._log_url(run.info.run_id)
        return capfd.readouterr().out

    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    before = print_view_run_lines()  # what MLflow prints without the project's setting: the campaign's finding
    assert "View run reliability-view-run" in before and SECRET in before
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    configure_mlflow()
    assert print_view_run_lines() == ""
