"""The team stack end to end (scripts/team.sh): PostgreSQL on loopback, the Prefect server and the MLflow tracking
server on it (MLflow with a folder artifact store), two process workers; a smoke sweep dispatched as deployment
runs fans out to both workers.

Checks: every child flow run COMPLETED; both workers trained children (the MLflow tag `worker`, from
CSE_WORKER_NAME; three children, so that with the parent holding one of its worker's two slots neither worker can
take them all); MLflow holds the parent and its children (nested by `mlflow.parentRunId`); both servers really
store in PostgreSQL; the servers listen on 127.0.0.1 only; the password file is private; each worker got its GPU
set and its own GPU concurrency limit (CSE_WORKER_GPUS; on this CPU machine the devices are only named).

A worker killed during training (SIGKILL to every process of both workers, the flow-run process included, at the
job's first resume state, well before its last step; the servers stay): the flow run ends CRASHED (missed
heartbeats, the automation of ops/automations.py), `team.sh up` (CSE_TEAM_SERVICES=workers, as on a GPU host)
starts the workers again, and running the deployment again resumes the job from that checkpoint in the same
MLflow run and trains it to its last step. The automation needs a minute without heartbeats (Prefect's shortest
heartbeat period, 30 s, times CSE_MISSED_HEARTBEATS=2, the least ops/automations.py accepts); the workers'
restart and the sweep's checks run during that minute, and the run stays RUNNING until CRASHED. The kill comes
after the sweep, not during it: an automation firing while PostgreSQL restarts would fail its action for good
(Prefect does not retry a failed action), leaving the run RUNNING.

PostgreSQL is restarted (`team.sh restart-postgres`) as soon as the first child has completed: the sweep either
goes on to the end or fails with an error, and then a second run of the same sweep completes; either way no
finished child is trained again (every child's `train_seconds` was logged once) and MLflow holds one parent and
one run per child. Everything the stack
started is stopped in `finally` (team.sh down, then any survivor of the recorded process trees is killed and
the test fails). Ports are free loopback ports (never 4200 or 5000); PREFECT_HOME, PREFECT_API_URL, CSE_HOME and
MLFLOW_TRACKING_URI are this test's own. A few minutes on 2 CPU cores (it prints the time of each phase).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import mlflow
import psutil
import pytest

from cse.storage.settings import REPO_ROOT
from tests.loops import heads_ingest
from tests.ports import free_ports

pytestmark = pytest.mark.slow

TEAM_SH = REPO_ROOT / "scripts" / "team.sh"
WORKERS = ("cse-team-w1", "cse-team-w2")
GPU_SETS = ("0", "1,2")  # CSE_WORKER_GPUS: one GPU for the first worker, two for the second
RESERVED_PORTS = frozenset({4200, 5000})  # another Prefect / MLflow may use the defaults on this machine
# three children: the sweep's parent holds one of its worker's two flow-run slots (CSE_WORKER_LIMIT=2), so the
# other worker can take at most two children at once and the third always goes to the parent's worker
GRID = [0.01, 0.02, 0.03]
# the training job whose worker is killed at its first resume state (every CHECKPOINT_STEPS): one epoch of
# KILL_JOB_STEPS batches of 4 sentences (the sweep's 64 sentences in batches of 32 are 2 steps), so that it is
# killed mid-training, not after its last step
KILL_JOB_STEPS, CHECKPOINT_STEPS, KILL_JOB_BATCH = 24, 4, 4
UP_TIMEOUT, SWEEP_TIMEOUT = 300, 480


class TeamStack:
    """scripts/team.sh in a temporary home, with every process it starts tracked for the teardown."""

    def __init__(self, env: dict[str, str]):
        self.env, self.pgdata = env, Path(env["CSE_PG_DATA"])
        self.run_dir = Path(env["CSE_TEAM_HOME"]) / "run"
        self.log: list[str] = []

    def sh(self, action: str, timeout: float, services: str | None = None) -> subprocess.CompletedProcess:
        """`team.sh ACTION`, for the services named (CSE_TEAM_SERVICES; None: all of them)."""
        env = self.env if services is None else {**self.env, "CSE_TEAM_SERVICES": services}
        p = subprocess.run(
            ["bash", str(TEAM_SH), action],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
        self.log.append(f"$ team.sh {action} ({services or 'all'}) → {p.returncode}\n{p.stdout}{p.stderr}")
        return p

    def roots(self, pattern: str = "*") -> list[psutil.Process]:
        """The live processes team.sh recorded (pid files `<pattern>.pid`) and, for every pattern, the postmaster."""
        out = []
        for f in self.run_dir.glob(f"{pattern}.pid"):
            pid, start = f.read_text().split()
            with contextlib.suppress(psutil.Error, OSError):
                p = psutil.Process(int(pid))
                if _start_ticks(p.pid) == start:
                    out.append(p)
        pm = self.pgdata / "postmaster.pid"
        if pattern == "*" and pm.exists():
            with contextlib.suppress(psutil.Error, ValueError, IndexError):
                out.append(psutil.Process(int(pm.read_text().split()[0])))
        return out

    def workers(self) -> list[psutil.Process]:
        """The live worker processes team.sh started (pid files `worker-<name>.pid`)."""
        return self.roots("worker-*")

    def processes(self) -> list[psutil.Process]:
        return list({p.pid: p for root in self.roots() for p in [root, *_children(root)]}.values())

    def down(self) -> list[str]:
        """Stop everything; returns what had to be killed after `team.sh down` (should be nothing)."""
        started = self.processes()
        try:
            self.sh("down", timeout=240)
        except subprocess.TimeoutExpired:
            self.log.append("team.sh down timed out")
        survivors = [p for p in started if _alive(p)]
        _sigkill(survivors)
        return [f"{p.pid} {_cmd(p)}" for p in survivors]


def _start_ticks(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _children(p: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return p.children(recursive=True)
    return []


def _alive(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    return False


def _cmd(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(p.cmdline())[:160]
    return "?"


def _listening(procs: list[psutil.Process]) -> set[str]:
    addrs = set()
    for p in procs:
        with contextlib.suppress(psutil.Error):
            addrs |= {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    return addrs


def _api(api: str, path: str, body: dict | None = None):
    """The Prefect API's answer to a POST of `body` to `path` (a GET without a body)."""
    url = f"{api}/{path}"
    r = httpx.get(url, timeout=30) if body is None else httpx.post(url, json=body, timeout=30)
    r.raise_for_status()
    return r.json()


