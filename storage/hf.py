"""Published datasets as Hugging Face `datasets.Dataset`s and as Arrow tables, memory-mapped, never copied.

Every dataset folder holds an Arrow copy of its Parquet parts in HF's `save_to_disk` layout (`<folder>/hf/`,
storage/arrow_copy.py), so

    import datasets; ds = datasets.load_from_disk("<data_root>/datasets/<kind>/<key>/hf", keep_in_memory=False)

opens it memory-mapped (`cse dataset KIND [KEY] --hf` prints that line for a dataset). Training reads its rows from the
same files (`open_arrow_table`, storage/training_data.py). A dataset published before the copy existed gets it on
first open: built from its Parquet parts under the dataset's build lock, published by one rename, recorded in its
manifest (key and content hash unchanged).

`find_dataset` is the cheap part (the manifest only): folder, content hash, rows, schema and the one-liner, for
callers that record a dataset (MLflow dataset inputs) without opening it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from cse.storage.arrow_copy import ARROW_DIR, copy_present, in_copy, open_arrow_files, rebuild_arrow_copy
from cse.storage.integrity import DatasetDamaged, check_dataset, repair_arrow_copy
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest

if TYPE_CHECKING:
    import datasets


@dataclass(frozen=True)
class PublishedDataset:
    """A complete dataset of the data root, as its manifest describes it (nothing else is read)."""

    kind: str
    key: str
    folder: Path  # <data_root>/datasets/<kind>/<key>
    manifest: Manifest

    @property
    def content_hash(self) -> str:
        """The hash of the Parquet parts (the one stage keys and run keys are computed from)."""
        return self.manifest.content_hash

    @property
    def rows(self) -> int:
        return self.manifest.rows

    @property
    def hf_folder(self) -> Path:
        """The Arrow copy in HF's `save_to_disk` layout (what `datasets.load_from_disk` opens)."""
        return self.folder / ARROW_DIR

    @property
    def parquet_files(self) -> list[Path]:
        return self.manifest.paths(self.folder)

    def arrow_schema(self) -> pa.Schema:
        """The dataset's Arrow schema, from the first Parquet part's footer (a few KB read)."""
        return pq.read_schema(self.parquet_files[0])

    def snippet(self) -> str:
        """One line of Python that opens the dataset as an HF `Dataset`, memory-mapped."""
        return f"import datasets; ds = datasets.load_from_disk({str(self.hf_folder)!r}, keep_in_memory=False)"


def find_dataset(root: DataRoot, kind: str, key: str | None = None) -> PublishedDataset:
    """The complete dataset `kind/key`, or with `key` None the newest of `kind` (as `cse` and the evaluation inputs
    pick it). A key that is not one safe name is refused (`cse.storage.paths.PathRefused`); a dataset that is there but
    damaged is `DatasetDamaged` naming the file; FileNotFoundError naming the kind (and the newest keys there are)
    when there is none."""
    if key is None:
        found = root.list(kind)
        if not found:
            damaged = [p for folder in root.dataset_dirs(kind) for p in check_dataset(folder, kind, folder.name)[:1]]
            if damaged:
                raise DatasetDamaged(damaged[-1:]) from FileNotFoundError(
                    f"no intact {kind} dataset under {root.root}: {len(damaged)} damaged"
                )
            raise FileNotFoundError(f"no {kind} dataset under {root.root}: run the stage that produces it first")
        folder, latest = found[-1]
        return PublishedDataset(kind, latest.key, folder, latest)
    m = root.find(kind, key)
    if m is None:
        if root.dataset_dir(kind, key).is_dir() and (problems := check_dataset(root.dataset_dir(kind, key), kind, key)):
            raise DatasetDamaged(problems)  # there, but damaged: not "missing"
        newest = [mm.key for _, mm in root.list(kind)[-5:]][::-1]
        raise FileNotFoundError(
            f"no {kind} dataset {key!r} under {root.root}"
            + (f" (newest: {', '.join(newest)})" if newest else f": no {kind} dataset at all")
        )
    return PublishedDataset(kind, key, root.dataset_dir(kind, key), m)


def ensure_arrow_copy(root: DataRoot, kind: str, key: str | None = None) -> PublishedDataset:
    """The dataset with its Arrow copy present: a dataset without one (published before it existed, or its copy
    gone or cut short) gets it now, under the dataset's build lock, after a cheap check of its Parquet parts
    (`DatasetDamaged` when they are damaged); a damaged copy is moved to the quarantine first. Do not call it while
    holding that dataset's build lock (`DataRoot.building`)."""
    ds = find_dataset(root, kind, key)
    if copy_present(ds.folder, ds.manifest):
        return ds
    with root.building(kind, ds.key):
        m = Manifest.read(ds.folder)  # another process may have built it while we waited
        if not copy_present(ds.folder, m):
            problems = check_dataset(ds.folder, kind, ds.key)
            if parts := [p for p in problems if not in_copy(ds.folder, p.file)]:
                raise DatasetDamaged(parts)
            if m.arrow is not None and problems:
                m, _ = repair_arrow_copy(root.root, ds.folder, kind, ds.key, problems)
            else:
                m = rebuild_arrow_copy(ds.folder)
    return PublishedDataset(kind, ds.key, ds.folder, m)


def open_arrow_table(root: DataRoot, kind: str, key: str | None = None) -> pa.Table:
    """Every row of the dataset as one Arrow table whose buffers are memory-mapped from its Arrow copy (the parts in
    order; the copy is built first when missing)."""
    ds = ensure_arrow_copy(root, kind, key)
    return open_arrow_files(ds.folder, ds.manifest)


def open_hf_dataset(root: DataRoot, kind: str, key: str | None = None) -> datasets.Dataset:
    """The dataset as an HF `datasets.Dataset`, memory-mapped from its Arrow copy (no copy in memory; the copy on
    disk is built first when missing). `key` None: the newest dataset of `kind`."""
    import datasets

    ds = ensure_arrow_copy(root, kind, key)
    return datasets.load_from_disk(str(ds.hf_folder), keep_in_memory=False)
