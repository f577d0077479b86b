"""MLflow at the seams: every stage run is an MLflow run, and a failing stage ends it FAILED.

Nothing else in the project imports mlflow directly for run management.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import mlflow

from config.settings import REPO_ROOT, get_settings

log = logging.getLogger(__name__)

_MAX_PARAM_LEN = 6000


def configure_mlflow() -> str:
    """Point MLflow at the configured tracking store; returns its URI."""
    s = get_settings()
    if s.mlflow_tracking_uri.startswith("sqlite:///"):
        s.home.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(s.mlflow_tracking_uri)
    return s.mlflow_tracking_uri


def ensure_experiment(name: str) -> str:
    """The experiment id, creating it with an artifact location under the artifact root if new."""
    configure_mlflow()
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    root = get_settings().mlflow_artifact_root
    root.mkdir(parents=True, exist_ok=True)
    try:
        return mlflow.create_experiment(name, artifact_location=(root / name).as_uri())
    except mlflow.exceptions.MlflowException:  # created concurrently by another worker
        return mlflow.get_experiment_by_name(name).experiment_id


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts → dotted MLflow params (values stringified and length-capped)."""
    out: dict[str, str] = {}
    for k, v in params.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, prefix=f"{name}."))
        else:
            out[name] = str(v)[:_MAX_PARAM_LEN]
    return out


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def prefect_flow_run_id() -> str | None:
    try:
        from prefect.runtime import flow_run

        return flow_run.get_id()
    except Exception:  # outside a flow run
        return None


@contextmanager
def stage_run(
    experiment: str,
    run_name: str,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
    nested: bool = False,
) -> Iterator[mlflow.ActiveRun]:
    """An MLflow run around one stage. An exception ends the run FAILED and propagates."""
    exp_id = ensure_experiment(experiment)
    base_tags = {"git_commit": git_commit()}
    if (fr := prefect_flow_run_id()) is not None:
        base_tags["prefect_flow_run_id"] = str(fr)
    base_tags.update(tags or {})
    run = mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=base_tags, nested=nested)
    try:
        if params:
            mlflow.log_params(flatten(params))
        yield run
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    else:
        mlflow.end_run(status="FINISHED")
