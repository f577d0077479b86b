"""Verifying published datasets, and moving damaged ones aside (never deleting them).

A cache hit reuses a dataset only after `check_dataset` found it intact:
- always (cheap): the manifest reads and matches its seal (storage/seal.py: an edit that rewrote the manifest to
  match is found), every listed file exists with the size and Parquet row count the manifest records, the rows add
  up, and no `damaged.json` marker (left by `cse verify`) is in the folder;
- with `full=True` (`verify: true`, `cse verify`, and always before training): the sha256 of every file against
  the manifest's per-file hashes and its content hash, and the Arrow copy's rows against the Parquet parts' rows
  (`compare_arrow_copy`: the two views of the dataset hold the same values).
The dataset's Arrow copy (`hf/`, storage/arrow_copy.py; training reads its rows from it) is checked the same way when
the manifest records one: files, sizes, stream row counts always, hashes with `full`.
A damaged dataset is quarantined: its folder is moved to `<data_root>/quarantine/<kind>/<key>-<UTC time>/` with a
`quarantine.json` saying what was wrong, and the stage rebuilds it under the same key. When only the Arrow copy is
damaged, the Parquet parts are intact: the copy alone is moved to `<key>-<UTC time>-hf/` there and rebuilt from them
(`repair_arrow_copy`), and the dataset is reused.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq

from cse.storage.arrow_copy import check_arrow_copy, compare_arrow_copy, in_copy, rebuild_arrow_copy
from cse.storage.atomic import write_json
from cse.storage.hashing import combine_hashes, sha256_file
from cse.storage.manifest import MANIFEST_NAME, Manifest, ManifestError
from cse.storage.seal import check_seal

log = logging.getLogger(__name__)

DAMAGED_MARKER = "damaged.json"  # written into a dataset folder by `cse verify`: the next stage run rebuilds it
QUARANTINE_DIR = "quarantine"
QUARANTINE_RECORD = "quarantine.json"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a published dataset: which dataset, which file, what."""

    kind: str
    key: str
    file: str  # the damaged file's path (the manifest or the folder when no single file is to blame)
    reason: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.key}: {self.file}: {self.reason}"


_WARNED: set[str] = set()  # the damaged datasets (kind/key) this process warned about


def warn_damaged_once(dataset: str, problems: list[Problem] | str) -> None:
    """One warning per damaged dataset per process: a command that refreshes the catalog or lists a kind several
    times says it once (`cse verify` and the table `damaged_datasets` list every problem)."""
    what = problems if isinstance(problems, str) else "; ".join(f"{p.file}: {p.reason}" for p in problems)
    if dataset in _WARNED:
        return
    _WARNED.add(dataset)
    log.warning("catalog: left out damaged dataset %s: %s (`cse verify` checks the data root)", dataset, what)


class DatasetDamaged(RuntimeError):
    """A dataset failed verification; the message names its kind, key and the damaged files."""

    def __init__(self, problems: list[Problem], quarantined: Path | None = None):
        self.problems, self.quarantined = problems, quarantined
        p = problems[0]
        msg = f"dataset {p.kind}/{p.key} is damaged: " + "; ".join(f"{q.file}: {q.reason}" for q in problems)
        if quarantined is not None:
            msg += f" (moved to {quarantined}; run the stage again to rebuild it)"
        super().__init__(msg)


@dataclass
class Quarantined:
    """What a stage logs when it moved a damaged dataset aside before rebuilding it."""

    kind: str
    key: str
    moved_to: str
    problems: list[dict] = field(default_factory=list)

    def summary(self) -> str:
        return "; ".join(f"{p['file']}: {p['reason']}" for p in self.problems)


def _fmt(n: int) -> str:
    return f"{n:,d}"


Finding = tuple[Path | str, str]  # (the damaged file, what is wrong with it): a `Problem` without its dataset


