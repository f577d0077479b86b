"""Where the pipeline keeps its data and where MLflow lives, read from the environment.

| variable | default | meaning |
|---|---|---|
| `CSE_HOME` | `<checkout>/.cse`; outside a checkout (an installed package) `~/.cse` (`HOME_OUTSIDE_CHECKOUT`), never the current folder | base folder for everything below |
| `CSE_DATA_ROOT` | `$CSE_HOME/data` | Parquet datasets, manifests, DuckDB catalog, download cache |
| `TORCHINDUCTOR_CACHE_DIR` | `$CSE_HOME/compile-cache` | torch.compile's persistent caches (generated code, FX and AOTAutograd graphs, autotuning): warm-up paid once per node |
| `CSE_SHARED_DATA` | `../shared/data` | local mirror of the canonical sources (tests, CI, offline demo) |
| `MLFLOW_TRACKING_URI` | `sqlite:///$CSE_HOME/mlflow.db` | MLflow backend store |
| `CSE_MLFLOW_ARTIFACTS` | `$CSE_HOME/mlartifacts` | artifact root for experiments this project creates |
| `CSE_MLFLOW_PORT` | the port remembered in `$CSE_HOME/services.env`, else `5000` | the port of `mlflow ui` (scripts/main_job.sh prints the command) |
| `CSE_MLFLOW_UI_URL` | the tracking URI when it is a server's, else `http://127.0.0.1:$CSE_MLFLOW_PORT` (`mlflow ui`) | the MLflow UI the links `cse run` prints point at |
| `CSE_TASK_RUNNER` | `local` (`dask` when `CSE_DASK_ADDRESS` is set) | where shard tasks run: `local` (this process, one at a time), `dask-local` (a temporary Dask `LocalCluster`), `dask` (the scheduler at `CSE_DASK_ADDRESS`) |
| `CSE_DASK_ADDRESS` | unset | address of a running Dask scheduler, e.g. `tcp://host:8786` |
| `CSE_DASK_WORKERS` | Dask's default | worker processes of the `dask-local` cluster |
| `CSE_DASK_THREADS_PER_WORKER` | `1` | threads per worker of the `dask-local` cluster |

`scripts/services.sh up` remembers the ports it used (`CSE_PREFECT_PORT`, `CSE_MLFLOW_PORT`) in
`$CSE_HOME/services.env` (`SERVICES_ENV`): scripts/env.sh and `get_settings` read them where the variables are unset,
so a new shell reaches the same server and prints links to the same MLflow port.

Nothing here holds credentials: a team deployment sets the variables (or Prefect blocks) instead.

The variables are read by pydantic-settings (`EnvSettings`, afresh at every `get_settings()`): an empty value counts
as unset; a wrong one fails with a `ValueError` that names the variable and says what it must be.
"""

from __future__ import annotations

import getpass
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent
HOME_OUTSIDE_CHECKOUT = Path("~/.cse")  # CSE_HOME's default where this code is not a checkout (an installed package)
SERVICES_ENV = "services.env"  # in CSE_HOME: the ports `scripts/services.sh up` used (`remembered_ports`)
DEFAULT_MLFLOW_PORT = 5000

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


def parse_int(name: str, raw: str | None, minimum: int = 1) -> int | None:
    """The integer `raw` read from environment variable `name` (None when unset or blank); below `minimum` is an
    error that names the variable."""
    raw = (raw or "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {raw!r}")
    return value


def env_int(name: str, minimum: int = 1) -> int | None:
    """The integer in environment variable `name` (None when unset or empty); below `minimum` is an error."""
    return parse_int(name, os.environ.get(name), minimum)


class EnvSettings(BaseSettings):
    """The environment variables of the table above, as set: each field reads the variable of its name in upper case
    (`cse_home` is `CSE_HOME`); None where it is unset or empty. `get_settings` fills in the defaults, which depend on
    one another (`CSE_DATA_ROOT` defaults to a folder of `CSE_HOME`)."""

    model_config = SettingsConfigDict(env_ignore_empty=True, extra="ignore", frozen=True)

    cse_home: str | None = None
    cse_data_root: str | None = None
    cse_shared_data: str | None = None
    mlflow_tracking_uri: str | None = None
    cse_mlflow_artifacts: str | None = None
    cse_mlflow_ui_url: str | None = None
    cse_mlflow_port: int | None = None
    cse_task_runner: str | None = None
    cse_dask_address: str | None = None
    cse_dask_workers: int | None = None
    cse_dask_threads_per_worker: int | None = None

    @field_validator("cse_task_runner", "cse_dask_address", mode="before")
    @classmethod
    def _blank_is_unset(cls, raw: str | None) -> str | None:
        return (raw or "").strip() or None

    @field_validator("cse_task_runner")
    @classmethod
    def _one_of_the_runners(cls, raw: str | None) -> str | None:
        if raw is not None and raw.lower() not in TASK_RUNNERS:
            raise ValueError(f"CSE_TASK_RUNNER must be one of {list(TASK_RUNNERS)}, got {raw.lower()!r}")
        return None if raw is None else raw.lower()

    @field_validator("cse_dask_workers", "cse_dask_threads_per_worker", "cse_mlflow_port", mode="before")
    @classmethod
    def _positive_int(cls, raw: object, info: ValidationInfo) -> int | None:
        return parse_int(str(info.field_name).upper(), None if raw is None else str(raw))

    @model_validator(mode="after")
    def _runner_and_address_agree(self) -> EnvSettings:
        kind, address = self.cse_task_runner, self.cse_dask_address
        if kind == "dask" and not address:
            raise ValueError("CSE_TASK_RUNNER=dask needs CSE_DASK_ADDRESS (the scheduler, e.g. tcp://host:8786)")
        if kind is not None and kind != "dask" and address:
            raise ValueError(f"CSE_DASK_ADDRESS is set but CSE_TASK_RUNNER={kind!r}: unset one of them")
        return self


