"""Issue 24: `scripts/services.sh down` stops what it started, `up`/`worker` never start a second worker for the same
pool, and the service logs are appended to with a start marker.

A stand-in replaces the real worker (which needs a Prefect server): a `python` executable first on the PATH (the venv
that scripts/env.sh puts first; the script starts the worker as `python -m cse.ops.worker start`) that ignores
SIGTERM, as a worker stuck in a flow run does, and has a child in a session of its own, as the flow runs the process
worker starts have. Its command line reads `python -m cse.ops.worker start --pool local ...` like the real one's, so
the script's pid check and process scan see it as a worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from cse.storage.settings import REPO_ROOT

STAND_IN = """#!/usr/bin/env bash
# a worker that ignores SIGTERM, with a "flow run" in a session of its own
trap '' TERM
setsid sleep 300 </dev/null >/dev/null 2>&1 &
echo "child $!"
echo "stand-in worker $$ args: $*"
while :; do sleep 0.2; done
"""


def services_sh(env: Mapping[str, str], timeout: float) -> Callable[..., subprocess.CompletedProcess]:
    """`services(*args)`: `scripts/services.sh args` run with the environment `env`, its output captured as text, killed
    past `timeout` seconds."""

    def services(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(REPO_ROOT / "scripts" / "services.sh"), *args],
            env=env,
            text=True,
            capture_output=True,
            timeout=timeout,
        )

    return services


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def _stand_ins(api_url: str, what: str = "") -> list[int]:
    """Processes running with this test's PREFECT_API_URL (whose command line holds `what`)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"PREFECT_API_URL={api_url}".encode() in env and what in args and _alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def test_worker_is_single_and_down_leaves_nothing(tmp_path):
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(STAND_IN)
    (venv_bin / "python").chmod(0o755)
    home = tmp_path / "cse"
    api_url = f"http://127.0.0.1:9/api/services-test-{os.getpid()}"  # nothing answers: the worker needs no server
    env = {
        **os.environ,
        "VIRTUAL_ENV": str(tmp_path / "venv"),
        "CSE_HOME": str(home),
        "PREFECT_API_URL": api_url,
        "CSE_STOP_TIMEOUT": "1",
    }

    services = services_sh(env, timeout=30)

    pidfile = home / "run" / "worker.pid"
    started = services("worker")
    try:
        assert started.returncode == 0, started.stderr
        assert "worker: started" in started.stdout
        pid = int(pidfile.read_text())
        deadline = time.time() + 5
        while not _stand_ins(api_url, "sleep 300") and time.time() < deadline:  # its "flow run" has started
            time.sleep(0.1)
        assert _stand_ins(api_url, "worker start") == [pid] and len(_stand_ins(api_url, "sleep 300")) == 1

        again = services("worker")  # the pid file names a live worker
        assert again.returncode == 0, again.stderr
        assert "already running" in again.stdout and "not starting a second one" in again.stdout
        assert int(pidfile.read_text()) == pid

        pidfile.unlink()  # what the old `down` did while the worker ran on: found by its pool and API all the same
        adopted = services("worker")
        assert adopted.returncode == 0, adopted.stderr
        assert "already running" in adopted.stdout and str(pid) in adopted.stdout
        assert int(pidfile.read_text()) == pid
        assert _stand_ins(api_url, "worker start") == [pid]  # still one worker, no second

        assert "worker: running" in services("status").stdout
        stopped = services("down")
        assert stopped.returncode == 0, stopped.stderr
        assert "worker: stopped (SIGKILL after 1 s)" in stopped.stdout  # it ignored SIGTERM: escalated
        assert "server: not running" in stopped.stdout
        assert _stand_ins(api_url) == []  # neither the worker nor the flow run in its own session is left
        assert not pidfile.exists()
        assert "worker: stopped" in services("status").stdout

        log = (home / "run" / "worker.log").read_text()
        assert log.count("start (pid") == 1 and ": python -m cse.ops.worker start --pool local" in log
        restarted = services("worker")
        assert "worker: started" in restarted.stdout
        deadline = time.time() + 5
        while (home / "run" / "worker.log").read_text().count("stand-in worker") < 2 and time.time() < deadline:
            time.sleep(0.1)
        log = (home / "run" / "worker.log").read_text()
        assert (
            log.count(": python -m cse.ops.worker start --pool local") == 2
        )  # appended: the first start's lines are kept
        assert log.count("stand-in worker") == 2
    finally:
        services("down")
        for p in _stand_ins(api_url):  # never leave a process behind, even when an assertion failed
            os.kill(p, signal.SIGKILL)
    assert _stand_ins(api_url) == []


