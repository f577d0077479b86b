"""MLflow at the seams: every stage run is an MLflow run, and a failing stage ends it FAILED.

Nothing else in the project imports mlflow directly for run management.

Training logs its per-step metrics (and the params it logs while training) through
`ResilientMetricLogger`: when the tracking server cannot be reached, the batches go to the job's
spool (`RunDir.metrics_spool`, storage/spool.py) and training goes on; they are delivered in order
once the server answers again, at the end of training, when the job resumes, or by
`cse deliver-metrics <run dir>` (`deliver_spool`).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import requests
import urllib3
from mlflow.entities import Dataset as DatasetEntity
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT
from mlflow.utils.validation import (
    MAX_ENTITIES_PER_BATCH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

from config.settings import REPO_ROOT, get_settings, redact, redacted_exception
from storage.locks import exclusive
from storage.runs import RunDir
from storage.spool import (
    SpoolRecord,
    append_record,
    has_records,
    metric_count,
    param_count,
    read_records,
    replace_records,
)
from tracking.datasets import as_datasets
from tracking.redaction import mask_mlflow_exceptions, quiet_run_urls

log = logging.getLogger(__name__)
mask_mlflow_exceptions()  # MLflow's error texts name the tracking URI, password included (tracking/redaction.py)

_MAX_PARAM_LEN = 6000


class TrackingStoreReadOnly(RuntimeError):
    """The MLflow store cannot be written (a read-only file or folder): said first, naming the store."""


_PREPARED_STORES: set[str] = set()  # SQLite stores this process created or found migrated


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
    `TrackingStoreReadOnly` naming it (instead of SQLAlchemy's autoflush text), a message holding a credential masked
    (`config.settings.redacted_exception`), anything else unchanged. Raise a replacement `from None`."""
    text = " ".join(str(exc).split())
    if "readonly database" in text or "read-only file system" in text.lower():
        uri = mlflow.get_tracking_uri()
        return TrackingStoreReadOnly(redact(
            f"the MLflow store {uri} is read-only: runs cannot be recorded there (make it writable or point "
            f"MLFLOW_TRACKING_URI at a writable store); {type(exc).__name__}: {text[:300]}"))
    return redacted_exception(exc)


def _reraise(exc: BaseException):
    clean = tracking_error(exc)
    if clean is exc:
        raise exc
    raise clean from None


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
        client.set_tag(r.info.run_id, ORPHAN_TAG, f"process {owner} is gone (killed); closed"
                       + (f" by run {closed_by}" if closed_by else ""))
        client.set_terminated(r.info.run_id, status="KILLED")
        closed.append(r.info.run_id)
    if closed:
        log.warning("marked %d orphaned %s run(s) KILLED (their process was killed): %s", len(closed), run_name,
                    ", ".join(closed))
    return closed


@contextmanager
def stage_run(
    experiment: str,
    run_name: str,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
    nested: bool = False,
) -> Iterator[mlflow.ActiveRun]:
    """An MLflow run around one stage. An exception ends the run FAILED and propagates. Runs of the same stage
    left RUNNING by a killed process are marked KILLED first (`close_orphaned_runs`)."""
    try:
        exp_id = ensure_experiment(experiment)
        base_tags = {"git_commit": git_commit(), OWNER_TAG: process_owner()}
        if (fr := prefect_flow_run_id()) is not None:
            base_tags["prefect_flow_run_id"] = str(fr)
        base_tags.update(tags or {})
        run = mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=base_tags, nested=nested)
    except Exception as e:  # noqa: BLE001 - the store's error, said clearly and without credentials
        _reraise(e)
    try:
        if orphans := close_orphaned_runs(exp_id, run_name, closed_by=run.info.run_id):
            mlflow.set_tag("closed_orphaned_runs", ",".join(orphans))
        if params:
            mlflow.log_params(flatten(params))
        yield run
    except BaseException as e:
        mlflow.end_run(status="FAILED")
        if isinstance(e, Exception):
            _reraise(e)
        raise
    else:
        mlflow.end_run(status="FINISHED")


