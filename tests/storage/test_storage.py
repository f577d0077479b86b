"""Atomic writes, manifests and the DuckDB catalog."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from cse.storage import schemas
from cse.storage.atomic import atomic_dir, atomic_file, clean_temporaries
from cse.storage.catalog import query, refresh_catalog
from cse.storage.datasets import read_dataset, write_dataset
from cse.storage.layout import DataRoot
from cse.storage.manifest import MANIFEST_NAME


def _wiki(n: int) -> pa.Table:
    return pa.table({"id": list(range(n)), "text": [f"sentence {i}" for i in range(n)]}, schema=schemas.WIKI1M)


def test_atomic_file_leaves_nothing_on_error(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_publishes_whole_folder(tmp_path):
    final = tmp_path / "ds"
    with atomic_dir(final) as tmp:
        (tmp / "a").write_text("1")
        assert not final.exists()
    assert (final / "a").read_text() == "1"


def test_write_dataset_manifest_and_round_trip(tmp_path):
    root = DataRoot(tmp_path)
    m = write_dataset(root, "wiki1m", "k1", [_wiki(3), _wiki(2)], schemas.WIKI1M, params={"p": 1}, stats={"empty": 0})
    assert m.rows == 5 and m.files == ["part-00000.parquet", "part-00001.parquet"]
    assert len(m.content_hash) == 64
    assert root.find("wiki1m", "k1") == m
    assert read_dataset(root, "wiki1m", "k1").num_rows == 5


def test_incomplete_dataset_is_not_found(tmp_path):
    root = DataRoot(tmp_path)
    write_dataset(root, "wiki1m", "k1", [_wiki(3)], schemas.WIKI1M)
    (root.dataset_dir("wiki1m", "k1") / "part-00000.parquet").unlink()
    assert root.find("wiki1m", "k1") is None
    (root.dataset_dir("wiki1m", "k1") / MANIFEST_NAME).unlink()
    assert root.find("wiki1m", "k1") is None
    with pytest.raises(FileNotFoundError, match="run the stage that produces it"):
        root.require("wiki1m", "k1")


def test_killed_writer_leaves_only_temporaries(tmp_path):
    root = DataRoot(tmp_path)

    def parts():
        yield _wiki(2)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_dataset(root, "wiki1m", "k2", parts(), schemas.WIKI1M)
    assert root.find("wiki1m", "k2") is None
    assert not root.dataset_dir("wiki1m", "k2").exists()
    assert clean_temporaries(tmp_path) == 0  # atomic_dir already removed its folder


def test_schema_is_enforced(tmp_path):
    bad = pa.table({"id": ["x"], "text": ["a"]})
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError, ValueError)):
        write_dataset(DataRoot(tmp_path), "wiki1m", "k", [bad], schemas.WIKI1M)


def test_catalog_views(tmp_path):
    root = DataRoot(tmp_path)
    write_dataset(root, "wiki1m", "old", [_wiki(2)], schemas.WIKI1M)
    write_dataset(root, "wiki1m", "new", [_wiki(4)], schemas.WIKI1M)
    ids = [[101, 5, 102], [101, 102], [101, 7, 102]]
    tokens = pa.table(
        {"id": [0, 1, 2], "column": ["text"] * 3, "input_ids": ids, "length": [3, 2, 3]}, schema=schemas.TOKENS
    )
    write_dataset(root, "tokens", "t", [tokens], schemas.TOKENS)
    assert refresh_catalog(root) == root.catalog_path
    assert query(root, "select count(*) n from wiki1m").n[0] == 4
    assert set(query(root, "select dataset_key from wiki1m_all").dataset_key) == {"old", "new"}
    assert query(root, "select count(*) n from manifests").n[0] == 3
    lengths = query(root, "select length, n from token_lengths order by length")
    assert lengths.to_dict("list") == {"length": [2, 3], "n": [1, 2]}


def test_building_lock_admits_one_builder_per_dataset(tmp_path):
    """Two builders of the same dataset (two flows of a sweep): the second waits until the first releases."""
    root = DataRoot(tmp_path)
    entered = threading.Event()

    def second_builder():
        with root.building("tokens", "k1"):
            entered.set()

    with root.building("tokens", "k1"):
        t = threading.Thread(target=second_builder)
        t.start()
        assert not entered.wait(0.5)
        with root.building("tokens", "k2"), root.building("corruption", "k1"):  # other datasets are not blocked
            assert not entered.is_set()
    assert entered.wait(10)
    t.join(10)


def test_training_job_lock_admits_one_process_per_job(tmp_path):
    """A second flow of the same training job waits until the first is done with it."""
    from cse.storage.runs import RunDir

    job, other = RunDir("d2cse", "key1", home=tmp_path), RunDir("d2cse", "key2", home=tmp_path)
    entered = threading.Event()

    def second_flow():
        with RunDir("d2cse", "key1", home=tmp_path).exclusive():
            entered.set()

    with job.exclusive():
        t = threading.Thread(target=second_flow)
        t.start()
        assert not entered.wait(0.5)
        with other.exclusive():
            assert not entered.is_set()
    assert entered.wait(10)
    t.join(10)
    assert not (job.path / "key1.lock").exists()  # the lock lives beside the job folder, not in it
