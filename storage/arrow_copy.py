"""The memory-mappable Arrow copy of a published dataset: `<dataset folder>/hf/`.

Parquet is compressed and cannot be memory-mapped, so every dataset also carries its rows as Arrow IPC *stream*
files (the format Hugging Face `datasets` memory-maps: `Dataset.from_file`, `load_from_disk`), one per Parquet part,
in HF's `save_to_disk` layout:

    <kind>/<key>/part-00000.parquet ...     the dataset (its content hash is over these only)
    <kind>/<key>/hf/part-00000.arrow ...    the same rows, uncompressed, one stream file per part
    <kind>/<key>/hf/state.json              HF's list of the data files, a fingerprint (the content hash's head)
    <kind>/<key>/hf/dataset_info.json       HF's features of the columns

The copy is written in the HF schema of the columns (nullable fields, lists with `item`, the features in the schema
metadata), so an HF `Dataset` opened on it casts nothing and therefore copies nothing. It is written inside the
dataset's atomic folder at publish time (`write_arrow_copy`), recorded in the manifest (`Manifest.arrow`: sizes,
rows, hashes) and checked with the dataset (`check_arrow_copy`, called by storage/integrity.py). Datasets published
before it existed get it on first open (`rebuild_arrow_copy`, under the dataset's build lock: storage/hf.py), and a
damaged copy is rebuilt from the intact Parquet parts rather than rebuilding the dataset (storage/integrity.py).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cse.storage.atomic import TMP_PREFIX, atomic_dir, process_alive, remove_path, temporary_owner, write_json
from cse.storage.hashing import sha256_file
from cse.storage.manifest import ArrowCopy, Manifest

ARROW_DIR = "hf"
STATE_FILE = "state.json"  # HF's names: `datasets.load_from_disk` reads these two
INFO_FILE = "dataset_info.json"
BATCH_ROWS = 16_384  # rows per record batch in the stream files (HF's own writer uses 1,000–10,000)


def arrow_file_name(part: str) -> str:
    """`part-00003.parquet` → `part-00003.arrow` (the copy's file of that part, inside `hf/`)."""
    return f"{Path(part).stem}.arrow"


def hf_schema(schema: pa.Schema) -> pa.Schema:
    """The Arrow schema HF `datasets` gives these columns (its `Features`): opening a table of exactly this schema
    as a `datasets.Dataset` casts nothing, so nothing is copied."""
    from datasets import Features

    return Features.from_arrow_schema(schema).arrow_schema


def stream_rows(path: str | Path) -> int:
    """Rows of an Arrow IPC stream file, read through a memory map (only the batch headers are touched)."""
    with pa.memory_map(str(path)) as source:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))


def _write_copy(folder: Path, parts: list[str], dest: Path, *, kind: str, key: str, content_hash: str) -> ArrowCopy:
    """Write the copy of `folder`'s Parquet `parts` into `dest` (which becomes `folder/hf`), part by part (memory is
    bounded by one record batch); returns its manifest record."""
    from datasets import Features

    dest.mkdir(parents=True, exist_ok=True)
    target: pa.Schema | None = None
    names: list[str] = []
    for part in parts:
        pf = pq.ParquetFile(folder / part)
        if target is None:
            target = hf_schema(pf.schema_arrow)
        name = arrow_file_name(part)
        with pa.OSFile(str(dest / name), "wb") as sink, pa.ipc.new_stream(sink, target) as writer:
            for batch in pf.iter_batches(batch_size=BATCH_ROWS):
                writer.write_batch(batch.cast(target))
        names.append(name)
    write_json(
        {
            "_data_files": [{"filename": n} for n in names],
            "_fingerprint": content_hash[:16],
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        },
        dest / STATE_FILE,
    )
    write_json(
        {
            "description": f"cse-pipeline dataset {kind}/{key}: the Arrow copy of its Parquet parts "
            f"(content hash {content_hash})",
            "features": Features.from_arrow_schema(target).to_dict(),
            "citation": "",
            "homepage": "",
            "license": "",
        },
        dest / INFO_FILE,
    )
    files = [f"{ARROW_DIR}/{n}" for n in names]
    meta = [f"{ARROW_DIR}/{STATE_FILE}", f"{ARROW_DIR}/{INFO_FILE}"]
    local = lambda f: dest / Path(f).name  # `dest` is `folder/hf` or its temporary twin
    return ArrowCopy(
        folder=ARROW_DIR,
        files=files,
        meta_files=meta,
        file_sizes={f: local(f).stat().st_size for f in files + meta},
        file_rows={f: stream_rows(local(f)) for f in files},
        file_hashes={f: sha256_file(local(f)) for f in files + meta},
    )


def write_arrow_copy(folder: str | Path, parts: list[str], *, kind: str, key: str, content_hash: str) -> ArrowCopy:
    """Write `folder/hf/` from the Parquet `parts` of a dataset being published (`folder` is its temporary folder,
    published by one rename with everything in it)."""
    folder = Path(folder)
    return _write_copy(folder, parts, folder / ARROW_DIR, kind=kind, key=key, content_hash=content_hash)


def clean_copy_leftovers(folder: str | Path, *, all_writers: bool) -> list[Path]:
    """Remove `.tmp-hf-*` folders left in a dataset folder by killed copy builders: those of dead processes, or all of
    them with `all_writers` (the caller holds the dataset's build lock, so no live builder can own one)."""
    removed = []
    for p in Path(folder).glob(f"{TMP_PREFIX}{ARROW_DIR}-*"):
        owner = temporary_owner(p)
        if owner is not None and (all_writers or not process_alive(owner[1])):
            remove_path(p)
            removed.append(p)
    return removed