def log_quarantine(record, logger: logging.Logger | logging.LoggerAdapter | None = None, run_id: str | None = None) -> None:
    """Record in the stage's MLflow run (the active one, or `run_id`) that a damaged dataset was moved aside
    (`storage.integrity.Quarantined`): tags `quarantined` / `quarantine_reason` and the artifact `quarantine.json`."""
    from dataclasses import asdict

    (logger or log).warning("dataset %s/%s was damaged (%s): quarantined at %s and rebuilt", record.kind, record.key,
                            record.summary(), record.moved_to)
    client = mlflow.MlflowClient()
    run_id = run_id or mlflow.active_run().info.run_id
    client.set_tag(run_id, "quarantined", record.moved_to)
    client.set_tag(run_id, "quarantine_reason", record.summary()[:5000])
    client.log_dict(run_id, asdict(record), "quarantine.json")


# ------------------------------------------------------------------------------------------------ outage-tolerant logging
DELAYED_TAG = "metrics_delayed"  # on the run: how many metric values reached it late (after an outage)
_STEP_RETRIES_ENV, _STEP_TIMEOUT_ENV, _RETRY_SECONDS_ENV = "CSE_MLFLOW_STEP_RETRIES", "CSE_MLFLOW_STEP_TIMEOUT", "CSE_MLFLOW_RETRY_SECONDS"
_FAIL_FAST_LOCK = threading.Lock()


def _env_number(name: str, default: float, cast: type = int) -> Any:
    raw = os.environ.get(name, "").strip()
    return cast(raw) if raw else cast(default)


@contextmanager
def fail_fast_http() -> Iterator[None]:
    """MLflow's HTTP client settings for one tracking call made during training: `$CSE_MLFLOW_STEP_RETRIES`
    retries (default 1) without backoff and a `$CSE_MLFLOW_STEP_TIMEOUT` s timeout (default 5, whole seconds).

    mlflow.utils.rest_utils.http_request reads MLFLOW_HTTP_REQUEST_MAX_RETRIES / _BACKOFF_FACTOR / _BACKOFF_JITTER /
    _TIMEOUT from the environment on every call (not at import), so they are set for the duration of the block and
    restored afterwards; the lock serialises the blocks of several threads. An MLflow call of another thread that
    falls inside the block gets the same short settings. (MLflow's defaults, 7 retries with exponential backoff
    and a 120 s timeout, would stall a training step for minutes while the server is down.)"""
    values = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(_env_number(_STEP_RETRIES_ENV, 1)),
              "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": str(_env_number(_STEP_TIMEOUT_ENV, 5))}
    with _FAIL_FAST_LOCK:
        saved = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, old in saved.items():
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old


_UNREACHABLE = (
    requests.exceptions.ConnectionError,  # refused, reset, DNS, proxy (SSL errors are excluded below)
    requests.exceptions.Timeout,
    requests.exceptions.RetryError,  # retries exhausted on 408/429/5xx answers
    requests.exceptions.ChunkedEncodingError,  # connection dropped mid-answer
    urllib3.exceptions.MaxRetryError,
    urllib3.exceptions.NewConnectionError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.TimeoutError,
    ConnectionError,  # the builtin: refused / reset / aborted / broken pipe
    TimeoutError,
)
_UNAVAILABLE_CODES = {"TEMPORARILY_UNAVAILABLE", "DEADLINE_EXCEEDED"}  # a JSON 503 / 504 answer


def is_unreachable(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from or while handling) says the tracking server could not be
    reached or answered with a server-side/transient HTTP error (5xx, 408, 429 after retries). MLflow wraps the
    requests errors into an `MlflowException` (sometimes without `from`), hence the walk along the chain. Anything
    else (invalid params, unknown run, bad URL, TLS verification) is not an outage."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, requests.exceptions.SSLError):
            return False
        if isinstance(e, _UNREACHABLE):
            return True
        if isinstance(e, MlflowException):
            if e.error_code in _UNAVAILABLE_CODES:
                return True
            if e.get_http_status_code() < 500:  # the server answered: the request itself was refused
                return False
        e = e.__cause__ or e.__context__
    return False


def _metric_entry(key: str, value: float, timestamp: int, step: int) -> dict[str, Any]:
    return {"key": key, "value": float(value), "timestamp": int(timestamp), "step": int(step)}