def read_env() -> EnvSettings:
    """The environment variables read now; a wrong value raises a `ValueError` with the variable's own message (not
    pydantic's report around it)."""
    try:
        return EnvSettings()
    except ValidationError as e:
        error = e.errors()[0]
        raise ValueError(str(error.get("ctx", {}).get("error") or error["msg"])) from None


def shard_runner_settings(env: EnvSettings | None = None) -> ShardRunnerSettings:
    """`CSE_TASK_RUNNER` / `CSE_DASK_*` read and checked; unset → the local behaviour."""
    env = env or read_env()
    address = env.cse_dask_address
    return ShardRunnerSettings(
        kind=env.cse_task_runner or ("dask" if address else "local"),  # type: ignore[arg-type]  # a str the model validates
        dask_address=address,
        dask_workers=env.cse_dask_workers,
        dask_threads_per_worker=env.cse_dask_threads_per_worker or 1,
    )


def in_checkout() -> bool:
    """Whether this code runs from a checkout (prefect.yaml and scripts/env.sh beside the packages), not from an
    installed package."""
    return (REPO_ROOT / "prefect.yaml").is_file() and (REPO_ROOT / "scripts" / "env.sh").is_file()


def default_home() -> Path:
    """`CSE_HOME` when it is unset: `<checkout>/.cse` when this code runs from a checkout (the folder the scripts use,
    whatever the shell's working directory: a plain shell's `cse` finds what `make main` made), else `~/.cse`
    (`HOME_OUTSIDE_CHECKOUT`): one fixed place, never a data root made silently in the current folder."""
    if in_checkout():
        return REPO_ROOT / ".cse"
    return HOME_OUTSIDE_CHECKOUT.expanduser()


def remembered_ports(home: Path) -> dict[str, int]:
    """The ports `scripts/services.sh up` wrote into `home/services.env` (`CSE_PREFECT_PORT=4200` lines), by variable;
    none when it never ran there. A line that is not `NAME=<port>` is left out."""
    try:
        text = (home / SERVICES_ENV).read_text(encoding="utf-8")
    except OSError:
        return {}
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and name.endswith("_PORT") and value.strip().isdigit():
            found[name.strip()] = int(value)
    return found


def compile_cache_dir() -> Path:
    """Where torch.compile keeps its persistent caches (inductor's generated code and FX graphs, AOTAutograd's graphs,
    autotuning results, Triton kernels): `TORCHINDUCTOR_CACHE_DIR`, else `$CSE_HOME/compile-cache` (a folder of this
    node that outlives the process and `/tmp` cleaning, so a second run of the same preset finds its graphs compiled).
    The variable at torch's own default (`<tmp>/torchinductor_<user>`, which inductor writes into the environment when
    it first looks for its cache) counts as unset. Computed without importing torch; the trainer exports it to torch
    (`cse.training.process.use_compile_cache`)."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    if env and Path(env) != Path(tempfile.gettempdir()) / f"torchinductor_{user}":
        return Path(env).expanduser()
    return Path(read_env().cse_home or default_home()).expanduser().resolve() / "compile-cache"


def get_settings() -> Settings:
    """Read the settings afresh (tests change the environment between cases)."""
    env = read_env()
    home = Path(env.cse_home or default_home()).expanduser().resolve()
    data_root = Path(env.cse_data_root or home / "data").expanduser().resolve()
    shared = Path(env.cse_shared_data or REPO_ROOT.parent / "shared" / "data").expanduser()
    tracking = env.mlflow_tracking_uri or f"sqlite:///{home / 'mlflow.db'}"
    port = env.cse_mlflow_port or remembered_ports(home).get("CSE_MLFLOW_PORT") or DEFAULT_MLFLOW_PORT
    artifacts = Path(env.cse_mlflow_artifacts or home / "mlartifacts").expanduser().resolve()
    return Settings(
        home=home,
        data_root=data_root,
        shared_data=shared.resolve(),
        mlflow_tracking_uri=tracking,
        mlflow_artifact_root=artifacts,
        shard_runner=shard_runner_settings(env),
        mlflow_ui_url=env.cse_mlflow_ui_url
        or (tracking if tracking.startswith(("http://", "https://")) else f"http://127.0.0.1:{port}"),
    )


def shard_task_runner(settings: ShardRunnerSettings | None = None) -> Any:
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
