"""The metrics spool: a JSONL file of tracking batches that could not be delivered yet.

One line per batch, in the order the batches were produced:

    {"metrics": [{"key": "loss", "value": 0.53, "timestamp": 1700000000000, "step": 40}, ...],
     "params": {"name": "value", ...}}

`timestamp` is when the value was produced (ms since the epoch), so a late delivery keeps the
original time. Appends are flushed and fsync'd before returning (a killed process loses no
acknowledged batch); delivered batches are removed by rewriting the remainder atomically. A line
torn by a kill in the middle of an append is skipped (with a warning) when read.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from cse.storage.atomic import atomic_file, fsync_dir

log = logging.getLogger(__name__)

SpoolRecord = dict[str, Any]  # {"metrics": [{"key", "value", "timestamp", "step"}], "params": {str: str}}


def _encode(record: SpoolRecord) -> bytes:
    return (json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n").encode()


def append_record(path: Path, record: SpoolRecord) -> None:
    """Append one batch as a line and fsync it; a torn last line left by a kill is closed off first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    created = not path.exists()
    with open(path, "ab+") as f:
        f.seek(0, os.SEEK_END)
        prefix = b""
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            prefix = b"" if f.read(1) == b"\n" else b"\n"
        f.write(prefix + _encode(record))
        f.flush()
        os.fsync(f.fileno())
    if created:
        fsync_dir(path.parent)


def read_records(path: Path) -> list[SpoolRecord]:
    """The batches in the spool, oldest first ([] when there is no spool); unreadable lines are skipped."""
    if not path.is_file():
        return []
    records: list[SpoolRecord] = []
    for n, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning(
                "skipping unreadable line %d of the metrics spool %s (torn by a kill while it was written)", n, path
            )
    return records


def replace_records(path: Path, records: list[SpoolRecord]) -> None:
    """Atomically make `records` the spool's whole content; no records removes the file."""
    if not records:
        if path.exists():
            path.unlink()
            fsync_dir(path.parent)
        return
    with atomic_file(path) as tmp:  # fsyncs the file and the rename
        tmp.write_bytes(b"".join(_encode(r) for r in records))


def has_records(path: Path) -> bool:
    """Whether the spool holds anything (a cheap check: no parsing)."""
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False


def metric_count(records: list[SpoolRecord]) -> int:
    """How many metric values the batches hold."""
    return sum(len(r.get("metrics", ())) for r in records)


def param_count(records: list[SpoolRecord]) -> int:
    """How many params the batches hold."""
    return sum(len(r.get("params", {})) for r in records)
