"""The team stack end to end (scripts/team.sh): PostgreSQL on loopback, the Prefect server and the MLflow tracking
server on it (MLflow with a folder artifact store), two process workers; a smoke sweep dispatched as deployment
runs fans out to both workers.

Checks: every child flow run COMPLETED; both workers trained children (the MLflow tag `worker`, from
CSE_WORKER_NAME); MLflow holds the parent and its children (nested by `mlflow.parentRunId`); both servers really
store in PostgreSQL; the servers listen on 127.0.0.1 only; the password file is private. Everything the stack
started is stopped in `finally` (team.sh down, then any survivor of the recorded process trees is killed and
the test fails). Ports are free loopback ports (never 4200 or 5000); PREFECT_HOME, PREFECT_API_URL, CSE_HOME and
MLFLOW_TRACKING_URI are this test's own. A few minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import mlflow
import psutil
import pytest

from config.settings import REPO_ROOT

pytestmark = pytest.mark.slow

TEAM_SH = REPO_ROOT / "scripts" / "team.sh"
WORKERS = ("cse-team-w1", "cse-team-w2")
RESERVED_PORTS = {4200, 5000}  # another Prefect / MLflow may use the defaults on this machine
GRID = [0.01, 0.02, 0.03, 0.04]  # four children
UP_TIMEOUT, SWEEP_TIMEOUT = 300, 480


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together while choosing, so they differ)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            if (p := s.getsockname()[1]) not in RESERVED_PORTS:
                ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports


class TeamStack:
    """scripts/team.sh in a temporary home, with every process it starts tracked for the teardown."""

    def __init__(self, home: Path, pgdata: Path, env: dict[str, str]):
        self.home, self.pgdata, self.env = home, pgdata, env
        self.run_dir = Path(env["CSE_TEAM_HOME"]) / "run"
        self.log: list[str] = []

    def sh(self, action: str, timeout: float) -> subprocess.CompletedProcess:
        p = subprocess.run(["bash", str(TEAM_SH), action], cwd=REPO_ROOT, env=self.env, capture_output=True, text=True,
                           timeout=timeout, start_new_session=True)
        self.log.append(f"$ team.sh {action} → {p.returncode}\n{p.stdout}{p.stderr}")
        return p

    def roots(self) -> list[psutil.Process]:
        """The processes team.sh recorded (pid files) and the postmaster."""
        pids = []
        for f in self.run_dir.glob("*.pid"):
            pid, start = f.read_text().split()
            pids.append((int(pid), start))
        out = []
        for pid, start in pids:
            try:
                p = psutil.Process(pid)
                if str(_start_ticks(pid)) == start:
                    out.append(p)
            except (psutil.Error, OSError):
                pass
        pm = self.pgdata / "postmaster.pid"
        if pm.exists():
            try:
                out.append(psutil.Process(int(pm.read_text().split()[0])))
            except (psutil.Error, ValueError, IndexError):
                pass
        return out

    def processes(self) -> list[psutil.Process]:
        seen: dict[int, psutil.Process] = {}
        for root in self.roots():
            for p in [root, *_children(root)]:
                seen[p.pid] = p
        return list(seen.values())

    def down(self) -> list[str]:
        """Stop everything; returns what had to be killed after `team.sh down` (should be nothing)."""
        started = self.processes()
        try:
            self.sh("down", timeout=240)
        except subprocess.TimeoutExpired:
            self.log.append("team.sh down timed out")
        survivors = [p for p in started if _alive(p)]
        for p in survivors:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        psutil.wait_procs(survivors, timeout=10)
        return [f"{p.pid} {_cmd(p)}" for p in survivors]


def _start_ticks(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:160]
    except psutil.Error:
        return "?"


def _listening(procs: list[psutil.Process]) -> set[str]:
    addrs = set()
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        addrs |= {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}
    return addrs


def _child_flow_runs(api: str) -> list[dict]:
    body = {"flow_runs": {"tags": {"all_": ["child"]}}, "limit": 200}
    r = httpx.post(f"{api}/flow_runs/filter", json=body, timeout=30)
    r.raise_for_status()
    return r.json()


def _pg_count(port: int, password: str, db: str, sql: str) -> int:
    import psycopg

    with psycopg.connect(host="127.0.0.1", port=port, user="cse", password=password, dbname=db, connect_timeout=10) as con:
        return con.execute(sql).fetchone()[0]


@pytest.fixture
def team_env(tmp_path, tiny_bert_dir, shared_data):
    """Environment for team.sh: temp homes, free loopback ports, no inherited Prefect/MLflow/CSE settings."""
    # postgres refuses to run as root: as root team.sh runs it as OS user `postgres`, which must reach the data
    # folder, so the folder lives directly under the system temp folder (pytest's tmp_path is private to root)
    pgdata = Path(tempfile.mkdtemp(prefix="cse-team-pg-"))
    pg, prefect_port, mlflow_port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CSE_", "CUDA_VISIBLE"))}
    env.update({
        "VIRTUAL_ENV": str(Path(sys.executable).parent.parent),
        "CSE_HOME": str(tmp_path / "cse"), "CSE_TEAM_HOME": str(tmp_path / "team"), "CSE_PG_DATA": str(pgdata),
        "CSE_PG_PORT": str(pg), "CSE_PREFECT_PORT": str(prefect_port), "CSE_MLFLOW_PORT": str(mlflow_port),
        "CSE_MLFLOW_WORKERS": "1", "CSE_WORKER_NAMES": " ".join(WORKERS), "CSE_WORKER_LIMIT": "2",
        "CSE_SOURCE_MIRROR": "", "CSE_START_TIMEOUT": "240",
        "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        "PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "3",
        "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    })
    yield env
    shutil.rmtree(pgdata, ignore_errors=True)


def test_team_stack_sweep_fans_out_to_two_workers(team_env, tmp_path, tiny_bert_dir, shared_data):
    env = team_env
    stack = TeamStack(tmp_path, Path(env["CSE_PG_DATA"]), env)
    api, tracking = env["PREFECT_API_URL"], f"http://127.0.0.1:{env['CSE_MLFLOW_PORT']}"
    # the real Wiki1M sample, cut to its first 512 lines (the corruption stage reads all of it; training uses 64)
    wiki = tmp_path / "wiki1m_head_512.txt"
    with open(shared_data / "wiki1m_head.txt", encoding="utf-8") as f:
        wiki.write_text("".join(line for _, line in zip(range(512), f)), encoding="utf-8")
    overrides = {
        "backbone": str(tiny_bert_dir), "max_steps": 2, "eval_steps": 2, "log_steps": 1, "max_train_sentences": 64,
        "test_evaluation": False,
        "ingest": {"datasets": ["wiki1m", "sts"], "wiki": {"path": str(wiki)},
                   "senteval": {"path": str(shared_data / "senteval")}},
    }
    params = {"strategy": "grid", "grid": {"learning_rate": GRID}, "overrides": overrides, "dispatch": "deployment"}
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

        run = subprocess.run(
            [str(Path(env["VIRTUAL_ENV"]) / "bin" / "prefect"), "deployment", "run", "sweep/smoke", "--params", json.dumps(params),
             "--watch", "--watch-timeout", str(SWEEP_TIMEOUT)],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=SWEEP_TIMEOUT + 60)
        t_sweep = time.monotonic() - t0 - t_up
        logs = {w: (Path(env["CSE_TEAM_HOME"]) / "run" / f"worker-{w}.log") for w in WORKERS}
        tail = "\n".join(f"--- {w}\n" + p.read_text()[-4000:] for w, p in logs.items() if p.exists())
        assert run.returncode == 0 and "Completed" in run.stdout, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{tail}"

        # every child flow run completed
        children = _child_flow_runs(api)
        assert len(children) == len(GRID), [c["name"] for c in children]
        assert {c["state_type"] for c in children} == {"COMPLETED"}, \
            [(c["name"], c["state_type"], (c.get("state") or {}).get("message")) for c in children] + [tail]

        # MLflow (the tracking server on PostgreSQL) holds the parent and its children, trained on both workers
        client = mlflow.MlflowClient(tracking_uri=tracking)
        exp = client.get_experiment_by_name("d2cse")
        parents = client.search_runs([exp.experiment_id], "tags.`cse.parent` = 'true' and tags.`cse.kind` = 'sweep'")
        assert len(parents) == 1
        parent = parents[0]
        kids = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
        assert sorted(k.data.tags["cse.child"] for k in kids) == sorted(f"learning_rate={lr}" for lr in GRID)
        assert all(k.info.status == "FINISHED" and "best_stsb_dev" in k.data.metrics for k in kids)
        workers = {k.data.tags.get("worker") for k in kids}
        assert workers == set(WORKERS), workers
        assert parent.data.metrics["best_stsb_dev"] == max(k.data.metrics["best_stsb_dev"] for k in kids)
        assert {"sweep.md", "sweep.json"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}

        # ... and both servers really store in PostgreSQL
        port = int(env["CSE_PG_PORT"])
        assert _pg_count(port, password, "mlflow", "SELECT count(*) FROM runs") >= 1 + len(GRID)
        assert _pg_count(port, password, "prefect", "SELECT count(*) FROM flow_run WHERE state_type = 'COMPLETED'") \
            >= 1 + len(GRID)
        print(f"team stack up in {t_up:.0f}s, sweep of {len(GRID)} children in {t_sweep:.0f}s on {sorted(workers)}")
    finally:
        survivors = stack.down()
        print("\n".join(stack.log)[-3000:])
    assert not survivors, f"still running after team.sh down (killed now): {survivors}"
    assert not stack.processes(), "team.sh down left processes behind"