def check_dataset(folder: str | Path, kind: str, key: str, full: bool = False, marker: bool = True) -> list[Problem]:
    """Everything wrong with the published dataset in `folder` ([] when intact). See the module docstring.
    `marker=False` leaves an earlier `cse verify` mark out (a full check that finds everything again).
    The checks run in order, each a function of its own; the full checks (`full`) run only while nothing is found."""
    folder = Path(folder)
    mpath = folder / MANIFEST_NAME
    if not mpath.is_file():
        return [Problem(kind, key, str(mpath), "manifest missing: the folder is not a complete dataset")]
    try:
        m = Manifest.read(folder)
    except ManifestError as e:
        return [Problem(kind, key, str(mpath), str(e).removeprefix(f"{mpath}: "))]
    found = _marker_findings(folder) if marker else []
    found += _manifest_findings(folder, m, kind, key)
    found += _part_findings(folder, m)
    if full and not found:
        found += _hash_findings(folder, m)
    found += check_arrow_copy(folder, m, full=full and not found)
    if full and not found:
        found += compare_arrow_copy(folder, m)
    return [Problem(kind, key, str(file), reason) for file, reason in found]


def _marker_findings(folder: Path) -> list[Finding]:
    """What the `damaged.json` marker an earlier `cse verify` left in `folder` lists (the marker itself when it lists
    nothing readable); [] without a marker."""
    mark = folder / DAMAGED_MARKER
    if not mark.is_file():
        return []
    found: list[Finding] = []
    try:
        listed = json.loads(mark.read_text()).get("problems", [])
        for p in listed:
            found.append((p.get("file", mark), f"{p.get('reason', 'marked damaged')} (found by `cse verify`)"))
    except (ValueError, OSError):
        listed = []
    if not listed:
        found.append((mark, "marked damaged by `cse verify`"))
    return found


def _manifest_findings(folder: Path, m: Manifest, kind: str, key: str) -> list[Finding]:
    """Whether the manifest `m` read from `folder` names this dataset and matches its seal (storage/seal.py)."""
    mpath = folder / MANIFEST_NAME
    found: list[Finding] = []
    if (m.kind, m.key) != (kind, key):
        found.append((mpath, f"manifest says {m.kind}/{m.key}, the folder is {kind}/{key}"))
    try:
        raw = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:  # read a moment ago: changed since
        raw = {}
        found.append((mpath, f"unreadable manifest ({type(e).__name__})"))
    if (seal_problem := check_seal(folder, raw)) is not None:
        found.append((mpath, seal_problem))
    return found


def _part_findings(folder: Path, m: Manifest) -> list[Finding]:
    """Whether every file the manifest lists is there with its recorded size and (Parquet parts) rows, and the rows
    add up to the manifest's."""
    found: list[Finding] = []
    total, readable = 0, True
    for name in m.files:
        p = folder / name
        if not p.is_file():
            found.append((p, "missing"))
            readable = False
            continue
        size = p.stat().st_size
        if name in m.file_sizes and size != m.file_sizes[name]:
            recorded = _fmt(m.file_sizes[name])
            found.append((p, f"{_fmt(size)} bytes, the manifest records {recorded} (truncated or overwritten)"))
        if not name.endswith(".parquet"):  # a model file of a generator dataset: size (and hash with full) only
            continue
        try:
            rows = pq.ParquetFile(p).metadata.num_rows
        except Exception as e:  # noqa: BLE001 - ArrowInvalid, OSError, whatever a damaged file raises: reported, not raised
            found.append((p, f"unreadable Parquet ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"))
            readable = False
            continue
        if name in m.file_rows and rows != m.file_rows[name]:
            found.append((p, f"{_fmt(rows)} rows, the manifest records {_fmt(m.file_rows[name])}"))
        total += rows
    if readable and total != m.rows:
        found.append(
            (folder / MANIFEST_NAME, f"the files hold {_fmt(total)} rows, the manifest records {_fmt(m.rows)}")
        )
    return found


def _hash_findings(folder: Path, m: Manifest) -> list[Finding]:
    """The full check of the listed files: the sha256 of each against the manifest's per-file hashes, and of all of
    them against its content hash."""
    digests = [sha256_file(folder / name) for name in m.files]
    per_file = [(name, d) for name, d in zip(m.files, digests) if name in m.file_hashes and d != m.file_hashes[name]]
    found: list[Finding] = [
        (folder / name, f"content hash {d[:12]}… differs from the manifest's {m.file_hashes[name][:12]}…")
        for name, d in per_file
    ]
    if not per_file and combine_hashes(digests) != m.content_hash:
        if m.file_hashes:  # every file matches its own hash: the manifest's content hash was changed
            found.append(
                (folder / MANIFEST_NAME, f"content hash {m.content_hash[:12]}… does not match its own per-file hashes")
            )
        else:  # an older manifest without per-file hashes: name every file
            found.append(
                (
                    folder / m.files[0] if len(m.files) == 1 else folder,
                    f"content hash differs from the manifest's {m.content_hash[:12]}… (files: {', '.join(m.files)}; "
                    "this manifest records no per-file hashes)",
                )
            )
    return found