def _plain(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the project's and Prefect's variables (the shell of a new terminal)."""
    return {k: v for k, v in env.items() if not k.startswith(("CSE_", "PREFECT_", "MLFLOW_"))}


def test_a_new_shell_reads_the_ports_that_up_remembered(tmp_path):
    """Issue 44, item 5: `up` writes the ports into $CSE_HOME/services.env; a new shell's scripts/env.sh takes them
    where the variables are unset (no second server on 4200), and a variable set in the environment still wins."""
    (tmp_path / "services.env").write_text("CSE_PREFECT_PORT=4321\nCSE_MLFLOW_PORT=5123\nCSE_PREFECT_PORT=x\n")
    show = 'source scripts/env.sh; echo "$CSE_PREFECT_PORT $CSE_MLFLOW_PORT $PREFECT_API_URL"'
    env = {**_plain(os.environ), "CSE_HOME": str(tmp_path)}
    said = subprocess.run(["bash", "-c", show], cwd=REPO_ROOT, env=env, text=True, capture_output=True, timeout=30)
    assert said.stdout.split() == ["4321", "5123", "http://127.0.0.1:4321/api"], said.stdout + said.stderr
    env["CSE_MLFLOW_PORT"] = "5999"
    said = subprocess.run(["bash", "-c", show], cwd=REPO_ROOT, env=env, text=True, capture_output=True, timeout=30)
    assert said.stdout.split()[:2] == ["4321", "5999"]
    from cse.storage.settings import get_settings

    os.environ["CSE_HOME"] = str(tmp_path)  # (restored by the isolated_home fixture's monkeypatch)
    assert get_settings().mlflow_ui_url == "http://127.0.0.1:5123"  # the links `cse run` prints


def test_down_stops_a_real_worker_and_server_within_10_s(tmp_path):
    """Issue 44, item 8: `down` stopped the worker only by SIGKILL after 30 s. A real `prefect server start` (started
    as `up` starts it: `setsid … &` in a script) and the real worker of `services.sh worker` now stop in 10 s at most,
    each by its own signal, nothing killed and nothing left."""
    import httpx

    from tests.ports import free_ports

    [port] = free_ports(1, exclude=frozenset({4200, 5000}))
    home = tmp_path / "cse"
    env = {
        **_plain(os.environ),
        "PYTHONPATH": str(REPO_ROOT),
        "VIRTUAL_ENV": str(Path(sys.executable).parent.parent),
        "CSE_HOME": str(home),
        "CSE_PREFECT_PORT": str(port),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "CSE_WORKER_POOL": "down-test",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    api = f"http://127.0.0.1:{port}/api"
    start_server = (  # (the lines of `up` that start the server)
        'source scripts/env.sh; mkdir -p "$CSE_HOME/run"; '
        'setsid prefect server start --host 127.0.0.1 --port "$CSE_PREFECT_PORT" >>"$CSE_HOME/run/server.log" 2>&1 '
        '</dev/null & echo $! >"$CSE_HOME/run/server.pid"'
    )
    subprocess.run(["bash", "-c", start_server], cwd=REPO_ROOT, env=env, check=True, timeout=30)
    services = services_sh({**env, "PREFECT_API_URL": api}, timeout=120)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        created = httpx.post(f"{api}/work_pools/", json={"name": "down-test", "type": "process"}, timeout=30)
        assert created.status_code in (201, 409), created.text
        assert "worker: started" in services("worker").stdout
        log = home / "run" / "worker.log"
        deadline = time.monotonic() + 120
        while "started!" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "started!" in log.read_text(), log.read_text()[-2000:]
        t0 = time.monotonic()
        stopped = services("down")
        took = time.monotonic() - t0
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert "worker: stopped (SIGINT)" in stopped.stdout and "server: stopped (SIGTERM)" in stopped.stdout, (
            stopped.stdout
        )
        assert took <= 10, f"down took {took:.1f} s"
        assert _stand_ins(api) == []
    finally:
        services("down")
        for p in _stand_ins(api):
            os.kill(p, signal.SIGKILL)