def _record_chunk_length(records: list[SpoolRecord]) -> int:
    """How many leading records fit one log_batch request (MLflow's per-request limits; no param key twice)."""
    n_metrics, keys = 0, set()
    for i, r in enumerate(records):
        m, p = len(r.get("metrics", ())), set(r.get("params", {}))
        fits = (n_metrics + m <= MAX_METRICS_PER_BATCH and len(keys) + len(p) <= MAX_PARAMS_TAGS_PER_BATCH - 1
                and n_metrics + m + len(keys) + len(p) + 1 <= MAX_ENTITIES_PER_BATCH and not keys & p)
        if not fits:
            return max(i, 1)  # a record over the limits alone goes alone (the client splits it)
        n_metrics, keys = n_metrics + m, keys | p
    return len(records)


class SpoolNotDelivered(RuntimeError):
    """The tracking server could not be reached: the spool still holds batches."""


class ResilientMetricLogger:
    """Per-step metrics and training-time params of one MLflow run that survive an unreachable tracking server.

    Every value gets the wall-clock time it was produced as its timestamp. A call sends its batch with
    `MlflowClient.log_batch` under `fail_fast_http`. When the server is unreachable (`is_unreachable`; any other
    error propagates) the batch is appended to the job's spool, ONE warning naming the server and the spool is
    logged for the outage, and the call returns. While the spool holds batches, new ones are appended behind them
    and delivery of the spool is retried, in order, at most every `retry_seconds` (default `$CSE_MLFLOW_RETRY_SECONDS`
    or 30); each delivered request also sets the run tag `metrics_delayed` to the number of metric values that
    reached the run late, and delivered batches are removed from the spool atomically. `flush()` makes a last
    attempt and warns with what is left. A spool left by a crash is delivered by the resumed job's first call.
    """

    def __init__(self, run_id: str, run_dir: RunDir, retry_seconds: float | None = None,
                 logger: logging.Logger | logging.LoggerAdapter | None = None, client: mlflow.MlflowClient | None = None):
        self.run_id, self.run_dir = run_id, run_dir
        self.retry_seconds = _env_number(_RETRY_SECONDS_ENV, 30, float) if retry_seconds is None else retry_seconds
        self.log = logger or log
        self.client = client or mlflow.MlflowClient()
        self._failed_at: float | None = None  # monotonic time of the last failed attempt of the current outage
        self._outage_warned = False

    @property
    def spool(self) -> Path:
        return self.run_dir.metrics_spool

    @property
    def tracking_uri(self) -> str:
        """The tracking server as printed in messages (credentials masked)."""
        return redact(self.client.tracking_uri)

    # ------------------------------------------------------------------ the callbacks
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log `metrics` at `step`, stamped now (the Trainer's `log_metrics` callback)."""
        now = int(time.time() * 1000)
        self._log({"metrics": [_metric_entry(k, v, now, step) for k, v in metrics.items()], "params": {}})

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log `params` (values stringified, length-capped as `flatten` does)."""
        self._log({"metrics": [], "params": {k: str(v)[:_MAX_PARAM_LEN] for k, v in params.items()}})

    def _log(self, record: SpoolRecord) -> None:
        if has_records(self.spool):
            failure = self.deliver_pending() if self._retry_due() else None
            if failure is not None or has_records(self.spool):
                append_record(self.spool, record)  # behind the older batches: the order is kept
                if failure is not None:
                    self._warn_outage(failure)
                return
        try:
            with fail_fast_http():
                self._send([record], tags=[])
        except Exception as e:
            if not is_unreachable(e):
                raise
            append_record(self.spool, record)
            self._failed_at = time.monotonic()
            self._warn_outage(e)

    # ------------------------------------------------------------------ delivery
    def _retry_due(self) -> bool:
        return self._failed_at is None or time.monotonic() - self._failed_at >= self.retry_seconds

    def _send(self, records: list[SpoolRecord], tags: list[RunTag]) -> None:
        metrics = [Metric(m["key"], m["value"], m["timestamp"], m["step"]) for r in records for m in r.get("metrics", ())]
        params = [Param(k, v) for r in records for k, v in r.get("params", {}).items()]
        self.client.log_batch(self.run_id, metrics=metrics, params=params, tags=tags)

    def _delayed_so_far(self) -> int:
        """The run's `metrics_delayed` tag (0 when absent)."""
        return int(self.client.get_run(self.run_id).data.tags.get(DELAYED_TAG, "0"))

    def deliver_pending(self) -> BaseException | None:
        """Send the spool's batches in order (as few requests as MLflow's limits allow), removing each delivered
        chunk from the file. Returns None when the spool is empty afterwards, else the error that says the server is
        unreachable (any other error propagates)."""
        records = read_records(self.spool)
        total_metrics, total_params = metric_count(records), param_count(records)
        delayed = 0
        try:
            with fail_fast_http():
                if records:
                    delayed = self._delayed_so_far()
                while records:
                    n = _record_chunk_length(records)
                    delayed += metric_count(records[:n])
                    self._send(records[:n], tags=[RunTag(DELAYED_TAG, str(delayed))])
                    records = records[n:]
                    replace_records(self.spool, records)
        except Exception as e:
            if not is_unreachable(e):
                raise
            self._failed_at = time.monotonic()
            return e
        replace_records(self.spool, [])  # (removes a spool of unreadable lines only)
        if total_metrics or total_params:
            self.log.info("MLflow tracking server %s is reachable: delivered %d delayed metric values and %d params of "
                          "run %s from %s (run tag %s=%d)", self.tracking_uri, total_metrics, total_params, self.run_id,
                          self.spool, DELAYED_TAG, delayed)
        self._failed_at, self._outage_warned = None, False
        return None

    def _warn_outage(self, exc: BaseException) -> None:
        """The one warning of an outage (a later outage, after a delivery, warns again)."""
        if self._outage_warned:
            return
        self._outage_warned = True
        self.log.warning("MLflow tracking server %s is unreachable (%s): training continues; the metrics of run %s are "
                         "kept in %s and delivered, in order, when the server answers again (retried at most every "
                         "%gs)", self.tracking_uri, _short(exc), self.run_id, self.spool, self.retry_seconds)

    def pending(self) -> tuple[int, int]:
        """(metric values, params) waiting in the spool."""
        records = read_records(self.spool)
        return metric_count(records), param_count(records)

    def flush(self) -> int:
        """Deliver what the spool holds now (ignoring `retry_seconds`). Returns how many metric values remain in it;
        when some do, logs a warning saying how many, where, and how they get delivered later."""
        if not has_records(self.spool) or self.deliver_pending() is None:
            return 0
        left, params = self.pending()
        self.log.warning("MLflow tracking server %s is still unreachable: %d metric values and %d params of run %s were "
                         "NOT delivered and remain in %s; they are delivered when this job resumes, or run "
                         "`cse deliver-metrics %s` once the server is back", self.tracking_uri, left, params, self.run_id,
                         self.spool, self.run_dir.path)
        return left


def _short(exc: BaseException, limit: int = 200) -> str:
    text = redact(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= limit else text[:limit] + "…"


def deliver_spool(run_dir: RunDir) -> int:
    """Deliver the job's spooled metrics/params to its MLflow run (the tracking URI of the settings); returns how
    many metric values were delivered. Raises `SpoolNotDelivered` when the server is still unreachable. Run it
    while the job is not training (a running job delivers its spool itself)."""
    run_id = run_dir.mlflow_run_id()
    if run_id is None:
        raise ValueError(f"{run_dir.path} records no MLflow run id")
    configure_mlflow()
    metric_logger = ResilientMetricLogger(run_id, run_dir, retry_seconds=0)
    before, _ = metric_logger.pending()
    if (failure := metric_logger.deliver_pending()) is not None:
        left, params = metric_logger.pending()
        raise SpoolNotDelivered(f"MLflow tracking server {metric_logger.tracking_uri} is unreachable ({_short(failure)}): "
                                f"{left} metric values and {params} params remain in {run_dir.metrics_spool}") from failure
    return before


# --- dataset stages (tokenisation, corruption) ---
def tag_dataset_run(tags: Mapping[str, str], run_id: str | None = None) -> None:
    """Set `tags` on a dataset stage's MLflow run: the active run, or run `run_id` (a publish task may run outside
    the run's context)."""
    if run_id is None:
        mlflow.set_tags(dict(tags))
        return
    configure_mlflow()
    client = mlflow.MlflowClient()
    for k, v in tags.items():
        client.set_tag(run_id, k, v)


def log_dataset_metrics(metrics: Mapping[str, float], run_id: str | None = None, step: int | None = None) -> None:
    """Log `metrics` (at `step` when given) to a dataset stage's MLflow run: the active run, or run `run_id`."""
    if run_id is not None:
        configure_mlflow()
    mlflow.log_metrics(dict(metrics), step=step, run_id=run_id)


# --- dataset inputs (lineage: the "Datasets used" of a run in the MLflow UI) ---
# The `mlflow.data.context` input tag: how a run used a dataset (MLflow's autologging says "train" / "eval").
CONTEXT_SOURCE = "source"  # what a data stage reads and transforms (ingest: the raw file; tokenise, corrupt: a dataset)
CONTEXT_TRAIN = "train"  # the training rows (tokens; DiffAug's NLI tokens)
CONTEXT_CORRUPTION = "corruption"  # the corrupted views a D2CSE / DiffCSE job reads beside its tokens
CONTEXT_EVAL = "eval"  # evaluation data (STS: dev selection and test; SentEval transfer tasks)


def log_dataset_inputs(run_id: str | None, inputs: Iterable[tuple[Any, str]],
                       tags: Mapping[str, str] | None = None) -> list[DatasetInput]:
    """Log what run `run_id` (default: the active run) read as MLflow dataset inputs, each with its context
    (`CONTEXT_*`, the input tag `mlflow.data.context`) and `tags` (extra input tags). An input is anything
    `tracking.datasets.as_datasets` takes: a `DatasetRef` or `Manifest` (Parquet-backed, digest = the content hash,
    source = the dataset folder, schema and row count), a resolved ingestion source (path or URL + sha256; an HF
    source: one input per HF dataset), an STS/transfer evaluation input, or an `mlflow.data` Dataset. All go in one
    `MlflowClient.log_inputs` request (what `mlflow.log_input` sends for one dataset of the active run); an input the
    run already has (a resumed job logs its inputs again) is not added twice. Returns the inputs logged."""
    if run_id is None:
        run_id = active_run_id()
        if run_id is None:
            raise RuntimeError("log_dataset_inputs needs a run: pass run_id or call it inside an active MLflow run")
    else:
        configure_mlflow()
    entries = []
    for item, context in inputs:
        input_tags = [InputTag(MLFLOW_DATASET_CONTEXT, context), *(InputTag(k, str(v)) for k, v in (tags or {}).items())]
        entries += [DatasetInput(DatasetEntity(**dataset.to_dict()), tags=input_tags) for dataset in as_datasets(item)]
    if entries:
        _log_inputs_racing_others(run_id, entries)
    return entries


_DUPLICATE_DATASET = ("unique constraint", "duplicate key")  # PostgreSQL / SQLite wording of the race below


def _log_inputs_racing_others(run_id: str, entries: list[DatasetInput], attempts: int = 4) -> None:
    """`log_inputs`, tolerating another run that registers the same dataset at the same moment.

    A dataset is stored once per experiment: the SQL store looks it up and inserts it when missing, so two jobs that
    read the same dataset and log at the same moment (a sweep's children on two workers) can both try the insert and
    the second fails with a unique-key violation (seen in the team-stack test on PostgreSQL). The dataset then exists,
    so the same request again succeeds; any other error is raised at once."""
    client = mlflow.MlflowClient()
    for attempt in range(attempts):
        try:
            client.log_inputs(run_id, datasets=entries)
            return
        except MlflowException as e:
            if attempt == attempts - 1 or not any(w in str(e).lower() for w in _DUPLICATE_DATASET):
                raise
            time.sleep(0.2 * (attempt + 1))


def run_dataset_inputs(run_id: str) -> list[dict[str, Any]]:
    """The dataset inputs of run `run_id` as plain dicts (name, digest, source_type, source, schema, profile, context
    and the other input tags), in the order the store returns them."""
    configure_mlflow()
    out = []
    for di in mlflow.get_run(run_id).inputs.dataset_inputs:
        d = di.dataset
        tags = {t.key: t.value for t in di.tags}
        out.append({"name": d.name, "digest": d.digest, "source_type": d.source_type, "source": d.source,
                    "schema": d.schema, "profile": d.profile, "context": tags.pop(MLFLOW_DATASET_CONTEXT, None),
                    "tags": tags})
    return out


# --- evaluation, comparison and group runs ---
def active_run_id() -> str | None:
    """The id of the MLflow run active in this thread (a stage's or a training job's), None outside one."""
    run = mlflow.active_run()
    return run.info.run_id if run is not None else None


def log_run_results(run_id: str, *, metrics: Mapping[str, float] | None = None, tags: Mapping[str, Any] | None = None,
                    texts: Mapping[str, str] | None = None, dicts: Mapping[str, Any] | None = None,
                    folders: Mapping[str, str | Path] | None = None) -> None:
    """Results on run `run_id`, through the client (no active-run state involved): `metrics` (step 0, stamped
    now), `tags` (values stringified), `texts` and `dicts` (artifact file name → text, or → a dict saved as JSON)
    and `folders` (artifact path → local folder whose files are uploaded there)."""
    client = mlflow.MlflowClient()
    now = int(time.time() * 1000)
    if metrics or tags:
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()],
                         tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()])
    for name, text in (texts or {}).items():
        client.log_text(run_id, text, name)
    for name, value in (dicts or {}).items():
        client.log_dict(run_id, value, name)
    for artifact_path, folder in (folders or {}).items():
        client.log_artifacts(run_id, str(folder), artifact_path=artifact_path)


