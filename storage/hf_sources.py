"""Hugging Face datasets as ingestion sources (Wiki1M, NLI, STS), beside the canonical files.

A source is an `HFSource`: a hub id (`princeton-nlp/datasets-for-simcse` with `data_files`, `mteb/stsbenchmark-sts`),
a local folder written by `save_to_disk`, or a local folder of Parquet files, with a config, a split and a column
mapping. In short form, `hf:<dataset>[:<config>][@<split>]`. It is loaded with `datasets.load_from_disk` (a
`save_to_disk` folder) or `datasets.load_dataset` (anything else; hub downloads are cached under
`<data_root>/downloads/hf`), memory-mapped.

`load_dataset` keeps the Arrow copy of local data files under a key of their paths and modification times only, so a
file replaced by other rows under its old modification time (`cp -p`, `rsync -t`, an archive unpacked) gave the old
rows. Here the Arrow copy of local data files is kept per content: under `<data_root>/downloads/hf/local/<hash>`,
the hash of the files' paths and sha256 digests (`local_files_cache`); other content is another folder, whatever the
modification time.

What the file readers guarantee holds here too:
- a missing column is an error naming the dataset and the column (and the columns it has);
- a bad value (a null, a score that is not a number or outside [0, 5], an unknown STS task or split) is an error
  naming the dataset and the row (0-based, as `ds[row]` shows it);
- a byte-order mark at a value's start is stripped and counted (`bom`), as at a file's line start;
- control characters and over-long values are counted (errors with `strict`), empty sentences counted and kept,
  STS sentences whitespace-split and re-joined as SentEval does;
- the content hash is of the rows read (the mapped columns' values and constants, `cse.storage.hashing.arrow_column_hash`),
  so the same rows give the same ingest key wherever they come from; the manifest records the source description.

STS rows also need `task` (sts12 … sts16, stsb, sickr), `subset` and `split` (train | dev | test): each from a
column of the same name, a mapped column, or a constant in `values`; `subset` defaults to "all" and `split` to the
loaded split's name ("validation" counts as dev). One HF dataset is one table: a full STS source lists several
(e.g. the MTEB sets, one per task and split).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from cse.storage import schemas
from cse.storage.hashing import arrow_column_hash, canonical_json, combine_hashes, sha256_file
from cse.storage.readers import (
    BOM,
    SEVEN_TASKS,
    STS_SUBSETS,
    Columns,
    DataFormatError,
    ReadStats,
    is_blank,
    senteval_words,
    text_findings,
)

if TYPE_CHECKING:
    import datasets

# The columns each kind of source gives, and those an STS row may take from a constant.
TEXT_TARGETS = {"wiki1m": ("text",), "nli": ("sent0", "sent1", "hard_neg"), "sts": ("sentence1", "sentence2")}
NUMBER_TARGETS = {"sts": ("score",)}
LABEL_TARGETS = {"sts": ("task", "subset", "split")}
STS_SPLITS = ("train", "dev", "test")
_SPLIT_NAMES = {"validation": "dev", "valid": "dev", "dev": "dev", "train": "train", "test": "test"}


class HFSourceError(ValueError):
    """An HF dataset source that cannot be used as configured (cannot be loaded, a missing column, ...)."""


class HFRowError(DataFormatError):
    """A bad value in an HF dataset source; names the dataset and the 0-based row."""

    def __init__(self, source: str, row: int, message: str):
        self.path, self.line, self.row = source, row, row
        ValueError.__init__(self, f"{source} row {row}: {message}")


class HFSource(BaseModel):
    """One Hugging Face dataset (one split) as a source. Also written `hf:<dataset>[:<config>][@<split>]`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str = Field(
        min_length=1,
        description="hub id, a local save_to_disk folder or a local folder of Parquet "
        "files (a path starting with /, ./, ../ or ~ is always local)",
    )
    config: str | None = Field(default=None, description="the HF config name (load_dataset's `name`)")
    split: str | None = Field(default=None, description="None: the dataset's only split")
    data_files: str | list[str] | dict[str, str | list[str]] | None = Field(
        default=None,
        description="load_dataset's data_files (e.g. the one CSV file of a hub repository that holds several)",
    )
    revision: str | None = None
    columns: dict[str, str] = Field(
        default_factory=dict, description="our column -> the dataset's column (default: the same name)"
    )
    values: dict[str, str] = Field(
        default_factory=dict, description="STS: our column -> one value for every row (task, subset, split)"
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="more keyword arguments of load_dataset (e.g. keep_default_na: false for CSV files)",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, v: Any) -> Any:
        return parse_hf_spec(v) if isinstance(v, str) else v

    def describe(self) -> str:
        """`hf:<dataset>[:<config>][@<split>]` (plus its data files when set)."""
        s = f"hf:{self.dataset}" + (f":{self.config}" if self.config else "") + (f"@{self.split}" if self.split else "")
        return s + (f" ({self.data_files})" if self.data_files else "")


