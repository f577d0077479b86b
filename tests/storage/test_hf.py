"""storage/hf.py and storage/arrow_copy.py: every published dataset opens as a memory-mapped HF `Dataset` (no copy),
its Arrow copy is covered by the manifest and the integrity checks, and a dataset from before the copy gets it on
first open without changing its key or content hash."""

from __future__ import annotations

import json
import shutil
import threading

import datasets
import pyarrow as pa
import pytest
from datasets.table import MemoryMappedTable

from cse.ops.cli import main as cse
from cse.storage import schemas
from cse.storage.arrow_copy import ARROW_DIR
from cse.storage.datasets import read_dataset, write_dataset
from cse.storage.hashing import sha256_files
from cse.storage.hf import find_dataset, open_arrow_table, open_hf_dataset
from cse.storage.integrity import QUARANTINE_DIR, check_dataset
from cse.storage.layout import DataRoot
from cse.storage.manifest import MANIFEST_NAME, Manifest

N = 6000  # rows: enough that a copy into memory would show in Arrow's allocator


def _tokens(start: int, n: int) -> pa.Table:
    return pa.table(
        {
            "id": list(range(start, start + n)),
            "column": ["text"] * n,
            "input_ids": [[101, 1000 + i % 50, 2000 + i % 7, 102] for i in range(start, start + n)],
            "length": [4] * n,
        },
        schema=schemas.TOKENS,
    )


@pytest.fixture
def root(isolated_home) -> DataRoot:
    from cse.storage.settings import get_settings

    return DataRoot(get_settings().data_root)