def download_checkpoint(uri: str, dst: Path) -> Path:
    """Download the artifact folder `uri` (`runs:/<run id>/<path>`) into `dst`; a FileNotFoundError naming the
    tracking store (credentials masked) when it cannot be fetched."""
    configure_mlflow()
    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst)))
    except Exception as e:  # MlflowException or an OSError from the artifact store
        raise FileNotFoundError(redact(f"cannot download checkpoint {uri} from MLflow ({mlflow.get_tracking_uri()}): {e}")) from None


def experiment_ids(names: list[str]) -> list[str]:
    """The ids of those of the experiments `names` that exist (none is created)."""
    configure_mlflow()
    return [e.experiment_id for n in names if (e := mlflow.get_experiment_by_name(n)) is not None]


def get_runs(run_ids: list[str]) -> list[mlflow.entities.Run]:
    """The runs `run_ids`, in that order."""
    configure_mlflow()
    return [mlflow.get_run(r) for r in run_ids]


def search_runs(experiment_ids: list[str], tags: Mapping[str, str] | None = None, *, finished: bool = False,
                newest_first: bool | None = None, max_results: int = 5000) -> list[mlflow.entities.Run]:
    """Runs of the experiments whose tags have the values `tags` gives (FINISHED ones only with `finished`),
    ordered by start time when `newest_first` is True or False."""
    configure_mlflow()
    clauses = ["attributes.status = 'FINISHED'"] if finished else []
    clauses += [f"tags.`{k}` = '{v}'" for k, v in (tags or {}).items()]
    order = None if newest_first is None else [f"attributes.start_time {'DESC' if newest_first else 'ASC'}"]
    return mlflow.search_runs(experiment_ids, filter_string=" and ".join(clauses), order_by=order, output_format="list",
                              max_results=max_results)


