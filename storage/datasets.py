"""Writing and reading whole datasets: Parquet parts + their Arrow copy + manifest, atomically, addressed by key.

Every published dataset also carries its memory-mappable Arrow copy (`hf/`, storage/arrow_copy.py), written in the
same temporary folder and published by the same rename; storage/hf.py opens it (as an HF `Dataset` or an Arrow
table) without copying."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from pydantic import BaseModel

from cse.storage.arrow_copy import write_arrow_copy
from cse.storage.atomic import atomic_dir, write_parquet
from cse.storage.hashing import sha256_files
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest, file_facts


def part_name(i: int) -> str:
    """The file name of part `i` of a dataset (`part-00000.parquet`).

    Args:
        i: the part index.

    Returns:
        The part file name.
    """
    return f"part-{i:05d}.parquet"


def write_dataset(
    root: DataRoot,
    kind: str,
    key: str,
    parts: Iterable[pa.Table],
    schema: pa.Schema,
    *,
    params: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
    inputs: Mapping[str, str] | None = None,
    stats: Mapping[str, Any] | None = None,
) -> Manifest:
    """Write parts into a fresh folder and publish it (with its manifest) by one rename."""
    final = root.dataset_dir(kind, key)
    with atomic_dir(final) as tmp:
        files, rows = [], 0
        for i, t in enumerate(parts):
            write_parquet(t, tmp / part_name(i), schema)
            files.append(part_name(i))
            rows += t.num_rows
        if not files:  # an empty dataset still has one (empty) part with the schema
            write_parquet(schema.empty_table(), tmp / part_name(0), schema)
            files.append(part_name(0))
        return _write_manifest(tmp, kind, key, files, rows, params, source, inputs, stats)


def publish_files(
    root: DataRoot,
    kind: str,
    key: str,
    files: list[Path],
    *,
    params: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
    inputs: Mapping[str, str] | None = None,
    stats: Mapping[str, Any] | None = None,
) -> Manifest:
    """Publish finished Parquet files (already in the kind's schema) as parts of a dataset.

    The files are hard-linked (copied where links fail) into a fresh folder, which is published with
    its Arrow copy and manifest by one rename; the originals stay where they are.
    """
    if not files:
        raise ValueError(f"nothing to publish for {kind}/{key}: no files")
    final = root.dataset_dir(kind, key)
    with atomic_dir(final) as tmp:
        names, rows = [], 0
        for i, f in enumerate(files):
            target = tmp / part_name(i)
            try:
                os.link(f, target)
            except OSError:
                shutil.copyfile(f, target)
            names.append(target.name)
            rows += pq.ParquetFile(target).metadata.num_rows
        return _write_manifest(tmp, kind, key, names, rows, params, source, inputs, stats)


def _write_manifest(
    tmp: Path,
    kind: str,
    key: str,
    files: list[str],
    rows: int,
    params: Mapping[str, Any] | None,
    source: Mapping[str, Any] | None,
    inputs: Mapping[str, str] | None,
    stats: Mapping[str, Any] | None,
) -> Manifest:
    """The manifest of the parts `files` in the unpublished folder `tmp` (their facts and Arrow copy), written there."""
    facts = file_facts(tmp, files)
    m = Manifest(
        kind=kind,
        key=key,
        rows=rows,
        files=files,
        **facts,
        arrow=write_arrow_copy(tmp, files, kind=kind, key=key, content_hash=facts["content_hash"]),
        params=dict(params or {}),
        source=dict(source or {}),
        inputs=dict(inputs or {}),
        stats=dict(stats or {}),
    )
    m.write(tmp)
    return m


def dataset_files(root: DataRoot, kind: str, key: str) -> list[Path]:
    """The part files of an existing dataset, as listed in its manifest.

    Args:
        root: the data root.
        kind: the dataset kind.
        key: the dataset key.

    Returns:
        The absolute paths of the dataset's files.
    """
    m = root.require(kind, key)
    return m.paths(root.dataset_dir(kind, key))


def read_dataset(
    root: DataRoot, kind: str, key: str, columns: list[str] | None = None, filter: pads.Expression | None = None
) -> pa.Table:
    """The whole dataset as one Arrow table (parts in order)."""
    files = [str(p) for p in dataset_files(root, kind, key)]
    if filter is None and len(files) == 1:
        return pq.read_table(files[0], columns=columns)
    return pads.dataset(files, format="parquet").to_table(columns=columns, filter=filter)


class DatasetRef(BaseModel):
    """What a stage returns: the address of a dataset, never the data itself."""

    kind: str
    key: str
    path: str
    rows: int
    content_hash: str
    cache_hit: bool = False

    @classmethod
    def of(cls, root: DataRoot, m: Manifest, cache_hit: bool) -> DatasetRef:
        return cls(
            kind=m.kind,
            key=m.key,
            path=str(root.dataset_dir(m.kind, m.key)),
            rows=m.rows,
            content_hash=m.content_hash,
            cache_hit=cache_hit,
        )


@dataclass(frozen=True)
class EvaluationInput:
    """An evaluation input (`resolve_input`): its table, with where it came from (a dataset or a folder) and its
    content hash."""

    table: pa.Table
    origin: str  # "dataset" | "folder"
    location: str  # dataset key or folder path
    content_hash: str


InputT = TypeVar("InputT", bound=EvaluationInput)


def resolve_input(
    root: DataRoot | None,
    kind: str,
    spec: str | None,
    *,
    cls: type[InputT],
    read_folder: Callable[[Path], tuple[pa.Table, str | Path, Iterable[Path]]],
    verify: bool = False,
    default: Callable[[Callable[[Path], InputT]], InputT | None] | None = None,
    no_default: Callable[[DataRoot], str],
    not_found: Callable[[DataRoot], str],
) -> InputT:
    """An evaluation input `cls` of `kind` from `spec`: an existing folder (`read_folder(folder)` gives its table, the
    data folder it found there and the files it read, hashed), else a dataset key of `kind` (with `verify`, fully
    verified first: scores must come from intact data, a damaged dataset is named: `DatasetDamaged`). `spec=None`:
    `default(from_folder)` when it gives one, else the newest dataset of `kind`, else a FileNotFoundError saying
    `no_default(root)`; an unknown `spec` raises FileNotFoundError saying `not_found(root)` (messages are built only
    when raised: `root` may be None while a folder serves; a dataset asked for without one is a ValueError)."""

    def data_root() -> DataRoot:
        if root is None:
            raise ValueError(f"no data root given: the {kind} input must be a folder (got {spec!r})")
        return root

    def from_folder(folder: Path) -> InputT:
        table, location, files = read_folder(folder)
        return cls(table=table, origin="folder", location=str(location), content_hash=sha256_files(files))

    def from_dataset(m: Manifest) -> InputT:
        if verify:
            data_root().verify(kind, m.key, full=True)
        table = read_dataset(data_root(), kind, m.key)
        return cls(table=table, origin="dataset", location=m.key, content_hash=m.content_hash)

    if spec is None:
        if default is not None and (found_default := default(from_folder)) is not None:
            return found_default
        found = data_root().list(kind)
        if found:
            return from_dataset(found[-1][1])
        raise FileNotFoundError(no_default(data_root()))
    path = Path(spec).expanduser()
    if path.is_dir():
        return from_folder(path)
    m = data_root().find(kind, spec)
    if m is None:
        raise FileNotFoundError(not_found(data_root()))
    return from_dataset(m)
