"""Issue 24: `cse run DEPLOYMENT -p ...` runs a deployment, waits, prints the stages' cache hits and, when the run
fails, the failing task's one-line reason (read from the Prefect API), exit status 1.

The deployment is registered on the session's test server (prefect_test_harness); no worker polls it, so the test
executes the scheduled flow run itself (`run_flow`), as a worker's flow-run process would.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prefect import flow, task

from cse.ops.cli import main as cse
from cse.ops.deployments import failures_of, one_line_reason, parse_params, run_deployment_cli


@task
def ingest_stage() -> None:
    from prefect.logging.handlers import APILogHandler

    print("nli       200 rows  key=abc  cache hit  /data/nli/abc")
    APILogHandler().flush()  # on the server before the run fails: the test need not wait out a batch interval


@task
def load_backbone(name: str) -> None:
    raise OSError(f"We couldn't connect to 'https://huggingface.co' to load this model:\n{name}")


@flow(name="cse-run-failing", log_prints=True)
def failing(config: dict = {"backbone": "bert-base-uncased"}) -> None:  # noqa: B006 - a flow parameter default
    ingest_stage()
    load_backbone(config["backbone"])


@flow(name="cse-run-parent")
def parent() -> None:
    failing({"backbone": "nested-bert"})


@flow(name="cse-run-body")
def body_fails() -> None:
    raise ValueError("bad\n  value")


def test_parse_params_and_one_line_reason():
    assert parse_params(['config={"mask_ratio": 0.15}', "n=3", "name=d2cse-x", "empty="]) == {
        "config": {"mask_ratio": 0.15},
        "n": 3,
        "name": "d2cse-x",
        "empty": "",
    }
    with pytest.raises(ValueError, match="parameter 'mask_ratio' is not key=value"):
        parse_params(["mask_ratio"])
    assert one_line_reason("Task run encountered an exception OSError: no\n  net") == "OSError: no net"
    assert one_line_reason("Flow run encountered an exception: ValueError: x") == "ValueError: x"
    assert one_line_reason("boom sqlite://u:pw@h/db") == "boom sqlite://u:***@h/db"
    assert one_line_reason(None) == "(no message)" and one_line_reason("x" * 1000).endswith("…")


def test_cse_run_prints_the_failing_tasks_reason(prefect_harness, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.flow_engine import run_flow

    monkeypatch.setattr("cse.ops.deployments.LOG_QUIET_S", 0.3)  # (the stage line was flushed before the failure)
    deployment_id = failing.to_deployment(name="cse-run-test").apply()
    lines: list[str] = []
    status: list[int] = []
    waiter = threading.Thread(
        target=lambda: status.append(
            run_deployment_cli(
                "cse-run-failing/cse-run-test",
                ['config={"backbone": "my-local-bert"}'],
                poll_s=0.2,
                out=lines.append,
                err=lambda line: lines.append(f"ERR {line}"),
            )
        )
    )
    waiter.start()
    with get_client(sync_client=True) as client:  # what a worker does: take the scheduled run and execute it
        deadline = time.time() + 30
        while (
            not (
                runs := client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]))
                )
            )
            and time.time() < deadline
        ):
            time.sleep(0.1)
    assert runs, f"cse run created no flow run: {lines}"
    assert runs[0].parameters == {"config": {"backbone": "my-local-bert"}}  # the -p value, parsed as JSON
    run_flow(failing, flow_run=runs[0], parameters=runs[0].parameters, return_type="state")
    waiter.join(60)
    assert status == [1], lines
    text = "\n".join(lines)
    assert "stage: nli 200 rows key=abc cache hit /data/nli/abc" in text
    assert "ERR ==> cse-run-failing/cse-run-test: flow run" in text and "ended Failed" in text
    reason = [line for line in lines if line.startswith("ERR     reason: ")]
    assert len(reason) == 1, lines
    assert reason[0].endswith(
        "> task " + reason[0].split("> task ")[1].split(":")[0] + ": OSError: We couldn't "
        "connect to 'https://huggingface.co' to load this model: my-local-bert"
    )
    assert f"prefect flow-run logs {runs[0].id}" in text


def test_reasons_of_a_failed_subflow_and_of_a_flow_body(prefect_harness):
    from prefect.client.orchestration import get_client

    nested = parent(return_state=True)
    own = body_fails(return_state=True)

    async def reasons(state):
        async with get_client() as client:
            return await failures_of(client, state.state_details.flow_run_id)

    (deep,) = asyncio.run(reasons(nested))  # the child's task, not the parent's "a subflow failed"
    assert [f.split("/")[0] for f in deep.flows] == ["cse-run-parent", "cse-run-failing"]
    assert deep.task.startswith("load_backbone")
    assert deep.reason == "OSError: We couldn't connect to 'https://huggingface.co' to load this model: nested-bert"
    (body,) = asyncio.run(reasons(own))
    assert body.task is None and body.reason == "ValueError: bad value"
    assert str(body).startswith("cse-run-body/") and str(body).endswith(": ValueError: bad value")


def test_unknown_deployment_is_one_line(prefect_harness, capsys):
    assert cse(["run", "no-such-flow/default", "-p", "n=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("cse: error: LookupError: deployment 'no-such-flow/default' not found on the Prefect server")
    assert "`make main` or `scripts/services.sh up` registers the deployments" in err
    assert cse(["run", "train-d2cse"]) == 2
    assert "is not FLOW/DEPLOYMENT" in capsys.readouterr().err