def start_group_run(experiment_id: str, run_name: str, tags: Mapping[str, str], params: Mapping[str, Any]) -> str:
    """The parent run of a group of children (flows/children.py), with the group's params (flattened); it ends at
    once (FINISHED), its children nest under it by tag. Returns its id."""
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=dict(tags)) as run:
        mlflow.log_params(flatten(params))
    return run.info.run_id


COMPARISON_TABLE = "comparison_table.json"  # the `compare` run's MLflow table (mlflow.log_table)


def log_comparison(comparison_id: str, selection: Mapping[str, Any], markdown: str, csv_text: str, runs: int,
                   table: Mapping[str, list[Any]] | None = None, tags: Mapping[str, str] | None = None) -> str:
    """A run of experiment `compare` for one comparison: `selection.json`, `comparison.md`, `comparison.csv`, the
    metric `runs` (how many training runs it compares), `tags`, and `table` (column name → values, the CSV's rows) as
    the MLflow table `comparison_table.json` (`mlflow.log_table`: the UI shows it as a table). Returns its id."""
    exp_id = ensure_experiment("compare")
    with mlflow.start_run(experiment_id=exp_id, run_name=f"compare-{comparison_id[:6]}",
                          tags={"cse.comparison_id": comparison_id, **(tags or {})}) as run:
        mlflow.log_dict(dict(selection), "selection.json")
        mlflow.log_text(markdown, "comparison.md")
        mlflow.log_text(csv_text, "comparison.csv")
        if table:
            mlflow.log_table(data={k: list(v) for k, v in table.items()}, artifact_file=COMPARISON_TABLE)
        mlflow.log_metric("runs", runs)
    return run.info.run_id