def parse_hf_spec(spec: str) -> dict:
    """`hf:<dataset>[:<config>][@<split>]` (the `hf:` prefix optional) → HFSource fields."""
    rest = spec.strip().removeprefix("hf:")
    split = None
    if "@" in rest:
        rest, split = rest.rsplit("@", 1)
    dataset, config = (rest.split(":", 1) + [None])[:2] if ":" in rest else (rest, None)
    if not dataset or split == "" or config == "":
        raise ValueError(f"bad HF source {spec!r}: expected hf:<dataset>[:<config>][@<split>]")
    return {"dataset": dataset, "config": config, "split": split}


@dataclass
class HFRows:
    """The rows an `HFSource` gives: `table` holds our columns (renamed from the dataset's, memory-mapped where the
    dataset is), `constants` the columns with one value for every row."""

    spec: HFSource
    kind: str  # wiki1m | nli | sts
    table: pa.Table
    constants: dict[str, str]
    split: str | None
    loaded_with: str
    folder: Path  # where the rows are: the local folder given, or the download cache of a hub dataset
    files: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return self.spec.describe()

    def content_hash(self) -> str:
        """Hash of the rows read: every column's values (`arrow_column_hash`) and the constants."""
        head = hashlib.sha256(
            canonical_json({"kind": self.kind, "rows": self.table.num_rows, "constants": self.constants}).encode()
        ).hexdigest()
        return combine_hashes(
            [head] + [arrow_column_hash(self.table.column(c)) for c in sorted(self.table.column_names)]
        )

    def describe(self) -> dict:
        return {
            **self.spec.model_dump(exclude_defaults=True),
            "split": self.split,
            "rows": self.table.num_rows,
            "loaded_with": self.loaded_with,
            "files": self.files,
        }