def copy_only(folder: str | Path, problems: list[Problem]) -> bool:
    """Whether every problem lies in the dataset's Arrow copy (`hf/`): the Parquet parts are intact and the copy can
    be rebuilt from them (`repair_arrow_copy`) instead of rebuilding the dataset."""
    return bool(problems) and all(in_copy(folder, p.file) for p in problems)


def repair_arrow_copy(
    data_root: str | Path, folder: str | Path, kind: str, key: str, problems: list[Problem]
) -> tuple[Manifest, Quarantined]:
    """Move a damaged Arrow copy (`folder/hf`) to `<data_root>/quarantine/<kind>/<key>-<time>-hf/` (one rename, with
    `quarantine.json`), rebuild it from the intact Parquet parts and drop a `cse verify` marker that named only it.
    The caller holds the dataset's build lock and found `copy_only(folder, problems)`."""
    from cse.storage.arrow_copy import ARROW_DIR

    folder = Path(folder)
    dest = quarantine_path(Path(data_root), kind, key)
    dest = dest.with_name(f"{dest.name}-{ARROW_DIR}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if (folder / ARROW_DIR).exists():
        os.rename(folder / ARROW_DIR, dest)
    else:
        dest.mkdir()
    record = _record(
        dest,
        folder / ARROW_DIR,
        kind,
        key,
        problems,
        what="the Arrow copy only; the Parquet parts were intact and kept",
    )
    (folder / DAMAGED_MARKER).unlink(missing_ok=True)
    m = rebuild_arrow_copy(folder)
    log.warning(
        "the Arrow copy of dataset %s/%s was damaged (%s): moved to %s and rebuilt from the Parquet parts",
        kind,
        key,
        record.summary(),
        dest,
    )
    return m, record


def mark_damaged(folder: str | Path, problems: list[Problem]) -> Path:
    """Leave a `damaged.json` marker in the dataset folder: the next stage run that needs it quarantines and
    rebuilds it (the files themselves are not touched)."""
    return write_json(
        {"problems": [asdict(p) for p in problems], "found": datetime.now(UTC).isoformat()},
        Path(folder) / DAMAGED_MARKER,
    )


def quarantine_path(data_root: Path, kind: str, key: str) -> Path:
    """A fresh, timestamped quarantine location for a damaged dataset.

    Args:
        data_root: the data root folder.
        kind: the dataset kind.
        key: the dataset key.

    Returns:
        The path under the quarantine folder to move the dataset to.
    """
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    return data_root / QUARANTINE_DIR / kind / f"{key}-{stamp}"


def _record(dest: Path, moved: Path, kind: str, key: str, problems: list[Problem], **extra: str) -> Quarantined:
    """Write `quarantine.json` into `dest`: what was moved there from where, when, by which process and why."""
    record = Quarantined(kind=kind, key=key, moved_to=str(dest), problems=[asdict(p) for p in problems])
    write_json(
        {**asdict(record), "from": str(moved), "when": datetime.now(UTC).isoformat(), "pid": os.getpid(), **extra},
        dest / QUARANTINE_RECORD,
    )
    return record


def quarantine(
    data_root: str | Path, folder: str | Path, kind: str, key: str, problems: list[Problem]
) -> Quarantined | None:
    """Move a damaged dataset folder to the quarantine (one rename, nothing deleted) and record why there.
    None when the folder is already gone (another process moved it)."""
    folder = Path(folder)
    dest = quarantine_path(Path(data_root), kind, key)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(folder, dest)
    except FileNotFoundError:
        return None
    record = _record(dest, folder, kind, key, problems)
    log.warning("dataset %s/%s is damaged (%s): moved to %s; it is rebuilt", kind, key, record.summary(), dest)
    return record