# --- training runs (tasks/train.py, tasks/distributed_train.py) ---
def start_or_resume_training_run(experiment: str, run_dir: RunDir, run_name: str, tags: Mapping[str, str],
                                 params: Mapping[str, Any], log_system_metrics: bool) -> mlflow.ActiveRun:
    """The training job's MLflow run: the one `run_dir` records (a resumed job continues it), else a new run in
    `experiment` with `tags` and the flattened `params`, whose id is recorded in `run_dir`."""
    exp_id = ensure_experiment(experiment)
    previous = run_dir.mlflow_run_id()
    if previous is not None:
        try:
            return mlflow.start_run(run_id=previous, log_system_metrics=log_system_metrics)
        except MlflowException:
            log.warning("MLflow run %s of %s not found; starting a new run", previous, run_dir.path)
    run = mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=dict(tags), log_system_metrics=log_system_metrics)
    run_dir.set_mlflow_run_id(run.info.run_id)
    mlflow.log_params(flatten(params))
    return run


@contextmanager
def training_run(experiment: str, run_dir: RunDir, run_name: str, tags: Mapping[str, str], params: Mapping[str, Any],
                 log_system_metrics: bool, killed: tuple[type[BaseException], ...] = (KeyboardInterrupt,),
                 ) -> Iterator[mlflow.ActiveRun]:
    """`start_or_resume_training_run` as the active run of the block: ended FINISHED after it, KILLED when it raises
    one of `killed` (an interrupt, the loop's simulated kill), FAILED on any other exception (which propagates)."""
    try:
        active = start_or_resume_training_run(experiment, run_dir, run_name, tags, params, log_system_metrics)
    except Exception as e:  # noqa: BLE001 - the store's error, said clearly and without credentials
        _reraise(e)
    with active as run:
        try:
            yield run
        except killed:
            mlflow.end_run(status="KILLED")
            raise
        except BaseException as e:
            mlflow.end_run(status="FAILED")
            if isinstance(e, Exception):
                _reraise(e)
            raise


