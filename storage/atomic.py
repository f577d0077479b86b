"""Atomic writes: build under a temporary name in the same folder, fsync, then rename.

A killed stage therefore never leaves a file or folder that looks complete; leftovers carry a
`.tmp-<name>-<pid>-<hex>` name. The next run of the stage removes those of dead writers under the dataset's build
lock (`DataRoot.clean_stale`); `clean_temporaries` removes every leftover below a folder.

The one helper of the project for a file or folder replaced as a whole: datasets, checkpoints
(`cse.models.checkpoint`) and the exports (`cse.models.export.st_export`, `cse.models.export.peft_export`) all write
through `atomic_file` and `atomic_dir`. It imports nothing from the project and pyarrow only in `write_parquet`, so every
layer, `models/` included, may use it (the layer `atomic` of docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

TMP_PREFIX = ".tmp-"
PARQUET_COMPRESSION = "zstd"


def _tmp_sibling(final: Path) -> Path:
    return final.with_name(f"{TMP_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_file(path: str | Path) -> None:
    """Flush a file's content to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_file(final: str | Path) -> Iterator[Path]:
    """Yield a temporary path; on success it is fsynced and renamed to `final` (the rename fsynced too), on error
    removed. A kill at any point leaves `final` as it was, old or new, never a half-written file."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(final)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:  # an interrupt too: the temporary file is removed, then it propagates
        tmp.unlink(missing_ok=True)
        raise


PREVIOUS_SUFFIX = ".previous"


def fsync_dir(folder: str | Path) -> None:
    """Flush a folder's entries (a rename or a new file in it) to disk; a no-op where folders cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for p in sorted(folder.rglob("*"), key=lambda q: len(q.parts), reverse=True):
        if p.is_file() and not p.is_symlink():
            fsync_file(p)
        elif p.is_dir():
            fsync_dir(p)
    fsync_dir(folder)


def previous_dir(final: str | Path) -> Path:
    """Where `atomic_dir` keeps the folder it replaces until the new one is in place."""
    final = Path(final)
    return final.with_name(final.name + PREVIOUS_SUFFIX)


def recover_dir(final: str | Path) -> bool:
    """Put back the folder a killed `atomic_dir` had moved aside (killed between its two renames: `final` is missing
    and `<final>.previous` holds the complete old folder); drop a leftover `.previous` once `final` exists. Returns
    whether a folder was put back."""
    final, previous = Path(final), previous_dir(final)
    if not previous.is_dir():
        return False
    if final.exists():
        shutil.rmtree(previous, ignore_errors=True)
        return False
    os.rename(previous, final)
    return True


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces `final` as a whole, on error it is removed.

    The new folder's files are fsynced before it is moved in, and the old folder is removed only after the new one is
    in place: the old one is first renamed to `<final>.previous`, the new one renamed to `final`, then the old one
    deleted. A kill at any point leaves either folder complete (between the renames only `<final>.previous`, which
    `recover_dir` puts back).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(final)
    tmp = _tmp_sibling(final)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        previous = previous_dir(final)
        if final.exists():
            os.rename(final, previous)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        if previous.exists():
            shutil.rmtree(previous)
    except BaseException:  # an interrupt too: the temporary folder goes, the old one is restored, then it propagates
        shutil.rmtree(tmp, ignore_errors=True)
        recover_dir(final)
        raise


def write_parquet(table: pa.Table, path: str | Path, schema: pa.Schema | None = None) -> Path:
    """Write one Parquet file atomically (zstd). The table is cast to `schema` when given."""
    import pyarrow.parquet as pq

    if schema is not None:
        table = table.select(schema.names).cast(schema)
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp, compression=PARQUET_COMPRESSION)
    return Path(path)


def write_json(obj: Any, path: str | Path, indent: int = 2, sort_keys: bool = True) -> Path:
    """Write `obj` as indented JSON (keys sorted unless `sort_keys` is False) to `path` atomically (via a temporary
    file).

    Args:
        obj: a JSON-serialisable object (other values are written with `str`).
        path: the destination file.
        indent: spaces per level.
        sort_keys: sort every mapping's keys (else they keep their order).

    Returns:
        The path written.
    """
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=indent, sort_keys=sort_keys, default=str) + "\n")
    return Path(path)


def temporary_owner(path: str | Path) -> tuple[str, int] | None:
    """(final name, writer pid) of a `.tmp-<name>-<pid>-<hex>` leftover of `atomic_file`/`atomic_dir`; None for
    another name."""
    name = Path(path).name
    if not name.startswith(TMP_PREFIX):
        return None
    parts = name[len(TMP_PREFIX) :].rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def process_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_path(p: Path) -> None:
    """Remove a file, symlink or directory tree at `p`; a missing path is not an error.

    Args:
        p: the path to remove.
    """
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def remove_dead_temporaries(folder: str | Path) -> list[Path]:
    """Remove the `.tmp-<name>-<pid>-<hex>` leftovers below `folder` whose writer process is gone (a killed
    `atomic_file`/`atomic_dir`: a resume state, a checkpoint, a result); those of a live process are kept. Call it
    holding the folder's lock, so that no writer of another host can own a leftover. Returns what was removed.

    Args:
        folder: the folder to clean (a training job's folder).
    """
    removed: list[Path] = []
    for parent, dirs, files in os.walk(folder):
        for name in [*dirs, *files]:
            p = Path(parent) / name
            if (owner := temporary_owner(p)) is not None and not process_alive(owner[1]):
                remove_path(p)
                removed.append(p)
        dirs[:] = [d for d in dirs if not d.startswith(TMP_PREFIX)]  # (nothing to look for inside a temporary)
    return removed


def clean_temporaries(folder: str | Path) -> int:
    """Remove `.tmp-*` leftovers of killed writers below `folder`; returns how many were removed."""
    folder = Path(folder)
    if not folder.exists():
        return 0
    leftovers = sorted(folder.rglob(f"{TMP_PREFIX}*"), key=lambda q: len(q.parts), reverse=True)
    for p in leftovers:
        remove_path(p)
    return len(leftovers)