def _is_local(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


# load_dataset's own keyword arguments, which its builder does not take
_LOAD_ONLY = ("verification_mode", "keep_in_memory", "save_infos", "streaming", "num_proc")


def local_files_cache(spec: HFSource, cache_dir: Path) -> Path:
    """Where `load_dataset` keeps the Arrow copy of `spec`: `cache_dir` for hub files, and for local data files (a
    local folder, or local `data_files`) `cache_dir/local/<hash of their resolved paths and sha256 digests>`, so that
    other content is never a hit of the copy made from the old one."""
    import datasets

    local = Path(spec.dataset).expanduser()
    if not local.is_dir() and spec.data_files is None:
        return cache_dir  # a hub dataset's own files: identified by their revision
    builder = datasets.load_dataset_builder(
        str(local) if local.is_dir() else spec.dataset,
        spec.config,
        data_files=spec.data_files,
        revision=spec.revision,
        cache_dir=str(cache_dir),
        **{k: v for k, v in spec.options.items() if k not in _LOAD_ONLY},
    )
    files = sorted({f for split in (builder.config.data_files or {}).values() for f in split if "://" not in f})
    if not files:
        return cache_dir
    return cache_dir / "local" / combine_hashes(f"{f}\t{sha256_file(f)}" for f in files)[:16]


def load_hf(spec: HFSource, cache_dir: Path) -> tuple[datasets.Dataset, str | None, str]:
    """(datasets.Dataset, its split name, "load_from_disk" | "load_dataset") for one source. Errors name the source."""
    import datasets

    where = spec.describe()
    local = Path(spec.dataset).expanduser()
    if _is_local(spec.dataset) and not local.is_dir():
        raise FileNotFoundError(
            f"missing HF dataset source {where}: expected a folder (written by save_to_disk, or "
            f"holding Parquet files) at {local.resolve()}"
        )
    from_disk = local.is_dir() and any((local / f).is_file() for f in ("state.json", "dataset_dict.json"))
    how = "load_from_disk" if from_disk else "load_dataset"
    if from_disk and (spec.config or spec.data_files or spec.revision or spec.options):
        raise HFSourceError(
            f"{where}: a save_to_disk folder takes no config, data_files, revision or options (they are load_dataset's)"
        )
    try:
        if from_disk:
            loaded = datasets.load_from_disk(str(local), keep_in_memory=False)
        else:
            loaded = datasets.load_dataset(
                str(local) if local.is_dir() else spec.dataset,
                spec.config,
                split=spec.split,
                data_files=spec.data_files,
                revision=spec.revision,
                cache_dir=str(local_files_cache(spec, cache_dir)),
                **spec.options,
            )
    except Exception as e:  # datasets raises many kinds (offline, not found, bad split): name the source
        raise HFSourceError(
            f"{where}: datasets.{how} failed ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
        ) from e
    split = spec.split
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        if split is None and len(names) == 1:
            split = names[0]
        if split is None or split not in loaded:
            raise HFSourceError(
                f"{where}: "
                + (f"no split {split!r}" if split else "several splits")
                + f"; it has {', '.join(names)} (choose one with @<split> or split:)"
            )
        loaded = loaded[split]
    if not isinstance(loaded, datasets.Dataset):
        raise HFSourceError(f"{where}: loaded a {type(loaded).__name__}; a map-style Dataset is needed (no streaming)")
    if split is None and loaded.split is not None:
        split = str(loaded.split)
    return loaded, split, how


def _targets(kind: str) -> tuple[str, ...]:
    return TEXT_TARGETS[kind] + NUMBER_TARGETS.get(kind, ()) + LABEL_TARGETS.get(kind, ())


def hf_rows(kind: str, spec: HFSource, cache_dir: Path) -> HFRows:  # noqa: C901 (one check per way a mapping can be wrong)
    """Load one source and map its columns to ours (see the module docstring); types are checked here, values when
    the rows are read (`read_hf`)."""
    if kind not in TEXT_TARGETS:
        raise HFSourceError(f"an HF dataset cannot be a {kind} source (only {', '.join(TEXT_TARGETS)})")
    where = spec.describe()
    for what, mapping in (("columns", spec.columns), ("values", spec.values)):
        allowed = _targets(kind) if what == "columns" else LABEL_TARGETS.get(kind, ())
        if unknown := sorted(set(mapping) - set(allowed)):
            raise HFSourceError(
                f"{where}: {what} names {', '.join(map(repr, unknown))}; a {kind} source takes "
                + (f"{what} for {', '.join(allowed)} only" if allowed else f"no {what}")
            )
    ds, split, how = load_hf(spec, cache_dir)
    have = ds.column_names
    selected: dict[str, str] = {}  # ours -> theirs
    constants: dict[str, str] = {}
    for target in TEXT_TARGETS[kind] + NUMBER_TARGETS.get(kind, ()):
        selected[target] = spec.columns.get(target, target)
    for target in LABEL_TARGETS.get(kind, ()):
        if target in spec.values:
            constants[target] = spec.values[target]
        elif target in spec.columns or target in have:
            selected[target] = spec.columns.get(target, target)
        elif target == "subset":
            constants[target] = "all"
        elif target == "split" and split is not None:
            constants[target] = _SPLIT_NAMES.get(split.split("[")[0], split.split("[")[0])
        else:
            raise HFSourceError(
                f"{where}: no column {target!r} and no value for it: give one with values: "
                f"{{{target}: ...}}" + (f" (one of {', '.join(SEVEN_TASKS)})" if target == "task" else "")
            )
    for target, theirs in selected.items():
        if theirs not in have:
            raise HFSourceError(
                f"{where}: no column {theirs!r} (for our {target!r}); its columns: {', '.join(have)}"
                + ("" if target in spec.columns else f" (map one with columns: {{{target}: <column>}})")
            )
    table = ds.select_columns(list(dict.fromkeys(selected.values()))).with_format("arrow")[:]
    table = pa.table({target: table.column(theirs) for target, theirs in selected.items()})
    for target in selected:
        t = table.column(target).type
        is_text = pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
        if target in NUMBER_TARGETS.get(kind, ()):
            if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
                raise HFSourceError(
                    f"{where}: column {selected[target]!r} (our {target!r}) holds {t}, expected numbers"
                )
        elif not is_text:
            raise HFSourceError(f"{where}: column {selected[target]!r} (our {target!r}) holds {t}, expected text")
    files = [f["filename"] for f in ds.cache_files]
    local = Path(spec.dataset).expanduser()
    folder = local.resolve() if local.is_dir() else Path(files[0]).parent if files else cache_dir
    return HFRows(
        spec=spec, kind=kind, table=table, constants=constants, split=split, loaded_with=how, folder=folder, files=files
    )


def _texts(rows: HFRows, column: str, stats: ReadStats) -> list[str]:
    """The column's values, checked: a null is an error naming the row; a byte-order mark at a value's start is
    stripped and counted (`bom`, as a file's lines: a loader that keeps the mark of a file's first line leaves it
    there); control characters and over-long values are counted (errors with `stats.strict`)."""
    values = rows.table.column(column).to_pylist()
    for i, v in enumerate(values):
        if isinstance(v, str) and v.startswith(BOM):
            values[i] = v = v.lstrip(BOM)
            stats.count_at("bom", f"{rows.where} row {i}", f"{column}: byte-order mark stripped")
        if v is None:
            raise HFRowError(
                rows.where,
                i,
                f"{column!r} is missing (null)"
                + (
                    "; for CSV files pass options: {keep_default_na: false}"
                    if rows.loaded_with == "load_dataset"
                    else ""
                ),
            )
        for finding, what, rule in text_findings(v, stats.max_line_chars):
            if stats.strict:
                raise HFRowError(rows.where, i, f"{column}: {what} ({rule})")
            stats.count_at(finding, f"{rows.where} row {i}", f"{column}: {what}")
    return values


def _labels(rows: HFRows, column: str) -> list[str]:
    if column in rows.constants:
        return [rows.constants[column]] * rows.table.num_rows
    values = rows.table.column(column).to_pylist()
    for i, v in enumerate(values):
        if v is None:
            raise HFRowError(rows.where, i, f"{column!r} is missing (null)")
    return values


def read_hf(kind: str, parts: list[HFRows], stats: ReadStats | None = None) -> tuple[pa.Table, ReadStats]:
    """The rows of `parts`, in order, in the schema of `kind` (what the file readers give), with their counts."""
    st = stats if stats is not None else ReadStats()
    if kind in ("wiki1m", "nli"):
        cols: dict[str, list[str]] = {c: [] for c in TEXT_TARGETS[kind]}
        for rows in parts:
            values = {c: _texts(rows, c, st) for c in cols}
            for c in cols:
                cols[c] += values[c]
            st.empty += sum(any(is_blank(values[c][i]) for c in cols) for i in range(rows.table.num_rows))
        st.rows = len(next(iter(cols.values())))
        schema = schemas.WIKI1M if kind == "wiki1m" else schemas.NLI
        return pa.table({"id": pa.array(range(st.rows), pa.int64()), **cols}, schema=schema), st
    out = Columns(schemas.STS)
    counters: dict[tuple[str, str, str], int] = {}
    for rows in parts:
        s1, s2 = _texts(rows, "sentence1", st), _texts(rows, "sentence2", st)
        task, subset, split = _labels(rows, "task"), _labels(rows, "subset"), _labels(rows, "split")
        scores = rows.table.column("score").to_pylist()
        for i in range(rows.table.num_rows):
            if task[i] not in SEVEN_TASKS:
                raise HFRowError(rows.where, i, f"task {task[i]!r} is not one of {', '.join(SEVEN_TASKS)}")
            if split[i] not in STS_SPLITS:
                raise HFRowError(rows.where, i, f"split {split[i]!r} is not one of {', '.join(STS_SPLITS)}")
            g = scores[i]
            if g is None or g != g:
                raise HFRowError(rows.where, i, f"gold score {g!r} is not a number")
            if not 0.0 <= g <= 5.0:
                raise HFRowError(rows.where, i, f"gold score {g} outside [0, 5]")
            a, b = senteval_words(s1[i]), senteval_words(s2[i])
            if is_blank(a) or is_blank(b):
                st.empty += 1
            group = (task[i], subset[i], split[i])
            n = counters.get(group, 0)
            counters[group] = n + 1
            out.add(task[i], subset[i], split[i], n, a, b, float(g))
    for (group_task, group_subset, group_split), n in counters.items():  # as read_senteval: per subset, per split
        name = f"{group_task}/{group_subset}" if group_task in STS_SUBSETS else f"{group_task}/{group_split}"
        st.details[name] = st.details.get(name, 0) + n
    st.rows = len(out.cols["task"])
    return out.table(), st
