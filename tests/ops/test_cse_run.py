"""Issue 24: `cse run DEPLOYMENT -p ...` runs a deployment, waits, prints the stages' cache hits and, when the run
fails, the failing task's one-line reason (read from the Prefect API), exit status 1.

The deployment is registered on the session's test server (prefect_test_harness); no worker polls it, so the test
executes the scheduled flow run itself (`run_flow`), as a worker's flow-run process would.
"""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor

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
    parsed = {"config": {"mask_ratio": 0.15}, "n": 3, "name": "d2cse-x", "empty": ""}
    assert parse_params(['config={"mask_ratio": 0.15}', "n=3", "name=d2cse-x", "empty="]) == parsed
    with pytest.raises(ValueError, match="parameter 'mask_ratio' is not key=value"):
        parse_params(["mask_ratio"])
    assert one_line_reason("Task run encountered an exception OSError: no\n  net") == "OSError: no net"
    assert one_line_reason("Flow run encountered an exception: ValueError: x") == "ValueError: x"
    assert one_line_reason("boom sqlite://u:pw@h/db") == "boom sqlite://u:***@h/db"
    assert one_line_reason(None) == "(no message)" and one_line_reason("x" * 1000).endswith("…")


@pytest.mark.parametrize("quiet", [True, False])
def test_cse_run_prints_the_failing_tasks_reason(prefect_harness, monkeypatch, quiet):
    """`--quiet` prints what `cse run` printed before it followed runs: the changes of state, then the stage lines and
    the reason. Followed, the stages come as they end (with the stage lines as they are logged), and the end names the
    flow run's Prefect page."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.flow_engine import run_flow

    monkeypatch.setattr("cse.ops.deployments.LOG_QUIET_S", 0.3)  # (the stage line was flushed before the failure)
    deployment_id = failing.to_deployment(name="cse-run-test").apply()
    lines: list[str] = []
    flt = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]))
    with get_client(sync_client=True) as client:
        earlier = {r.id for r in client.read_flow_runs(flow_run_filter=flt)}  # (the other parametrisation's)
    waiter = ThreadPoolExecutor(1).submit(
        run_deployment_cli,
        "cse-run-failing/cse-run-test",
        ['config={"backbone": "my-local-bert"}'],
        poll_s=0.2,
        out=lines.append,
        err=lambda line: lines.append(f"ERR {line}"),
        quiet=quiet,
        tty=False,
    )
    with get_client(sync_client=True) as client:  # what a worker does: take the scheduled run and execute it
        deadline = time.time() + 30
        while not (runs := [r for r in client.read_flow_runs(flow_run_filter=flt) if r.id not in earlier]):
            assert time.time() < deadline, f"cse run created no flow run: {lines}"
            time.sleep(0.1)
    assert runs[0].parameters == {"config": {"backbone": "my-local-bert"}}  # the -p value, parsed as JSON
    run_flow(failing, flow_run=runs[0], parameters=runs[0].parameters, return_type="state")
    assert waiter.result(timeout=60) == 1, lines
    text = "\n".join(lines)
    assert "stage: nli 200 rows key=abc cache hit /data/nli/abc" in text
    if quiet:
        assert "    stage: nli 200 rows key=abc cache hit /data/nli/abc" in lines and "Prefect flow run:" not in text
    else:  # followed: the stage's line when it was logged, each task's end, the flow run's page at the end
        assert re.search(r"^\s+\d+ s  stage: nli 200 rows key=abc cache hit", text, flags=re.M), text
        assert re.search(r"^\s+\d+ s  ingest_stage: Completed", text, flags=re.M), text
        assert re.search(r"^\s+\d+ s  load_backbone: Failed", text, flags=re.M), text
        assert re.search(rf"^    Prefect flow run: http://\S+/runs/flow-run/{runs[0].id}$", text, flags=re.M), text
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
    assert "`cse deployments` lists them (`make main` or `scripts/services.sh up` registers them)" in err
    assert cse(["run", "train-d2cse"]) == 2
    assert "is not FLOW/DEPLOYMENT" in capsys.readouterr().err


def test_mistakes_are_refused_before_any_flow_run_with_what_to_do(prefect_harness, capsys):
    """Issue 34: a misspelt deployment gets the closest name; a training override key or preset is checked before a
    flow run exists, naming every valid key; malformed JSON is named as such with its column; no server: the URL
    tried and how to start the services; `cse deployments` lists what `cse run` takes."""
    from prefect.client.orchestration import get_client

    from cse.flows.train import train_d2cse

    train_d2cse.to_deployment(name="smoke", parameters={"preset": "smoke"}).apply()

    def created() -> int:
        with get_client(sync_client=True) as client:
            return len(client.read_flow_runs())

    before = created()
    assert cse(["run", "train-d2cse/smok"]) == 2
    assert "not found on the Prefect server" in (err := _err(capsys)) and "(did you mean 'train-d2cse/smoke'?)" in err
    assert cse(["run", "train-d2cse/smoke", "-p", 'overrides={"learning_rat": 0.0001}']) == 2
    err = _err(capsys)
    assert err.startswith("cse: error: ValueError: refused before any flow run was created: unknown TrainConfig key")
    assert "'learning_rat' (did you mean 'learning_rate'?); known: method, preset, backbone" in err
    assert err.rstrip().endswith("nproc_per_node, nnodes")  # the whole list, not cut
    assert cse(["run", "train-d2cse/smoke", "-p", 'overrides={"model": {"prefix_lne": 3}}']) == 2
    assert "unknown D2CSEModelConfig keys ['prefix_lne'] (did you mean 'prefix_len'?)" in _err(capsys)
    assert cse(["run", "train-d2cse/smoke", "-p", "preset=smok"]) == 2
    assert "unknown d2cse preset 'smok' (did you mean 'smoke'?)" in _err(capsys)
    assert cse(["run", "train-d2cse/smoke", "-p", 'overrides={"learning_rate": 0.0001']) == 2
    err = _err(capsys)
    assert "parameter 'overrides': malformed JSON, Expecting ',' delimiter at column 25 of its value" in err
    assert created() == before  # none of these made a flow run

    assert cse(["deployments"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert any(line.startswith("train-d2cse/smoke ") for line in listed), listed

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # nothing answers there
        for args in (["run", "train-d2cse/smoke"], ["deployments"]):
            assert cse(args) == 2
            err = _err(capsys)
            assert err.startswith("cse: error: ServicesDown: no Prefect server answers at http://127.0.0.1:9/api")
            assert "start the services with `bash scripts/services.sh up`" in err


def _err(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]
