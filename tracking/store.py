"""The MLflow tracking store: pointing MLflow at it (a SQLite store created and migrated under a lock), its errors
said clearly and without credentials, experiments, and reading runs and artifacts back.

Every other module of `tracking/` goes through `configure_mlflow` / `ensure_experiment` before it talks to the store.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Mapping
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any, NoReturn

import mlflow

from cse.storage.locks import exclusive
from cse.storage.secrets import redact, redacted_exception
from cse.storage.settings import compile_cache_dir, get_settings
from cse.tracking.redaction import mask_mlflow_client, mask_mlflow_exceptions, quiet_run_urls
from cse.tracking.run_pages import experiment_page_tags

mask_mlflow_exceptions()  # MLflow's error texts name the tracking URI, password included (tracking/redaction.py)
mask_mlflow_client()  # and nothing the project sends to MLflow holds a credential in clear (names, params, tags, ...)

MAX_PARAM_LEN = 6000  # a param's value is cut to this many characters (MLflow's limit)


class TrackingStoreReadOnly(RuntimeError):
    """The MLflow store cannot be written (a read-only file or folder): said first, naming the store."""


class WriteRefused(OSError):
    """A write refused by a read-only folder that is not the MLflow store: names the path that
    refused it, what that path is (compile cache, data root, training job folder, ...) and how to go on. Its `errno`
    is the original one (the message says the reason in words)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.errno = code


# Only a read-only file system: its errno says a write was refused (EACCES and EPERM come from reads as well, and a
# source file that cannot be read must not be called a folder that cannot be written)
_REFUSED = (errno.EROFS,)
# `[Errno 30] Read-only file system: '/path'` inside a wrapped error's text (torch's InductorError, a task's error)
_REFUSED_TEXT = re.compile(r"\[Errno (30)\] ([^:\]]+): '([^']+)'")


def refused_write(exc: BaseException) -> tuple[int, str, Path] | None:
    """(errno, reason, path) of a write refused by a read-only file system, found in `exc`,
    the exceptions it was raised from (`__cause__`, `__context__`) or, for a wrapped one, its text; None otherwise."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _REFUSED and e.filename:
            return e.errno, e.strerror or os.strerror(e.errno), Path(os.fsdecode(e.filename))
        if m := _REFUSED_TEXT.search(str(e)):
            return int(m.group(1)), m.group(2).strip(), Path(m.group(3))
        todo += [e.__cause__, e.__context__]
    return None


def _within(path: Path, folder: Path) -> bool:
    path, folder = Path(os.path.abspath(path)), Path(os.path.abspath(folder))
    return path == folder or folder in path.parents


def what_path(path: Path) -> tuple[str, Path, str] | None:
    """What `path` belongs to: (what, its folder, how to point it elsewhere), or None when it is the MLflow store (the
    SQLite file, its journal, or the artifact root). A path of none of the project's folders is named as itself."""
    s = get_settings()
    store = _sqlite_path(s.mlflow_tracking_uri)
    if (store is not None and path.name.startswith(store.name) and _within(path.parent, store.parent)) or _within(
        path, s.mlflow_artifact_root
    ):
        return None
    triton = os.environ.get("TRITON_CACHE_DIR")
    runs = s.home / "runs"
    places = [
        (
            "torch.compile cache (TORCHINDUCTOR_CACHE_DIR)",
            compile_cache_dir(),
            "point TORCHINDUCTOR_CACHE_DIR at a writable folder, or train with speed.compile: false",
        ),
        *(
            [("Triton cache (TRITON_CACHE_DIR)", Path(triton), "point TRITON_CACHE_DIR at a writable folder")]
            if triton
            else []
        ),
        ("data root (CSE_DATA_ROOT)", s.data_root, "make it writable or point CSE_DATA_ROOT at a writable data root"),
    ]
    for what, folder, hint in places:
        if _within(path, folder):
            return what, folder, hint
    if _within(path, runs) and len(Path(os.path.abspath(path)).relative_to(os.path.abspath(runs)).parts) >= 2:
        job = Path(os.path.abspath(runs)).joinpath(
            *Path(os.path.abspath(path)).relative_to(os.path.abspath(runs)).parts[:2]
        )
        return "training job folder", job, "make it writable, or set CSE_HOME to a folder on a writable disk"
    if _within(path, s.home):
        return "CSE_HOME", s.home, "make it writable, or set CSE_HOME to a folder on a writable disk"
    return "path", path, "make it writable"