@pytest.fixture
def published(root) -> Manifest:
    return write_dataset(root, "tokens", "k1", [_tokens(0, N // 2), _tokens(N // 2, N // 2)], schemas.TOKENS)


def _as_before_the_copy(root: DataRoot, key: str) -> None:
    """Make dataset tokens/`key` look as it was published before the Arrow copy existed."""
    folder = root.dataset_dir("tokens", key)
    shutil.rmtree(folder / ARROW_DIR)
    m = Manifest.read(folder)
    m.model_copy(update={"arrow": None}).write(folder)


def test_a_published_dataset_opens_as_a_memory_mapped_hf_dataset(root, published):
    folder = root.dataset_dir("tokens", "k1")
    assert published.arrow.files == ["hf/part-00000.arrow", "hf/part-00001.arrow"]
    assert published.arrow.file_rows == {"hf/part-00000.arrow": N // 2, "hf/part-00001.arrow": N // 2}
    # the copy never enters the content hash: it is the Parquet parts' alone, as before
    assert published.content_hash == sha256_files(folder / f for f in published.files)

    before = pa.total_allocated_bytes()
    ds = open_hf_dataset(root, "tokens")  # the newest tokens dataset
    assert pa.total_allocated_bytes() - before < 4096, "opening must not read the rows into memory"
    assert all(isinstance(t, MemoryMappedTable) for row in ds.data.blocks for t in row)
    assert [f["filename"] for f in ds.cache_files] == [str(folder / f) for f in published.arrow.files]
    assert ds.features["input_ids"] == datasets.List(datasets.Value("int32"))
    assert ds.num_rows == N and ds[N - 1] == _tokens(N - 1, 1).to_pylist()[0]
    assert ds.with_format("arrow")[:].to_pylist() == read_dataset(root, "tokens", "k1").to_pylist()

    table = open_arrow_table(root, "tokens", "k1")  # what training reads: the same files, no copy either
    assert table.column("input_ids").chunk(0).buffers()[-1].address != 0 and table.num_rows == N


def test_find_dataset_is_cheap_and_names_what_is_missing(root, published):
    ds = find_dataset(root, "tokens", "k1")
    assert (ds.folder, ds.content_hash, ds.rows) == (root.dataset_dir("tokens", "k1"), published.content_hash, N)
    assert ds.arrow_schema().names == schemas.TOKENS.names and ds.hf_folder == ds.folder / "hf"
    with pytest.raises(FileNotFoundError, match="no tokens dataset 'nope' .*newest: k1"):
        find_dataset(root, "tokens", "nope")
    with pytest.raises(FileNotFoundError, match="no corruption dataset under"):
        find_dataset(root, "corruption")


def test_cli_prints_a_line_that_opens_the_dataset(root, published, capsys):
    assert cse(["dataset", "tokens", "--hf"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == find_dataset(root, "tokens").snippet() and "\n" not in line
    scope: dict = {}
    exec(line, scope)  # what a user pastes into Python
    assert scope["ds"].num_rows == N and isinstance(scope["ds"], datasets.Dataset)

    # the acceptance, verbatim: `cse dataset corruption --hf` pasted into Python maps the files, copies nothing
    rows = [
        {
            "id": i,
            "column": "text",
            "variant": v,
            "input_ids": [101, 7 + i % 5, 102],
            "corrupted_ids": [101, 9, 102],
            "labels": [0, 1, 0],
            "n_masked": 1,
            "n_replaced": 1,
        }
        for i in range(N // 2)
        for v in range(2)
    ]
    write_dataset(root, "corruption", "c1", [pa.Table.from_pylist(rows, schema=schemas.CORRUPTION)], schemas.CORRUPTION)
    assert cse(["dataset", "corruption", "--hf"]) == 0
    scope = {}
    before = pa.total_allocated_bytes()
    exec(capsys.readouterr().out.strip(), scope)
    assert pa.total_allocated_bytes() - before < 4096, "the pasted line must not read the rows into memory"
    data = scope["ds"].data  # one file: the mapped table itself; several: their concatenation
    assert all(isinstance(t, MemoryMappedTable) for row in getattr(data, "blocks", [[data]]) for t in row)
    assert scope["ds"].num_rows == N and scope["ds"][1]["variant"] == 1

    assert cse(["dataset", "tokens", "k1"]) == 0
    out = capsys.readouterr().out
    assert f"tokens/k1: {N:,d} rows, content hash {published.content_hash}" in out and "hf/part-00001.arrow" in out
    assert cse(["dataset", "tokens", "nope", "--hf"]) == 2
    assert "no tokens dataset 'nope'" in capsys.readouterr().err


def test_a_dataset_from_before_the_copy_gets_it_on_first_open_once(root, published):
    _as_before_the_copy(root, "k1")
    assert check_dataset(root.dataset_dir("tokens", "k1"), "tokens", "k1", full=True) == []  # not damage
    opened: list = []

    def open_it():
        opened.append(open_arrow_table(root, "tokens", "k1").num_rows)

    threads = [threading.Thread(target=open_it) for _ in range(3)]  # concurrent first opens: one builds, under the lock
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert opened == [N, N, N]
    m = root.require("tokens", "k1")
    assert (m.key, m.content_hash, m.files, m.created) == (
        "k1",
        published.content_hash,
        published.files,
        published.created,
    )
    assert m.arrow is not None and m.arrow.file_rows == published.arrow.file_rows
    assert check_dataset(root.dataset_dir("tokens", "k1"), "tokens", "k1", full=True) == []
    assert not list(root.dataset_dir("tokens", "k1").glob(".tmp-*"))


def test_a_damaged_copy_is_found_and_rebuilt_from_the_parquet_parts(root, published, capsys):
    folder = root.dataset_dir("tokens", "k1")
    arrow = folder / "hf" / "part-00001.arrow"
    data = bytearray(arrow.read_bytes())
    data[-200] ^= 0x01  # inside the last batch's values: sizes and rows unchanged
    arrow.write_bytes(bytes(data))
    assert check_dataset(folder, "tokens", "k1") == []  # the cheap check cannot see it ...
    [problem] = check_dataset(folder, "tokens", "k1", full=True)  # ... the full one names the file
    assert problem.file == str(arrow) and "content hash" in problem.reason and "Arrow copy" in problem.reason

    assert cse(["verify"]) == 1 and str(arrow) in capsys.readouterr().out  # marked for the next stage run
    with root.building("tokens", "k1"):
        m, record = root.reuse("tokens", "k1", full=True)  # the stage's cache hit: the copy alone is rebuilt
    assert m is not None and m.content_hash == published.content_hash and record.moved_to.endswith("-hf")
    moved = root.root / QUARANTINE_DIR / "tokens"
    [q] = list(moved.iterdir())
    assert (q / "part-00001.arrow").read_bytes() == bytes(data)  # the damaged copy is kept, not deleted
    assert json.loads((q / "quarantine.json").read_text())["problems"][0]["file"] == str(arrow)
    assert check_dataset(folder, "tokens", "k1", full=True) == [] and (folder / "part-00000.parquet").is_file()
    assert open_hf_dataset(root, "tokens", "k1")[N - 1]["input_ids"] == _tokens(N - 1, 1).column("input_ids")[0].as_py()


def test_a_truncated_copy_is_rebuilt_on_open_and_damaged_parts_refuse(root, published):
    folder = root.dataset_dir("tokens", "k1")
    arrow = folder / "hf" / "part-00000.arrow"
    arrow.write_bytes(arrow.read_bytes()[:100])
    assert "Arrow copy" in check_dataset(folder, "tokens", "k1")[0].reason  # the cheap check sees a size change
    assert open_arrow_table(root, "tokens", "k1").num_rows == N  # rebuilt from the parts on open
    assert len(list((root.root / QUARANTINE_DIR / "tokens").iterdir())) == 1

    _as_before_the_copy(root, "k1")
    (folder / "part-00001.parquet").write_bytes(b"garbage")
    with pytest.raises(Exception, match=r"tokens/k1 is damaged: .*part-00001\.parquet"):
        open_arrow_table(root, "tokens", "k1")  # never a copy of damaged parts
    assert not (folder / "hf").exists() and json.loads((folder / MANIFEST_NAME).read_text())["arrow"] is None
