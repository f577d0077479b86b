"""Issue 23 item 5: flows started at once on a fresh `$CSE_HOME` all open the MLflow store; its creation and migration
are serialised by a lock (`tracking.runs.prepare_sqlite_store`), so none fails with `duplicate column name` or alembic's
"expected to match one row". Cheap: forked processes that each open the store the way every stage does
(`configure_mlflow`, then a stage run), no training."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest


def _first_run(home: str, barrier, results) -> None:
    os.environ["CSE_HOME"] = home
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        from tracking.runs import stage_run

        barrier.wait(timeout=60)  # all at once
        with stage_run("data", f"first-run-{os.getpid()}"):
            pass
        results.put("ok")
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put(traceback.format_exc()[-2000:])


def _start_at_once(home, n: int) -> list[str]:
    ctx = mp.get_context("fork")  # MLflow and the project are imported once, in this process
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_first_run, args=(str(home), barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    out = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_flows_started_at_once_on_a_fresh_root_all_succeed(n, tmp_path):
    import mlflow  # noqa: F401 - imported before the fork, as a worker's flow run has it

    home = tmp_path / "fresh"  # no mlflow.db yet: the processes create it
    outcomes = _start_at_once(home, n)
    assert outcomes == ["ok"] * n, "\n---\n".join(o for o in outcomes if o != "ok")
    from mlflow import MlflowClient

    runs = MlflowClient(f"sqlite:///{home / 'mlflow.db'}").search_runs(
        [MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_experiment_by_name("data").experiment_id])
    assert len(runs) == n and {r.info.status for r in runs} == {"FINISHED"}