def write_refused_error(exc: BaseException) -> BaseException | None:
    """`WriteRefused` for `exc` when it is a write refused by a read-only path other than the MLflow
    store (named: its path and what it is); None otherwise."""
    refused = refused_write(exc)
    if refused is None or (place := what_path(refused[2])) is None:
        return None
    code, reason, path = refused
    what, folder, hint = place
    where = f"the {what} {folder}" if folder != path else f"the {what} {path}"
    return WriteRefused(
        code,
        redact(
            f"{where} cannot be written ({reason}): {path} was refused; the MLflow store {mlflow.get_tracking_uri()} "
            f"is not concerned. {hint[0].upper()}{hint[1:]} ({type(exc).__name__})"
        ),
    )


_PREPARED_STORES: set[str] = set()  # SQLite stores this process created or found migrated
_PAGES_SET: set[tuple[str, str]] = set()  # (store, experiment)s whose page tags this process checked


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")).expanduser() if uri.startswith("sqlite:///") else None


def configure_mlflow() -> str:
    """Point MLflow at the configured tracking store; returns its URI. A SQLite store is created and migrated under
    a lock the first time (`prepare_sqlite_store`), so flows started at once on a fresh `$CSE_HOME` do not race."""
    s = get_settings()
    quiet_run_urls(s.mlflow_tracking_uri)
    if (path := _sqlite_path(s.mlflow_tracking_uri)) is not None:
        if s.mlflow_tracking_uri not in _PREPARED_STORES:
            path.parent.mkdir(parents=True, exist_ok=True)
            prepare_sqlite_store(path)
            _PREPARED_STORES.add(s.mlflow_tracking_uri)
    mlflow.set_tracking_uri(s.mlflow_tracking_uri)
    return s.mlflow_tracking_uri


def tracking_error(exc: BaseException) -> BaseException:
    """The exception to show for `exc` raised by a tracking call: a read-only SQLite store as
    `TrackingStoreReadOnly` naming it (instead of SQLAlchemy's autoflush text), a write refused by another read-only
    folder as `WriteRefused` naming that folder and what it is (`write_refused_error`), a message holding a credential masked
    (`cse.storage.secrets.redacted_exception`), anything else unchanged. Raise a replacement `from None`."""
    if (refused := write_refused_error(exc)) is not None:  # another folder than the store: named
        return refused
    text = " ".join(str(exc).split())
    if "readonly database" in text or "read-only file system" in text.lower():
        uri = mlflow.get_tracking_uri()
        return TrackingStoreReadOnly(
            redact(
                f"the MLflow store {uri} is read-only: runs cannot be recorded there (make it writable or point "
                f"MLFLOW_TRACKING_URI at a writable store); {type(exc).__name__}: {text[:300]}"
            )
        )
    return redacted_exception(exc)


def reraise(exc: BaseException) -> NoReturn:
    """Raise `tracking_error(exc)`: `exc` itself when it needs no rewording, else its replacement `from None`."""
    clean = tracking_error(exc)
    if clean is exc:
        raise exc
    raise clean from None


