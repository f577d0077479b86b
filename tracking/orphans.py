"""Stage runs left RUNNING by a killed process: each stage run records its owner process (`OWNER_TAG`), and the next
run of the same stage closes those whose owner is gone as KILLED (`close_orphaned_runs`, called by
`cse.tracking.stage_runs.stage_run`)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException

from cse.storage.secrets import redact

log = logging.getLogger(__name__)


OWNER_TAG = "cse.owner"  # host:pid:process start time of the process running a stage run
ORPHAN_TAG = "cse.orphaned"  # on a stage run closed as KILLED because its process is gone


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot, /proc/<pid>/stat field 22); None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def process_owner() -> str:
    """This process as a stage run's owner: `host:pid:start` (the start time tells a reused pid apart)."""
    return f"{socket.gethostname()}:{os.getpid()}:{_process_start(os.getpid()) or '?'}"


def owner_alive(owner: str) -> bool | None:
    """Whether the process named by an `owner` tag still runs; None when it ran on another machine (unknown)."""
    host, _, rest = owner.partition(":")
    pid, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    found = _process_start(int(pid))
    return found is not None and (start in ("", "?") or found == start)


def close_orphaned_runs(experiment_id: str, run_name: str, closed_by: str | None = None) -> list[str]:
    """Mark KILLED the RUNNING runs named `run_name` whose owner process (same machine) is dead: a stage killed
    with SIGKILL cannot end its own run. Runs of live processes, and of other machines, are left alone.
    Returns the ids of the runs closed."""
    client = mlflow.MlflowClient()
    try:
        runs = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=500)
    except MlflowException as e:
        log.warning("could not look for orphaned %s runs: %s", run_name, redact(e))
        return []
    closed = []
    for r in runs:
        owner = r.data.tags.get(OWNER_TAG)
        if r.info.run_name != run_name or owner is None or owner_alive(owner) is not False:
            continue
        client.set_tag(
            r.info.run_id,
            ORPHAN_TAG,
            f"process {owner} is gone (killed); closed" + (f" by run {closed_by}" if closed_by else ""),
        )
        client.set_terminated(r.info.run_id, status="KILLED")
        closed.append(r.info.run_id)
    if closed:
        log.warning(
            "marked %d orphaned %s run(s) KILLED (their process was killed): %s",
            len(closed),
            run_name,
            ", ".join(closed),
        )
    return closed
