"""Where the pipeline keeps its data and where MLflow lives, read from the environment.

| variable | default | meaning |
|---|---|---|
| `CSE_HOME` | `<checkout>/.cse` (`./.cse` outside a checkout) | base folder for everything below |
| `CSE_DATA_ROOT` | `$CSE_HOME/data` | Parquet datasets, manifests, DuckDB catalog, download cache |
| `CSE_SHARED_DATA` | `../shared/data` | local mirror of the canonical sources (tests, CI, offline demo) |
| `MLFLOW_TRACKING_URI` | `sqlite:///$CSE_HOME/mlflow.db` | MLflow backend store |
| `CSE_MLFLOW_ARTIFACTS` | `$CSE_HOME/mlartifacts` | artifact root for experiments this project creates |
| `CSE_MLFLOW_UI_URL` | the tracking URI when it is a server's, else `http://127.0.0.1:5000` (`mlflow ui`) | the MLflow UI the links `cse run` prints point at |
| `CSE_TASK_RUNNER` | `local` (`dask` when `CSE_DASK_ADDRESS` is set) | where shard tasks run: `local` (this process, one at a time), `dask-local` (a temporary Dask `LocalCluster`), `dask` (the scheduler at `CSE_DASK_ADDRESS`) |
| `CSE_DASK_ADDRESS` | unset | address of a running Dask scheduler, e.g. `tcp://host:8786` |
| `CSE_DASK_WORKERS` | Dask's default | worker processes of the `dask-local` cluster |
| `CSE_DASK_THREADS_PER_WORKER` | `1` | threads per worker of the `dask-local` cluster |

Nothing here holds credentials: a team deployment sets the variables (or Prefect blocks) instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO_ROOT = Path(__file__).resolve().parent.parent

TaskRunnerKind = Literal["local", "dask-local", "dask"]
TASK_RUNNERS: tuple[str, ...] = ("local", "dask-local", "dask")


@dataclass(frozen=True)
class ShardRunnerSettings:
    """Where the data stages run their shard tasks (see the table above)."""

    kind: TaskRunnerKind = "local"
    dask_address: str | None = None
    dask_workers: int | None = None
    dask_threads_per_worker: int = 1


@dataclass(frozen=True)
class Settings:
    """Process-wide paths and endpoints: home, data roots, MLflow tracking and artifact locations, shard runner."""

    home: Path
    data_root: Path
    shared_data: Path
    mlflow_tracking_uri: str
    mlflow_artifact_root: Path
    shard_runner: ShardRunnerSettings = ShardRunnerSettings()
    mlflow_ui_url: str = "http://127.0.0.1:5000"


def env_int(name: str, minimum: int = 1) -> int | None:
    """The integer in environment variable `name` (None when unset or empty); below `minimum` is an error."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}")
    return value


def shard_runner_settings() -> ShardRunnerSettings:
    """`CSE_TASK_RUNNER` / `CSE_DASK_*` read and checked; unset → the local behaviour."""
    address = os.environ.get("CSE_DASK_ADDRESS", "").strip() or None
    kind = os.environ.get("CSE_TASK_RUNNER", "").strip().lower() or ("dask" if address else "local")
    if kind not in TASK_RUNNERS:
        raise ValueError(f"CSE_TASK_RUNNER must be one of {list(TASK_RUNNERS)}, got {kind!r}")
    if kind == "dask" and not address:
        raise ValueError("CSE_TASK_RUNNER=dask needs CSE_DASK_ADDRESS (the scheduler, e.g. tcp://host:8786)")
    if kind != "dask" and address:
        raise ValueError(f"CSE_DASK_ADDRESS is set but CSE_TASK_RUNNER={kind!r}: unset one of them")
    return ShardRunnerSettings(
        kind=kind,  # type: ignore[arg-type]
        dask_address=address,
        dask_workers=env_int("CSE_DASK_WORKERS"),
        dask_threads_per_worker=env_int("CSE_DASK_THREADS_PER_WORKER") or 1,
    )


def default_home() -> Path:
    """`CSE_HOME` when it is unset: `<checkout>/.cse` when this code runs from a checkout (the folder the scripts use,
    whatever the shell's working directory: a plain shell's `cse` finds what `make main` made), else `./.cse`."""
    if (REPO_ROOT / "prefect.yaml").is_file() and (REPO_ROOT / "scripts" / "env.sh").is_file():
        return REPO_ROOT / ".cse"
    return Path.cwd() / ".cse"


def get_settings() -> Settings:
    """Read the settings afresh (tests change the environment between cases)."""
    home = Path(os.environ.get("CSE_HOME") or default_home()).expanduser().resolve()
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
        shard_runner=shard_runner_settings(),
        mlflow_ui_url=os.environ.get("CSE_MLFLOW_UI_URL")
        or (tracking if tracking.startswith(("http://", "https://")) else "http://127.0.0.1:5000"),
    )


def shard_task_runner(settings: ShardRunnerSettings | None = None):
    """The Prefect task runner the data stages hand their shard tasks to, built from the settings at
    call time; `None` for `local` (the calling flow's own task runner then runs them).

    `dask-local` starts a temporary `distributed.LocalCluster` (worker processes, closed when the
    runner exits); `dask` connects to the running scheduler at `CSE_DASK_ADDRESS` and leaves it running.
    Either way the workers must see the same data root, at the same path, as the flow (a shared
    filesystem) and import this project (`pip install -e .` in their environment).
    """
    s = settings or shard_runner_settings()
    if s.kind == "local":
        return None
    from prefect_dask import DaskTaskRunner

    if s.kind == "dask":
        return DaskTaskRunner(address=s.dask_address)
    cluster_kwargs: dict = {"processes": True, "threads_per_worker": s.dask_threads_per_worker}
    if s.dask_workers is not None:
        cluster_kwargs["n_workers"] = s.dask_workers
    return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs=cluster_kwargs)