def ensure_experiment(name: str) -> str:
    """The experiment id, creating it with an artifact location under the artifact root if new. Its pages open in
    MLflow's model-training view with the STS columns (`cse.tracking.run_pages.experiment_page_tags`): set at creation,
    and on an experiment made before (or by someone else) the first time this process uses it."""
    uri = configure_mlflow()
    tags = experiment_page_tags()
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        if (uri, exp.experiment_id) not in _PAGES_SET:
            client = mlflow.MlflowClient()
            for k, v in tags.items():
                if exp.tags.get(k) != v:
                    client.set_experiment_tag(exp.experiment_id, k, v)
            _PAGES_SET.add((uri, exp.experiment_id))
        return exp.experiment_id
    root = get_settings().mlflow_artifact_root
    root.mkdir(parents=True, exist_ok=True)
    try:
        return mlflow.create_experiment(name, artifact_location=(root / name).as_uri(), tags=tags)
    except mlflow.exceptions.MlflowException:  # created concurrently by another worker
        if (created := mlflow.get_experiment_by_name(name)) is None:  # not that: the store refused it
            raise
        return created.experiment_id


def prepare_sqlite_store(path: Path) -> Path:
    """Create an MLflow SQLite store at `path` with its schema migrated (an empty store, the Default experiment), or
    check an existing one. Creation and migration hold `<path>.lock`: two processes that open a fresh store at once
    would both create its tables (`duplicate column name`, alembic's "expected to match one row"); the second waits,
    then finds it migrated. A store in a folder this process cannot write (read-only) is only read, without the lock."""
    path = Path(path).expanduser().resolve()
    uri = f"sqlite:///{path}"
    lock = path.with_name(path.name + ".lock")
    with ExitStack() as held:
        with suppress(OSError):  # a read-only folder: nothing can be created or migrated there; reading needs no lock
            held.enter_context(exclusive(lock, f"MLflow store {path} (creation/migration)"))
        try:
            mlflow.MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        except Exception as e:  # noqa: BLE001 - said clearly (read-only store, masked credentials)
            reraise(e)
    return path


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts → dotted MLflow params (values stringified and length-capped)."""
    out: dict[str, str] = {}
    for k, v in params.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, prefix=f"{name}."))
        else:
            out[name] = str(v)[:MAX_PARAM_LEN]
    return out


def download_checkpoint(uri: str, dst: Path) -> Path:
    """Download the artifact folder `uri` (`runs:/<run id>/<path>`) into `dst`; a FileNotFoundError naming the
    tracking store (credentials masked) when it cannot be fetched."""
    configure_mlflow()
    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst)))
    except Exception as e:  # noqa: BLE001 - MlflowException or an OSError from the artifact store: named, masked
        raise FileNotFoundError(
            redact(f"cannot download checkpoint {uri} from MLflow ({mlflow.get_tracking_uri()}): {e}")
        ) from None


def experiment_ids(names: list[str]) -> list[str]:
    """The ids of those of the experiments `names` that exist (none is created)."""
    configure_mlflow()
    return [e.experiment_id for n in names if (e := mlflow.get_experiment_by_name(n)) is not None]


def get_runs(run_ids: list[str]) -> list[mlflow.entities.Run]:
    """The runs `run_ids`, in that order."""
    configure_mlflow()
    return [mlflow.get_run(r) for r in run_ids]


def search_runs(
    experiment_ids: list[str],
    tags: Mapping[str, str] | None = None,
    *,
    finished: bool = False,
    newest_first: bool | None = None,
    max_results: int = 5000,
) -> list[mlflow.entities.Run]:
    """Runs of the experiments whose tags have the values `tags` gives (FINISHED ones only with `finished`),
    ordered by start time when `newest_first` is True or False."""
    configure_mlflow()
    clauses = ["attributes.status = 'FINISHED'"] if finished else []
    clauses += [f"tags.`{k}` = '{v}'" for k, v in (tags or {}).items()]
    order = None if newest_first is None else [f"attributes.start_time {'DESC' if newest_first else 'ASC'}"]
    return mlflow.search_runs(
        experiment_ids,
        filter_string=" and ".join(clauses),
        order_by=order,
        output_format="list",
        max_results=max_results,
    )