def _child_flow_runs(api: str) -> list[dict]:
    return _api(api, "flow_runs/filter", {"flow_runs": {"tags": {"all_": ["child"]}}, "limit": 200})


def _gpu_limits(api: str) -> dict[str, int]:
    limits = _api(api, "v2/concurrency_limits/filter", {"limit": 200})
    return {c["name"]: c["limit"] for c in limits if c["name"].startswith("gpu")}


class PostgresRestart(threading.Thread):
    """Restarts PostgreSQL through team.sh once the first child flow run is COMPLETED; records which children had
    completed by then and the restart's result."""

    def __init__(self, stack: TeamStack, api: str):
        super().__init__(daemon=True)
        self.stack, self.api = stack, api
        self.stop = threading.Event()
        self.completed_before: set[str] = set()
        self.result: subprocess.CompletedProcess | None = None

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                done = [c for c in _child_flow_runs(self.api) if c["state_type"] == "COMPLETED"]
            except httpx.HTTPError:
                continue
            if done:
                self.completed_before = {c["parameters"]["tags"]["cse.child"] for c in done}
                self.result = self.stack.sh("restart-postgres", timeout=240)
                return


def _flow_run(api: str, flow_run_id: str) -> dict:
    return _api(api, f"flow_runs/{flow_run_id}")


def _spool_lines(run_dir: str | None) -> str:
    """What a job's outage spool still holds (for a failure message): its line count, or why none."""
    if not run_dir:
        return "no run_dir tag"
    spool = sorted(Path(run_dir).glob("**/*spool*"))
    return ", ".join(f"{f.name}: {len(f.read_text().splitlines())} lines" for f in spool if f.is_file()) or "empty"


FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _final(api: str, flow_run_id: str, timeout: float) -> dict:
    """The flow run once it is in a final state. Polled here rather than watched by `prefect deployment run
    --watch`: the CLI's watch exits with an error when one of its requests meets the server while PostgreSQL
    restarts, even though the flow run goes on (seen once); an HTTP error here is retried until the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            run = _flow_run(api, flow_run_id)
            if run["state_type"] in FINAL:
                return run
        assert time.monotonic() < deadline, f"flow run {flow_run_id} not final within {timeout} s"
        time.sleep(1)


def _flow_run_id(cli_stdout: str) -> str:
    """The UUID `prefect deployment run` prints."""
    return next(line.split("UUID:")[1].strip() for line in cli_stdout.splitlines() if "UUID:" in line)


def _kill_workers(stack: TeamStack) -> list[int]:
    """SIGKILL every worker process and its descendants (flow runs), as a lost machine would (the servers stay)."""
    victims = [p for root in stack.workers() for p in [root, *_children(root)]]
    _sigkill(victims)
    return [p.pid for p in victims]


def _sigkill(processes: list[psutil.Process]) -> None:
    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(processes, timeout=20)


def _pg_count(port: int, password: str, db: str, sql: str) -> int:
    import psycopg

    with psycopg.connect(
        host="127.0.0.1", port=port, user="cse", password=password, dbname=db, connect_timeout=10
    ) as con:
        return con.execute(sql).fetchone()[0]


@pytest.fixture
def team_env(tmp_path, tiny_bert_dir, shared_data):
    """Environment for team.sh: temp homes, free loopback ports, no inherited Prefect/MLflow/CSE settings."""
    # postgres refuses to run as root: as root team.sh runs it as OS user `postgres`, which must reach the data
    # folder, so the folder lives directly under the system temp folder (pytest's tmp_path is private to root)
    pgdata = Path(tempfile.mkdtemp(prefix="cse-team-pg-"))
    pg, prefect_port, mlflow_port = free_ports(3, exclude=RESERVED_PORTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CSE_", "CUDA_VISIBLE"))}
    env.update(
        {
            "VIRTUAL_ENV": str(Path(sys.executable).parent.parent),
            "CSE_HOME": str(tmp_path / "cse"),
            "CSE_TEAM_HOME": str(tmp_path / "team"),
            "CSE_PG_DATA": str(pgdata),
            "CSE_PG_PORT": str(pg),
            "CSE_PREFECT_PORT": str(prefect_port),
            "CSE_MLFLOW_PORT": str(mlflow_port),
            "CSE_MLFLOW_WORKERS": "1",
            # the deployments this test runs (the sweep's children run on train-d2cse/default), not all 53
            "CSE_DEPLOYMENTS": "sweep/smoke train-d2cse/default train-d2cse/smoke",
            # Prefect's worker ignores SIGTERM for about 30 s; `down` escalates to SIGKILL after this grace period
            "CSE_STOP_TIMEOUT": "2",
            "CSE_WORKER_NAMES": " ".join(WORKERS),
            "CSE_WORKER_LIMIT": "2",
            "CSE_WORKER_GPUS": " ".join(GPU_SETS),
            "CSE_SOURCE_MIRROR": "",
            "CSE_START_TIMEOUT": "240",
            "CSE_MISSED_HEARTBEATS": "2",  # the killed worker's run is CRASHED after 60 s without a heartbeat (default 90 s)
            "PREFECT_HOME": str(tmp_path / "prefect"),
            "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            # plain http on loopback, nothing to verify: without this every Prefect client (hundreds per process)
            # parses certifi's CA bundle (~50 ms each; a fifth of `prefect deploy --all`)
            "PREFECT_API_TLS_INSECURE_SKIP_VERIFY": "true",
            "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    yield env
    shutil.rmtree(pgdata, ignore_errors=True)


def test_team_stack_sweep_fans_out_to_two_workers(team_env, tiny_bert_dir, wiki_head, senteval_head):
    env = team_env
    stack = TeamStack(env)
    api, tracking = env["PREFECT_API_URL"], f"http://127.0.0.1:{env['CSE_MLFLOW_PORT']}"
    prefect = str(Path(env["VIRTUAL_ENV"]) / "bin" / "prefect")
    # the heads of the real data: 512 Wiki1M lines (the corruption stage reads all of it; training uses 64) and every
    # SentEval file cut to 24 lines (the dev score needs only a few pairs)
    overrides = {
        "backbone": str(tiny_bert_dir),
        "max_steps": 2,
        "eval_steps": 2,
        "log_steps": 1,
        "max_train_sentences": 64,
        "test_evaluation": False,
        "ingest": heads_ingest(wiki_head, senteval_head),
    }
    params = {"strategy": "grid", "grid": {"learning_rate": GRID}, "overrides": overrides, "dispatch": "deployment"}

    def deployment_run(name: str, parameters: dict) -> str:
        """`prefect deployment run NAME` (not watched); the flow run's id."""
        p = subprocess.run(
            [prefect, "deployment", "run", name, "--params", json.dumps(parameters)],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        return _flow_run_id(p.stdout)

    t0 = time.monotonic()
    survivors: list[str] = []
    try:
        up = stack.sh("up", timeout=UP_TIMEOUT)
        assert up.returncode == 0, "\n".join(stack.log)
        t_up = time.monotonic() - t0

        # everything started listens on loopback only (postgres, Prefect, MLflow); the generated password is private
        listening = _listening(stack.processes())
        assert listening == {"127.0.0.1"}, listening
        pw_file = Path(env["CSE_TEAM_HOME"]) / "secrets" / "pg_password"
        assert pw_file.stat().st_mode & 0o777 == 0o600
        password = pw_file.read_text().strip()

        # each worker has its GPU set's concurrency limit, one slot per GPU
        assert {f"gpu-{w}": len(g.split(",")) for w, g in zip(WORKERS, GPU_SETS)}.items() <= _gpu_limits(api).items()

        # the sweep, with PostgreSQL restarted as soon as its first child has completed
        restart = PostgresRestart(stack, api)
        restart.start()
        t_sweep0 = time.monotonic()
        sweep_run = _final(api, deployment_run("sweep/smoke", params), SWEEP_TIMEOUT)
        restart.stop.set()
        restart.join(timeout=300)
        logs = {w: stack.run_dir / f"worker-{w}.log" for w in WORKERS}
        tail = "\n".join(f"--- {w}\n" + p.read_text()[-4000:] for w, p in logs.items() if p.exists())
        assert restart.result is not None and restart.result.returncode == 0, "\n".join(stack.log) + tail
        assert restart.completed_before, "PostgreSQL was not restarted during the sweep"
        survived = sweep_run["state_type"] == "COMPLETED"
        if not survived:  # failed with an error: the same sweep again finishes what is left
            message = (sweep_run.get("state") or {}).get("message")
            print(f"sweep {sweep_run['state_type']} after the PostgreSQL restart: {message}")
            assert sweep_run["state_type"] in {"FAILED", "CRASHED"} and message, sweep_run.get("state")
            sweep_run = _final(api, deployment_run("sweep/smoke", params), SWEEP_TIMEOUT)
        t_sweep = time.monotonic() - t_sweep0
        assert sweep_run["state_type"] == "COMPLETED", f"{sweep_run.get('state')}\n{tail}"

        # then a worker killed mid-training; the sweep's results are checked while its heartbeats are missed
        t_kill = time.monotonic()
        runs_dir = Path(env["CSE_HOME"]) / "runs" / "d2cse"
        before = set(runs_dir.iterdir()) if runs_dir.is_dir() else set()
        job = {
            **overrides,
            "max_steps": KILL_JOB_STEPS,
            "max_train_sentences": KILL_JOB_STEPS * KILL_JOB_BATCH,
            "batch_size": KILL_JOB_BATCH,
            "eval_steps": KILL_JOB_STEPS,
            "checkpoint_steps": CHECKPOINT_STEPS,
            "learning_rate": 0.05,
        }
        job_params = {"preset": "smoke", "overrides": job}
        job_run = deployment_run("train-d2cse/smoke", job_params)
        deadline = time.monotonic() + 300
        while not (runs_dir.is_dir() and any((d / "state").is_dir() for d in set(runs_dir.iterdir()) - before)):
            assert time.monotonic() < deadline, "no checkpoint of the job within 300 s"
            assert _flow_run(api, job_run)["state_type"] in {"SCHEDULED", "PENDING", "RUNNING"}, _flow_run(api, job_run)
            time.sleep(0.2)
        killed = _kill_workers(stack)
        assert killed
        assert _flow_run(api, job_run)["state_type"] == "RUNNING"  # killed mid-training: nobody is left to report
        assert not stack.workers(), [_cmd(p) for p in stack.workers()]
        up = stack.sh("up", timeout=UP_TIMEOUT, services="workers")  # starts the killed workers again
        assert up.returncode == 0, "\n".join(stack.log)
        assert len(stack.workers()) == len(WORKERS), "\n".join(stack.log)
        t_reup = time.monotonic() - t_kill

        # every child completed (in the last sweep run)
        children = _child_flow_runs(api)
        last = {c["parameters"]["tags"]["cse.child"]: c for c in sorted(children, key=lambda c: c["created"])}
        assert len(last) == len(GRID) and (len(children) == len(GRID) or not survived), [c["name"] for c in children]
        assert {c["state_type"] for c in last.values()} == {"COMPLETED"}, [
            (c["name"], c["state_type"], (c.get("state") or {}).get("message")) for c in children
        ] + [tail]

        # MLflow (the tracking server on PostgreSQL) holds the parent and its children, trained on both workers
        client = mlflow.MlflowClient(tracking_uri=tracking)
        exp = client.get_experiment_by_name("d2cse")
        parents = client.search_runs([exp.experiment_id], "tags.`cse.parent` = 'true' and tags.`cse.kind` = 'sweep'")
        assert len(parents) == 1
        parent = parents[0]
        kids = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
        assert sorted(k.data.tags["cse.child"] for k in kids) == sorted(f"learning_rate={lr}" for lr in GRID)
        unfinished = [
            f"{k.data.tags.get('cse.child')}: {k.info.status}, metrics {sorted(k.data.metrics)}, "
            f"registry error {k.data.tags.get('cse.registry_error')}, spool {_spool_lines(k.data.tags.get('run_dir'))}"
            for k in kids
            if k.info.status != "FINISHED" or "best_stsb_dev" not in k.data.metrics
        ]
        assert not unfinished, "\n".join(unfinished) + "\n" + tail
        # no child was trained twice, in particular none that had finished before the restart
        trained = {
            k.data.tags["cse.child"]: len(client.get_metric_history(k.info.run_id, "train_seconds")) for k in kids
        }
        assert set(trained.values()) == {1}, (trained, restart.completed_before)
        workers = {k.data.tags.get("worker") for k in kids}
        assert workers == set(WORKERS), workers
        assert parent.data.metrics["best_stsb_dev"] == max(k.data.metrics["best_stsb_dev"] for k in kids)
        assert {"sweep.md", "sweep.json"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}

        # ... and both servers really store in PostgreSQL
        port = int(env["CSE_PG_PORT"])
        assert _pg_count(port, password, "mlflow", "SELECT count(*) FROM runs") >= 1 + len(GRID)
        assert _pg_count(
            port, password, "prefect", "SELECT count(*) FROM flow_run WHERE state_type = 'COMPLETED'"
        ) >= 1 + len(GRID)

        # the killed worker's run: RUNNING until the automation marks it CRASHED (missed heartbeats)
        while (state := _flow_run(api, job_run))["state_type"] != "CRASHED":
            assert state["state_type"] == "RUNNING" and time.monotonic() < deadline + 300, state.get("state")
            time.sleep(1)
        t_crashed = time.monotonic() - t_kill
        assert "heartbeat" in (state.get("state") or {}).get("message", ""), state.get("state")

        # running the deployment again resumes the killed job from its last checkpoint, in the same MLflow run
        t_rerun0 = time.monotonic()
        rerun = _final(api, deployment_run("train-d2cse/smoke", job_params), SWEEP_TIMEOUT)
        assert rerun["state_type"] == "COMPLETED", rerun.get("state")
        t_rerun = time.monotonic() - t_rerun0
        jobs = client.search_runs([exp.experiment_id], f"params.max_steps = '{KILL_JOB_STEPS}'")
        assert len(jobs) == 1 and jobs[0].info.status == "FINISHED", [(j.info.run_id, j.info.status) for j in jobs]
        resumed = int(jobs[0].data.tags["resumed_from_step"])
        assert 0 < resumed < KILL_JOB_STEPS  # from the checkpoint written before the kill, not from scratch or the end
        # ... and trained on to its last step
        assert [m.step for m in client.get_metric_history(jobs[0].info.run_id, "train_seconds")] == [KILL_JOB_STEPS]
        assert jobs[0].data.tags["prefect_flow_run_id"] == job_run  # the killed run's MLflow run, continued

        print(
            f"team stack up in {t_up:.0f}s; sweep of {len(GRID)} children in {t_sweep:.0f}s on {sorted(workers)}; "
            f"PostgreSQL restarted after {sorted(restart.completed_before)}, sweep "
            f"{'went on' if survived else 'failed and was rerun'}; job killed at its first checkpoint and workers up "
            f"again in {t_reup:.0f}s; killed worker's run CRASHED after {t_crashed:.0f}s, rerun resumed from step "
            f"{resumed} in {t_rerun:.0f}s"
        )
    finally:
        survivors = stack.down()
        print("\n".join(stack.log)[-3000:])
    assert not survivors, f"still running after team.sh down (killed now): {survivors}"
    assert not stack.processes(), "team.sh down left processes behind"
