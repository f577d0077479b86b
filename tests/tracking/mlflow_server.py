"""A real MLflow tracking server for the tests that need one (test_mlflow_outage.py, test_mlflow_pages_browser.py):
MLflow's server app (`mlflow.server.fastapi_app:app`, what `mlflow server` starts) under uvicorn in one process (half
the start-up of `mlflow server`, which imports MLflow twice: its CLI, then uvicorn's worker), on a free port, in its
own process group so that it can be killed as in a crash and started again on the same port and store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.ports import free_ports, port_open


class MlflowServer:
    """The server of the store `store_uri` (artifacts under `root/artifacts`, its output in `root/server.log`; the
    job-execution runner is switched off: it only costs start-up time here)."""

    def __init__(self, store_uri: str, root: Path):
        self.store_uri, self.root, self.port = store_uri, root, free_ports()[0]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = root / "server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None

    def launch(self) -> None:
        """Start the server process, without waiting for it to answer (`wait_healthy`)."""
        assert not port_open(self.port), f"port {self.port} is taken"
        env = {
            **os.environ,
            "_MLFLOW_SERVER_FILE_STORE": self.store_uri,  # mlflow.server.constants.BACKEND_STORE_URI_ENV_VAR
            "_MLFLOW_SERVER_ARTIFACT_ROOT": str(self.root / "artifacts"),  # ... ARTIFACT_ROOT_ENV_VAR
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        cmd = [sys.executable, "-m", "uvicorn", "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*cmd, "mlflow.server.fastapi_app:app"],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )

    def wait_healthy(self, timeout: float = 120) -> None:
        """Wait until /health answers; a failure (with the server's output) when it exits or does not answer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                pytest.fail(f"the MLflow server exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"the MLflow server was not healthy after {timeout}s: {self.log.read_text()[-3000:]}")

    def start(self) -> None:
        self.launch()
        self.wait_healthy()

    def stop(self) -> None:
        """Kill the whole process group (SIGKILL: the server dies as in a crash) and wait until the port is closed."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None
        deadline = time.monotonic() + 10
        while port_open(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not port_open(self.port), "the killed server still answers"
