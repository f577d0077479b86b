"""Datasets built in shards: the storage half of the tokenisation and corruption stages.

A sharded build turns one input dataset (its `source`) into a dataset of `kind` under `key`. Shard i covers
the input rows `shard_range(i)` (`shard_size` rows each, the last one short) and is written, atomically, as
`datasets/<kind>/<key>.shards/shard-NNNNN.parquet` (`DataRoot.shards_dir`); a shard file already there is
reused as it is, so a rerun after a crash computes only the missing shards. Publishing links the finished
shards, in order, into the dataset folder with its manifest (`cse.storage.datasets.publish_files`) and removes the
work folder. Leftover `.tmp-*` shard files of killed writers are removed under the build lock
(`DataRoot.building` → `DataRoot.clean_stale`).

A plan is small and serialisable: shard tasks may run in any process or on any Dask worker that sees the data
root at the same path (`DataRoot.visible`). What a shard computes is the stage's business (tasks/tokenize.py,
tasks/corrupt.py): `build_shard` hands it the input rows and writes what it returns.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from cse.storage.atomic import write_parquet
from cse.storage.datasets import DatasetRef, publish_files
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest


def shard_name(shard: int) -> str:
    """The file name of shard `shard` (`shard-00000.parquet`).

    Args:
        shard: the shard index.

    Returns:
        The shard file name.
    """
    return f"shard-{shard:05d}.parquet"


def shard_path(root: DataRoot, kind: str, key: str, shard: int) -> Path:
    """The work file of shard `shard` of dataset `kind/key` (present once the shard is finished)."""
    return root.shards_dir(kind, key) / shard_name(shard)


def remove_shards(root: DataRoot, kind: str, key: str) -> None:
    """Remove the work folder of dataset `kind/key` (its shard files and any temporaries in it)."""
    shutil.rmtree(root.shards_dir(kind, key), ignore_errors=True)


def part_rows(root: DataRoot, kind: str, key: str) -> list[int]:
    """The row count of every part of the complete dataset `kind/key`, in order (from the Parquet footers)."""
    return [pq.ParquetFile(p).metadata.num_rows for p in root.require(kind, key).paths(root.dataset_dir(kind, key))]


def read_rows(
    root: DataRoot,
    source: DatasetRef,
    rows_per_part: Sequence[int],
    start: int,
    stop: int,
    columns: Sequence[str],
    planned_for: str = "",
) -> pa.Table:
    """Rows [start, stop) of dataset `source` (its `columns`), reading only the parts that overlap them.

    `rows_per_part` are the part sizes read when the work was planned: the dataset must still be the one planned
    (same content hash), else a RuntimeError naming it (and `planned_for`, what the rows are read for)."""
    m = root.require(source.kind, source.key)
    if m.content_hash != source.content_hash:
        raise RuntimeError(f"{source.kind} dataset {source.key} changed since {planned_for or 'the work'} was planned")
    paths = m.paths(root.dataset_dir(source.kind, source.key))
    pieces, offset = [], 0
    for path, n in zip(paths, rows_per_part, strict=True):
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            pieces.append(pq.read_table(path, columns=list(columns)).slice(lo - offset, hi - lo))
        offset += n
    if not pieces:
        return pq.read_schema(paths[0]).empty_table().select(list(columns))
    return pa.concat_tables(pieces).combine_chunks()


class ShardedPlan(BaseModel):
    """What the shard tasks of one sharded build need. Subclasses set `kind` and `output_schema` (of the output) and
    define `shard_size`; they add what their computation needs."""

    kind: ClassVar[str]
    output_schema: ClassVar[pa.Schema]

    key: str  # of the output dataset
    data_root: str  # where the plan was made: shard tasks read and write there, whatever their own settings say
    source: DatasetRef  # the input dataset
    part_rows: list[int]  # rows of each part of the input (`part_rows`)

    @property
    def shard_size(self) -> int:
        raise NotImplementedError

    @property
    def rows(self) -> int:
        """Input rows to cover."""
        return self.source.rows

    @property
    def n_shards(self) -> int:
        return max(1, math.ceil(self.rows / self.shard_size))

    def shard_range(self, shard: int) -> tuple[int, int]:
        """The input rows [start, stop) of shard `shard`."""
        if not 0 <= shard < self.n_shards:
            raise IndexError(f"shard {shard} out of range: {self.n_shards} shards")
        start = shard * self.shard_size
        return start, min(start + self.shard_size, self.rows)

    def root(self) -> DataRoot:
        """The data root the plan was made in; a worker that does not see it fails saying so."""
        return DataRoot.visible(self.data_root, f"{self.kind} {self.key}")

    def shard_path(self, shard: int) -> Path:
        return shard_path(self.root(), self.kind, self.key, shard)


def build_shard(
    plan: ShardedPlan, shard: int, columns: Sequence[str], compute: Callable[[pa.Table], pa.Table]
) -> tuple[pa.Table, bool]:
    """(The shard's table, whether it was computed now). A shard file already there is read back as it is;
    otherwise `compute` gets the shard's input rows (`columns` of them) and what it returns is written atomically
    in the plan's schema."""
    root = plan.root()
    path = shard_path(root, plan.kind, plan.key, shard)
    if path.is_file():
        return pq.read_table(path), False
    rows = read_rows(
        root,
        plan.source,
        plan.part_rows,
        *plan.shard_range(shard),
        columns=columns,
        planned_for=f"{plan.kind} {plan.key}",
    )
    table = compute(rows)
    write_parquet(table, path, plan.output_schema)
    return table, True


class ShardDone(BaseModel):
    """What a shard task returns (stages add their counts): its number and whether it was computed now (False:
    its file was reused)."""

    shard: int
    computed: bool


Done = TypeVar("Done", bound=ShardDone)


def publish_shards(
    root: DataRoot,
    plan: ShardedPlan,
    done: Sequence[Done],
    *,
    params: dict[str, Any],
    stats: Callable[[list[Done]], dict[str, Any]],
) -> Manifest:
    """Publish the finished shards of `plan` as the parts of dataset `kind/key`, in shard order, with a manifest
    recording `params`, the input (`source`, `inputs`) and `stats(done in shard order)`; then remove the work
    folder. Every shard 0..n-1 must be done and its file present (ValueError / FileNotFoundError otherwise)."""
    done = sorted(done, key=lambda d: d.shard)
    if [d.shard for d in done] != list(range(plan.n_shards)):
        raise ValueError(
            f"{plan.kind} {plan.key}: expected shards 0..{plan.n_shards - 1}, got {[d.shard for d in done]}"
        )
    files = [shard_path(root, plan.kind, plan.key, d.shard) for d in done]
    if missing := [str(f) for f in files if not f.is_file()]:
        raise FileNotFoundError(f"{plan.kind} {plan.key}: shard files vanished before publishing: {missing}")
    manifest = publish_files(
        root,
        plan.kind,
        plan.key,
        files,
        params=params,
        source={"kind": plan.source.kind, "key": plan.source.key},
        inputs={plan.source.kind: plan.source.content_hash},
        stats=stats(done),
    )
    remove_shards(root, plan.kind, plan.key)
    return manifest


@contextmanager
def building(plan: ShardedPlan) -> Iterator[None]:
    """Hold the output dataset's build lock (`DataRoot.building`) from planning to publishing: concurrent flows
    that need the same dataset compute it once."""
    with plan.root().building(plan.kind, plan.key):
        yield
