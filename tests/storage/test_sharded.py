"""storage/sharded.py: shard ranges, reading a row range, building shards once, publishing them as a dataset."""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cse.storage import schemas
from cse.storage.atomic import TMP_PREFIX
from cse.storage.datasets import DatasetRef, read_dataset, write_dataset
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest
from cse.storage.sharded import (
    ShardDone,
    ShardedPlan,
    build_shard,
    building,
    part_rows,
    publish_shards,
    read_rows,
    shard_path,
)

PARTS = (7, 3, 5)  # the input dataset's parts: 15 rows


class LengthsPlan(ShardedPlan):
    """A toy stage: one tokens row per input sentence, its `input_ids` the sentence's character codes."""

    kind: ClassVar[str] = "tokens"
    output_schema: ClassVar[pa.Schema] = schemas.TOKENS

    size: int

    @property
    def shard_size(self) -> int:
        return self.size


class Done(ShardDone):
    rows: int


def _compute(rows: pa.Table) -> pa.Table:
    texts = rows.column("text").to_pylist()
    return pa.table(
        {
            "id": rows.column("id"),
            "column": ["text"] * len(texts),
            "input_ids": [[ord(c) for c in t] for t in texts],
            "length": np.array([len(t) for t in texts], dtype=np.int64),
        }
    )  # cast to int16 when written


@pytest.fixture
def root(tmp_path) -> DataRoot:
    return DataRoot(tmp_path / "data")


@pytest.fixture
def source(root) -> DatasetRef:
    parts, start = [], 0
    for n in PARTS:
        parts.append(
            pa.table(
                {
                    "id": pa.array(range(start, start + n), pa.int64()),
                    "text": [f"s{i}" for i in range(start, start + n)],
                },
                schema=schemas.WIKI1M,
            )
        )
        start += n
    return DatasetRef.of(root, write_dataset(root, "wiki1m", "src", parts, schemas.WIKI1M), cache_hit=False)


def _plan(root: DataRoot, source: DatasetRef, size: int = 4, key: str = "out") -> LengthsPlan:
    return LengthsPlan(
        key=key, data_root=str(root.root), source=source, size=size, part_rows=part_rows(root, source.kind, source.key)
    )


def test_shard_ranges_cover_the_rows_once(root, source):
    plan = _plan(root, source)
    assert plan.rows == 15 and plan.n_shards == 4
    assert [plan.shard_range(i) for i in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 15)]
    for bad in (4, -1):
        with pytest.raises(IndexError, match=f"shard {bad} out of range: 4 shards"):
            plan.shard_range(bad)
    empty = plan.model_copy(update={"source": source.model_copy(update={"rows": 0})})
    assert empty.n_shards == 1 and empty.shard_range(0) == (0, 0)


def test_part_rows_and_shard_paths(root, source):
    assert part_rows(root, "wiki1m", "src") == list(PARTS)
    plan = _plan(root, source)
    assert shard_path(root, "tokens", "out", 12) == root.shards_dir("tokens", "out") / "shard-00012.parquet"
    assert plan.shard_path(3) == shard_path(root, "tokens", "out", 3)


def test_read_rows_spans_parts_and_reads_only_those_it_needs(root, source):
    rows = read_rows(root, source, PARTS, 5, 11, ["id", "text"])
    assert rows.column("id").to_pylist() == list(range(5, 11))
    assert rows.column("text").to_pylist() == [f"s{i}" for i in range(5, 11)]
    assert rows.column_names == ["id", "text"]

    # part 0 (rows 0..6) damaged: rows of the later parts still read, rows of part 0 do not
    part0 = root.dataset_dir("wiki1m", "src") / "part-00000.parquet"
    part0.write_bytes(b"not parquet")
    assert read_rows(root, source, PARTS, 7, 15, ["id"]).column("id").to_pylist() == list(range(7, 15))
    with pytest.raises(Exception, match="part-00000.parquet|Parquet|magic"):
        read_rows(root, source, PARTS, 6, 8, ["id"])


def test_read_rows_of_an_empty_range_keeps_the_columns(root, source):
    rows = read_rows(root, source, PARTS, 15, 15, ["id", "text"])
    assert rows.num_rows == 0 and rows.schema.names == ["id", "text"]
    assert rows.schema.field("id").type == pa.int64()


def test_read_rows_refuses_a_dataset_changed_since_planning(root, source):
    stale = source.model_copy(update={"content_hash": "0" * 64})
    with pytest.raises(RuntimeError, match="wiki1m dataset src changed since tokens out was planned"):
        read_rows(root, stale, PARTS, 0, 3, ["id"], planned_for="tokens out")