def rebuild_arrow_copy(folder: str | Path) -> Manifest:
    """(Re)build `folder/hf/` from the dataset's Parquet parts, replace it as a whole (one rename) and record it in the
    manifest (rewritten atomically; key, content hash and everything else unchanged). The caller holds the dataset's
    build lock (`DataRoot.building`) and has checked the Parquet parts; a damaged copy must be moved aside first."""
    folder = Path(folder)
    m = Manifest.read(folder)
    clean_copy_leftovers(folder, all_writers=True)
    with atomic_dir(folder / ARROW_DIR) as tmp:
        copy = _write_copy(folder, m.files, tmp, kind=m.kind, key=m.key, content_hash=m.content_hash)
    m = m.model_copy(update={"arrow": copy})
    m.write(folder)
    return m


def copy_present(folder: str | Path, m: Manifest) -> bool:
    """Whether the manifest records a copy whose files are all there with their recorded sizes (the cheap test before
    opening; `check_arrow_copy` is the full one)."""
    if m.arrow is None:
        return False
    folder = Path(folder)
    for f in m.arrow.all_files():
        p = folder / f
        if not p.is_file() or (f in m.arrow.file_sizes and p.stat().st_size != m.arrow.file_sizes[f]):
            return False
    return True


def check_arrow_copy(folder: str | Path, m: Manifest, full: bool = False) -> list[tuple[Path, str]]:
    """What is wrong with the recorded Arrow copy, as (file, reason) ([] when intact or when none is recorded: a
    dataset from before the copy existed is not damaged, it gets its copy on first open). Always: every file exists
    with its recorded size, the stream files read with their recorded rows, one per Parquet part, adding up to the
    dataset's rows; with `full`: the sha256 of every file."""
    copy = m.arrow
    if copy is None:
        return []
    folder = Path(folder)
    found: list[tuple[Path, str]] = []

    def bad(file: Path, reason: str) -> None:
        found.append((file, reason))

    if len(copy.files) != len(m.files):
        bad(folder / copy.folder, f"{len(copy.files)} Arrow files for {len(m.files)} Parquet parts")
    total, readable = 0, True
    for f in copy.all_files():
        p = folder / f
        if not p.is_file():
            bad(p, "missing (Arrow copy)")
            readable = False
            continue
        size = p.stat().st_size
        if f in copy.file_sizes and size != copy.file_sizes[f]:
            recorded_size = copy.file_sizes[f]
            bad(p, f"{size:,d} bytes, the manifest records {recorded_size:,d} (Arrow copy truncated or overwritten)")
            readable = False
            continue
        if f in copy.files:
            try:
                rows = stream_rows(p)
            except (pa.ArrowInvalid, OSError) as e:
                bad(p, f"unreadable Arrow stream ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
                readable = False
                continue
            if f in copy.file_rows and rows != copy.file_rows[f]:
                bad(p, f"{rows:,d} rows, the manifest records {copy.file_rows[f]:,d} (Arrow copy)")
            total += rows
    if readable and total != m.rows:
        bad(folder / copy.folder, f"the Arrow copy holds {total:,d} rows, the manifest records {m.rows:,d}")
    if full and not found:
        for f in copy.all_files():
            if f in copy.file_hashes and (d := sha256_file(folder / f)) != copy.file_hashes[f]:
                recorded = copy.file_hashes[f]
                bad(folder / f, f"content hash {d[:12]}… differs from the manifest's {recorded[:12]}… (Arrow copy)")
    return found


def compare_arrow_copy(folder: str | Path, m: Manifest) -> list[tuple[Path, str]]:
    """Whether the Arrow copy holds the Parquet parts' values, part by part (the full check: both are read), as
    (file, reason) ([] when they agree or no copy is recorded). Training reads the copy and SQL the parts: an edit of
    one, with its manifest entries rewritten, would give them different data. Which one was edited is unknown, so the
    reason names the dataset folder (the whole dataset is rebuilt, not the copy from the parts)."""
    if m.arrow is None or len(m.arrow.files) != len(m.files):
        return []
    folder = Path(folder)
    found: list[tuple[Path, str]] = []
    for part, copy in zip(m.files, m.arrow.files):
        parquet = pq.read_table(folder / part)
        with pa.memory_map(str(folder / copy)) as source:
            arrow = pa.ipc.open_stream(source).read_all()
        same = parquet.column_names == arrow.column_names and parquet.num_rows == arrow.num_rows
        differ = [
            c
            for c in (parquet.column_names if same else [])
            if not parquet.column(c).equals(arrow.column(c).cast(parquet.schema.field(c).type))
        ]
        if not same or differ:
            what = f"the values of {', '.join(differ)}" if differ else "the columns or rows"
            found.append((folder, f"{what} of {copy} differ from {part}: the Arrow copy or the part was edited"))
    return found


def in_copy(folder: str | Path, file: str | Path) -> bool:
    """Whether `file` lies in the Arrow copy of the dataset in `folder` (its `hf/` folder or a file in it)."""
    copy_dir = Path(folder) / ARROW_DIR
    p = Path(file)
    return p == copy_dir or copy_dir in p.parents


def open_arrow_files(folder: str | Path, m: Manifest) -> pa.Table:
    """The copy's rows as one Arrow table whose buffers are memory-mapped (nothing is read into memory until used);
    the caller made sure the copy is there (`copy_present`)."""
    if m.arrow is None:
        raise FileNotFoundError(f"{folder}: the manifest of {m.kind}/{m.key} records no Arrow copy to open")
    folder = Path(folder)
    tables = []
    for f in m.arrow.files:
        with pa.memory_map(str(folder / f)) as source:  # the mapping lives on in the buffers that reference it
            tables.append(pa.ipc.open_stream(source).read_all())
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)
