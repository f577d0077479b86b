"""Outage-tolerant logging of a training job's per-step metrics and training-time params.

Training logs them through `ResilientMetricLogger`: when the tracking server cannot be reached, the batches go to
the job's spool (`RunDir.metrics_spool`, storage/spool.py holds the file format) and training goes on; they are
delivered in order once the server answers again, at the end of training, when the job resumes, or by
`cse deliver-metrics <run dir>` (`deliver_spool`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import requests
import urllib3
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import (
    MAX_ENTITIES_PER_BATCH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

from cse.storage.runs import RunDir
from cse.storage.secrets import redact
from cse.storage.spool import (
    SpoolRecord,
    append_record,
    has_records,
    metric_count,
    param_count,
    read_records,
    replace_records,
)
from cse.tracking.store import MAX_PARAM_LEN, configure_mlflow

log = logging.getLogger(__name__)

DELAYED_TAG = "metrics_delayed"  # on the run: how many metric values reached it late (after an outage)
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
    values = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(_env_number("CSE_MLFLOW_STEP_RETRIES", 1)),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
        "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(_env_number("CSE_MLFLOW_STEP_TIMEOUT", 5)),
    }
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


def _record_chunk_length(records: list[SpoolRecord]) -> int:
    """How many leading records fit one log_batch request (MLflow's per-request limits; no param key twice)."""
    n_metrics = 0
    keys: set[str] = set()
    for i, r in enumerate(records):
        m, p = len(r.get("metrics", ())), set(r.get("params", {}))
        fits = (
            n_metrics + m <= MAX_METRICS_PER_BATCH
            and len(keys) + len(p) <= MAX_PARAMS_TAGS_PER_BATCH - 1
            and n_metrics + m + len(keys) + len(p) + 1 <= MAX_ENTITIES_PER_BATCH
            and not keys & p
        )
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

    A resumed job runs again the steps between its resume state and the kill, which the killed process had already
    logged: the first `log_metrics` call reads the step each metric of the run reached (its MLflow history and the
    spool), and a value at a step not past it is dropped, so every step appears once in a metric's history.
    """

    def __init__(
        self,
        run_id: str,
        run_dir: RunDir,
        retry_seconds: float | None = None,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
        client: mlflow.MlflowClient | None = None,
    ):
        self.run_id, self.run_dir = run_id, run_dir
        self.retry_seconds = (
            _env_number("CSE_MLFLOW_RETRY_SECONDS", 30, float) if retry_seconds is None else retry_seconds
        )
        self.log = logger or log
        self.client = client or mlflow.MlflowClient()
        self._failed_at: float | None = None  # monotonic time of the last failed attempt of the current outage
        self._outage_warned = False
        self._logged_through: dict[str, int] | None = None  # metric → the last step the run holds (read once)

    @property
    def spool(self) -> Path:
        return self.run_dir.metrics_spool

    @property
    def tracking_uri(self) -> str:
        """The tracking server as printed in messages (credentials masked)."""
        return redact(self.client.tracking_uri)

    # ------------------------------------------------------------------ the callbacks
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log `metrics` at `step`, stamped now (the Trainer's `log_metrics` callback); a metric the run already holds
        at this step or a later one (logged before a kill, run again after the resume) is not logged again."""
        if self._logged_through is None:
            self._logged_through = self._steps_logged()
        fresh = {k: v for k, v in metrics.items() if step > self._logged_through.get(k, -1)}
        if fresh:
            now = int(time.time() * 1000)
            entries = [{"key": k, "value": float(v), "timestamp": now, "step": int(step)} for k, v in fresh.items()]
            self._log({"metrics": entries, "params": {}})

    def _steps_logged(self) -> dict[str, int]:
        """The last step of each metric the run holds: in MLflow (its history) and waiting in the spool. A fresh run
        holds none (one request); an unreachable server leaves only the spool's."""
        steps: dict[str, int] = {}
        for record in read_records(self.spool):
            for m in record.get("metrics", ()):
                steps[m["key"]] = max(steps.get(m["key"], -1), int(m["step"]))
        try:
            with fail_fast_http():
                for key in self.client.get_run(self.run_id).data.metrics:
                    history = self.client.get_metric_history(self.run_id, key)
                    steps[key] = max([steps.get(key, -1), *(m.step for m in history)])
        except Exception as e:  # client errors share no class: an unreachable store is handled, the rest re-raised
            if not is_unreachable(e):
                raise
        return steps

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log `params` (values stringified, length-capped as `flatten` does)."""
        self._log({"metrics": [], "params": {k: str(v)[:MAX_PARAM_LEN] for k, v in params.items()}})

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
        except Exception as e:  # client errors share no class: an unreachable store is handled, the rest re-raised
            if not is_unreachable(e):
                raise
            append_record(self.spool, record)
            self._failed_at = time.monotonic()
            self._warn_outage(e)

    # ------------------------------------------------------------------ delivery
    def _retry_due(self) -> bool:
        return self._failed_at is None or time.monotonic() - self._failed_at >= self.retry_seconds

    def _send(self, records: list[SpoolRecord], tags: list[RunTag]) -> None:
        metrics = [
            Metric(m["key"], m["value"], m["timestamp"], m["step"]) for r in records for m in r.get("metrics", ())
        ]
        params = [Param(k, v) for r in records for k, v in r.get("params", {}).items()]
        self.client.log_batch(self.run_id, metrics=metrics, params=params, tags=tags)

    def deliver_pending(self) -> BaseException | None:
        """Send the spool's batches in order (as few requests as MLflow's limits allow), removing each delivered
        chunk from the file. Returns None when the spool is empty afterwards, else the error that says the server is
        unreachable (any other error propagates)."""
        records = read_records(self.spool)
        total_metrics, total_params = metric_count(records), param_count(records)
        delayed = 0
        try:
            with fail_fast_http():
                if records:  # the run's `metrics_delayed` so far (0 when absent)
                    delayed = int(self.client.get_run(self.run_id).data.tags.get(DELAYED_TAG, "0"))
                while records:
                    n = _record_chunk_length(records)
                    delayed += metric_count(records[:n])
                    self._send(records[:n], tags=[RunTag(DELAYED_TAG, str(delayed))])
                    records = records[n:]
                    replace_records(self.spool, records)
        except Exception as e:  # client errors share no class: an unreachable store is handled, the rest re-raised
            if not is_unreachable(e):
                raise
            self._failed_at = time.monotonic()
            return e
        replace_records(self.spool, [])  # (removes a spool of unreadable lines only)
        if total_metrics or total_params:
            self.log.info(
                "MLflow tracking server %s is reachable: delivered %d delayed metric values and %d params of "
                "run %s from %s (run tag %s=%d)",
                self.tracking_uri,
                total_metrics,
                total_params,
                self.run_id,
                self.spool,
                DELAYED_TAG,
                delayed,
            )
        self._failed_at, self._outage_warned = None, False
        return None

    def _warn_outage(self, exc: BaseException) -> None:
        """The one warning of an outage (a later outage, after a delivery, warns again)."""
        if self._outage_warned:
            return
        self._outage_warned = True
        self.log.warning(
            "MLflow tracking server %s is unreachable (%s): training continues; the metrics of run %s are "
            "kept in %s and delivered, in order, when the server answers again (retried at most every "
            "%gs)",
            self.tracking_uri,
            _short(exc),
            self.run_id,
            self.spool,
            self.retry_seconds,
        )

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
        self.log.warning(
            "MLflow tracking server %s is still unreachable: %d metric values and %d params of run %s were "
            "NOT delivered and remain in %s; they are delivered when this job resumes, or run "
            "`cse deliver-metrics %s` once the server is back",
            self.tracking_uri,
            left,
            params,
            self.run_id,
            self.spool,
            self.run_dir.path,
        )
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
        raise SpoolNotDelivered(
            f"MLflow tracking server {metric_logger.tracking_uri} is unreachable ({_short(failure)}): "
            f"{left} metric values and {params} params remain in {run_dir.metrics_spool}"
        ) from failure
    return before
