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