def test_build_shard_computes_once_then_reuses_the_file(root, source):
    plan = _plan(root, source)
    calls = []

    def compute(rows):
        calls.append(rows.column("id").to_pylist())
        return _compute(rows)

    table, computed = build_shard(plan, 1, ["id", "text"], compute)
    assert computed and calls == [[4, 5, 6, 7]]
    path = plan.shard_path(1)
    written = pq.read_table(path)
    assert written.schema.equals(schemas.TOKENS)  # cast to the plan's schema (length int64 → int16)
    assert written.column("input_ids").to_pylist() == [[ord(c) for c in f"s{i}"] for i in range(4, 8)]
    mtime = path.stat().st_mtime_ns

    again, computed = build_shard(plan, 1, ["id", "text"], compute)
    assert not computed and calls == [[4, 5, 6, 7]]  # not computed again
    assert again.equals(written) and path.stat().st_mtime_ns == mtime


def test_a_failing_shard_leaves_no_file(root, source):
    plan = _plan(root, source)

    def boom(rows):
        raise RuntimeError("killed mid-shard")

    with pytest.raises(RuntimeError, match="killed mid-shard"):
        build_shard(plan, 0, ["id", "text"], boom)
    assert not plan.shard_path(0).exists()
    folder = root.shards_dir("tokens", "out")
    assert not folder.exists() or not [p for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)]


def _build_all(plan: LengthsPlan) -> list[Done]:
    done = []
    for i in range(plan.n_shards):
        table, computed = build_shard(plan, i, ["id", "text"], _compute)
        done.append(Done(shard=i, computed=computed, rows=table.num_rows))
    return done


def test_publish_shards_makes_the_dataset_in_shard_order(root, source):
    plan = _plan(root, source)
    done = _build_all(plan)
    shard_bytes = [plan.shard_path(i).read_bytes() for i in range(plan.n_shards)]
    seen = []

    def stats(ordered):
        seen.append([d.shard for d in ordered])
        return {"rows_per_shard": [d.rows for d in ordered]}

    m = publish_shards(root, plan, list(reversed(done)), params={"p": 1}, stats=stats)
    assert seen == [[0, 1, 2, 3]]
    assert m == Manifest.read(root.dataset_dir("tokens", "out")) and root.require("tokens", "out") == m
    assert (m.kind, m.key, m.rows, m.params, m.stats) == (
        "tokens",
        "out",
        15,
        {"p": 1},
        {"rows_per_shard": [4, 4, 4, 3]},
    )
    assert m.source == {"kind": "wiki1m", "key": "src"} and m.inputs == {"wiki1m": source.content_hash}
    assert [p.read_bytes() for p in m.paths(root.dataset_dir("tokens", "out"))] == shard_bytes
    assert m.files == [f"part-{i:05d}.parquet" for i in range(4)]
    assert read_dataset(root, "tokens", "out").column("id").to_pylist() == list(range(15))
    assert not root.shards_dir("tokens", "out").exists()  # the work folder is removed


def test_publish_refuses_missing_shards(root, source):
    plan = _plan(root, source)
    done = _build_all(plan)
    with pytest.raises(ValueError, match=r"tokens out: expected shards 0\.\.3, got \[0, 1, 3\]"):
        publish_shards(root, plan, [done[0], done[1], done[3]], params={}, stats=lambda d: {})
    plan.shard_path(2).unlink()
    with pytest.raises(
        FileNotFoundError, match=r"tokens out: shard files vanished before publishing: .*shard-00002\.parquet"
    ):
        publish_shards(root, plan, done, params={}, stats=lambda d: {})
    assert root.find("tokens", "out") is None  # nothing published
    assert plan.shard_path(1).is_file()  # the finished shards stay for the rerun


def test_a_plan_on_an_unseen_data_root_fails_naming_it(root, source, tmp_path):
    plan = _plan(root, source).model_copy(update={"data_root": str(tmp_path / "elsewhere")})
    with pytest.raises(FileNotFoundError, match=r"data root .*elsewhere of tokens out is not visible here"):
        build_shard(plan, 0, ["id", "text"], _compute)


def test_building_admits_one_builder_of_the_plan(root, source):
    plan = _plan(root, source)
    other = _plan(root, source, key="other")
    entered = threading.Event()

    def second():
        with building(plan):
            entered.set()

    with building(plan):
        t = threading.Thread(target=second)
        t.start()
        assert not entered.wait(0.5)
        with building(other):  # another dataset is not blocked
            pass
    assert entered.wait(10)
    t.join(10)
    assert root.lock_path("tokens", "out").is_file()
