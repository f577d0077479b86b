"""Where the pipeline keeps its data and where MLflow lives, read from the environment.

| variable | default | meaning |
|---|---|---|
| `CSE_HOME` | `./.cse` | base folder for everything below |
| `CSE_DATA_ROOT` | `$CSE_HOME/data` | Parquet datasets, manifests, DuckDB catalog, download cache |
| `CSE_SHARED_DATA` | `../shared/data` | local mirror of the canonical sources (tests, CI, offline demo) |
| `MLFLOW_TRACKING_URI` | `sqlite:///$CSE_HOME/mlflow.db` | MLflow backend store |
| `CSE_MLFLOW_ARTIFACTS` | `$CSE_HOME/mlartifacts` | artifact root for experiments this project creates |

Nothing here holds credentials: a team deployment sets the variables (or Prefect blocks) instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Settings:
    home: Path
    data_root: Path
    shared_data: Path
    mlflow_tracking_uri: str
    mlflow_artifact_root: Path


def get_settings() -> Settings:
    """Read the settings afresh (tests change the environment between cases)."""
    home = Path(os.environ.get("CSE_HOME", Path.cwd() / ".cse")).expanduser().resolve()
    data_root = Path(os.environ.get("CSE_DATA_ROOT", home / "data")).expanduser().resolve()
    shared = Path(os.environ.get("CSE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data")).expanduser()
    tracking = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home / 'mlflow.db'}"
    artifacts = Path(os.environ.get("CSE_MLFLOW_ARTIFACTS", home / "mlartifacts")).expanduser().resolve()
    return Settings(
        home=home,
        data_root=data_root,
        shared_data=shared.resolve(),
        mlflow_tracking_uri=tracking,
        mlflow_artifact_root=artifacts,
    )
