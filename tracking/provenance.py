"""Where a run came from: the git commit of the code and the Prefect flow run that started it (run tags)."""

from __future__ import annotations

import subprocess

from cse.storage.settings import REPO_ROOT


def git_commit() -> str:
    """The git commit of the repository checkout, or `unknown` when git cannot tell."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def prefect_flow_run_id() -> str | None:
    """The id of the current Prefect flow run, or `None` outside a flow run."""
    from prefect.runtime import flow_run

    return flow_run.get_id()  # None outside a flow run (its context, or PREFECT__FLOW_RUN_ID, is absent)