def training_run_exists(run_id: str) -> bool:
    """Whether the MLflow run `run_id` (a finished job's) still exists in the configured tracking store."""
    configure_mlflow()
    try:
        mlflow.get_run(run_id)
    except MlflowException:
        return False
    return True


def rank_zero_callbacks(run_id: str, run_dir: RunDir, world_size: int):
    """Rank 0's `log_params` / `log_metrics` of a distributed job: into the job's run through the client (the run's
    status is left alone; tag `world_size`), via `ResilientMetricLogger` (an unreachable server spools into the
    job's folder; the launching task flushes)."""
    configure_mlflow()
    client = mlflow.MlflowClient()
    client.set_tag(run_id, "world_size", str(world_size))
    metrics_log = ResilientMetricLogger(run_id, run_dir, client=client)

    def log_params(params: dict) -> None:
        try:
            metrics_log.log_params(params)
        except MlflowException as e:  # a resumed run that logged other values before
            log.warning("params not logged (%s): %s", e, params)

    return log_params, metrics_log.log_metrics


# --- stores ---
def prepare_sqlite_store(path: Path) -> Path:
    """Create an MLflow SQLite store at `path` with its schema migrated (an empty store, the Default experiment), or
    check an existing one. Creation and migration hold `<path>.lock`: two processes that open a fresh store at once
    would both create its tables (`duplicate column name`, alembic's "expected to match one row"); the second waits,
    then finds it migrated. A store in a folder this process cannot write (read-only) is only read, without the lock."""
    path = Path(path).expanduser().resolve()
    uri = f"sqlite:///{path}"
    lock = path.with_name(path.name + ".lock")
    try:
        held = exclusive(lock, f"MLflow store {path} (creation/migration)")
        held.__enter__()
    except OSError:  # a read-only folder: nothing can be created or migrated there; reading needs no lock
        held = None
    try:
        mlflow.MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 - said clearly (read-only store, masked credentials)
        _reraise(e)
    finally:
        if held is not None:
            held.__exit__(None, None, None)
    return path
