"""Readers of SentEval's seven transfer (classification) tasks, exactly as SentEval's loaders read them.

Layout (SentEval's `data/downstream`; the local mirror is `../shared/data/senteval/downstream`):

| task | files | SentEval's reading rule |
|---|---|---|
| MR | `MR/rt-polarity.{pos,neg}` | latin-1, `f.read().splitlines()`, every line kept (blank ones too), label pos 1 / neg 0 |
| CR | `CR/custrev.{pos,neg}` | the same (2 + 2 blank lines are kept: SentEval's N counts them) |
| SUBJ | `SUBJ/subj.{objective,subjective}` | the same; objective = 1, subjective = 0 (SentEval passes objective as "pos") |
| MPQA | `MPQA/mpqa.{pos,neg}` | the same (1 + 2 blank lines kept) |
| SST-2 | `SST/binary/sentiment-{train,dev,test}` | UTF-8, `sentence<TAB>label` a line |
| TREC | `TREC/train_5500.label`, `TREC/TREC_10.label` | latin-1, `COARSE:fine question`; label = the coarse class (ABBR 0, DESC 1, ENTY 2, HUM 3, LOC 4, NUM 5) |
| MRPC | `MRPC/msr_paraphrase_{train,test}.txt` | UTF-8, tab-separated `Quality, #1 ID, #2 ID, #1 String, #2 String`; the first line is the header (it starts with a BOM) and is skipped |

Every sentence is whitespace-split and re-joined with single spaces (SentEval's `split()` followed by the
batcher's `' '.join`), so a blank line becomes the empty sentence. Rows: one per example, in file order
(pos file first, then neg, as SentEval concatenates them), `example_index` counting from 0 within (task, split);
the cross-validated tasks (MR, CR, SUBJ, MPQA) have the single split `all`. A malformed line raises
`cse.storage.readers.DataFormatError` naming the file and the line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from cse.storage.datasets import EvaluationInput, resolve_input
from cse.storage.layout import DataRoot
from cse.storage.readers import Columns, DataFormatError, ReadStats, require_file, root_candidates, senteval_words

TRANSFER_TASKS: tuple[str, ...] = ("mr", "cr", "subj", "mpqa", "sst2", "trec", "mrpc")
TASK_DIRS = {
    "mr": "MR",
    "cr": "CR",
    "subj": "SUBJ",
    "mpqa": "MPQA",
    "sst2": "SST/binary",
    "trec": "TREC",
    "mrpc": "MRPC",
}
BINARY_FILES = {  # (label-1 file, label-0 file)
    "mr": ("rt-polarity.pos", "rt-polarity.neg"),
    "cr": ("custrev.pos", "custrev.neg"),
    "subj": ("subj.objective", "subj.subjective"),
    "mpqa": ("mpqa.pos", "mpqa.neg"),
}
SST_FILES = {"train": "sentiment-train", "dev": "sentiment-dev", "test": "sentiment-test"}
TREC_FILES = {"train": "train_5500.label", "test": "TREC_10.label"}
MRPC_FILES = {"train": "msr_paraphrase_train.txt", "test": "msr_paraphrase_test.txt"}
TREC_CLASSES = ("ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM")
NCLASSES = {"mr": 2, "cr": 2, "subj": 2, "mpqa": 2, "sst2": 2, "trec": 6, "mrpc": 2}

# SentEval's task sizes (../shared/data/README.md): (task, split) → examples.
EXPECTED_COUNTS: dict[tuple[str, str], int] = {
    ("mr", "all"): 10_662,
    ("cr", "all"): 3_775,
    ("subj", "all"): 10_000,
    ("mpqa", "all"): 10_606,
    ("sst2", "train"): 67_349,
    ("sst2", "dev"): 872,
    ("sst2", "test"): 1_821,
    ("trec", "train"): 5_452,
    ("trec", "test"): 500,
    ("mrpc", "train"): 4_076,
    ("mrpc", "test"): 1_725,
}

TRANSFER = pa.schema(
    [
        pa.field("task", pa.string(), nullable=False),  # mr, cr, subj, mpqa, sst2, trec, mrpc
        pa.field("split", pa.string(), nullable=False),  # all (cross-validated tasks) | train | dev | test
        pa.field("example_index", pa.int32(), nullable=False),  # file order within (task, split), from 0
        pa.field("sentence1", pa.string(), nullable=False),
        pa.field("sentence2", pa.string()),  # MRPC's second sentence; null elsewhere
        pa.field("label", pa.int8(), nullable=False),
        pa.field("file", pa.string(), nullable=False),  # source file, relative to the downstream folder
        pa.field("line", pa.int32(), nullable=False),  # 1-based line in that file
    ]
)


class CountMismatchError(ValueError):
    """A task's example count differs from SentEval's."""


def transfer_root(path: str | Path) -> Path:
    """Accept the downstream folder itself, or a folder holding `downstream/` (or SentEval's `data/downstream`)."""
    p = Path(path)
    for cand in root_candidates(p):
        if all((cand / d).is_dir() for d in TASK_DIRS.values()):
            return cand
    missing = [d for d in TASK_DIRS.values() if not (p / "downstream" / d).is_dir() and not (p / d).is_dir()]
    raise FileNotFoundError(
        f"missing SentEval transfer data: expected folders {', '.join(TASK_DIRS.values())} under {p} "
        f"(or {p}/downstream); not found: {', '.join(missing)}"
    )


def _decode(path: Path, encoding: str) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataFormatError(
            path, line, f"invalid {encoding} at byte {e.start}: {raw[max(0, e.start - 10) : e.end + 10]!r}"
        ) from None


def _lines_by_iteration(text: str) -> list[str]:
    r"""Lines as `for line in open(...)` yields them (split on \n only; the last line may lack it)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _read_binary(root: Path, task: str, rows: Columns, st: ReadStats) -> None:
    idx = 0
    for label, name in zip((1, 0), BINARY_FILES[task]):
        path = require_file(root / TASK_DIRS[task] / name, f"{task.upper()} file")
        for ln, line in enumerate(_decode(path, "latin-1").splitlines(), start=1):  # SentEval: f.read().splitlines()
            s = senteval_words(line)
            if not s:
                st.empty += 1
            rows.add(task, "all", idx, s, None, label, f"{TASK_DIRS[task]}/{name}", ln)
            idx += 1


def _sst_line(path: Path, ln: int, line: str) -> tuple[str, None, int]:
    parts = line.strip().split("\t")
    if len(parts) != 2:
        raise DataFormatError(path, ln, f"{len(parts)} tab-separated fields, expected 2 (sentence, label)")
    if parts[1] not in ("0", "1"):
        raise DataFormatError(path, ln, f"label {parts[1]!r} is not 0 or 1")
    return parts[0], None, int(parts[1])


def _trec_line(path: Path, ln: int, line: str) -> tuple[str, None, int]:
    target, sep, rest = line.strip().partition(":")
    if not sep:
        raise DataFormatError(path, ln, "no ':' after the coarse label (expected `COARSE:fine question`)")
    if target not in TREC_CLASSES:
        raise DataFormatError(path, ln, f"coarse label {target!r} is not one of {', '.join(TREC_CLASSES)}")
    fine, sep, question = rest.partition(" ")
    if not sep:
        raise DataFormatError(path, ln, "no question after the fine label")
    return question, None, TREC_CLASSES.index(target)


def _mrpc_line(path: Path, ln: int, line: str) -> tuple[str, str, int]:
    parts = line.strip().split("\t")
    if len(parts) < 5:
        raise DataFormatError(
            path, ln, f"{len(parts)} tab-separated fields, expected 5 (Quality, #1 ID, #2 ID, #1 String, #2 String)"
        )
    if parts[0] not in ("0", "1"):
        raise DataFormatError(path, ln, f"quality {parts[0]!r} is not 0 or 1")
    return parts[3], parts[4], int(parts[0])


# The tasks with split files: (title in messages, encoding, {split: file}, line parser -> (sentence 1, 2, label)).
SPLIT_TASKS = {
    "sst2": ("SST-2", "utf-8", SST_FILES, _sst_line),
    "trec": ("TREC", "latin-1", TREC_FILES, _trec_line),
    "mrpc": ("MRPC", "utf-8", MRPC_FILES, _mrpc_line),
}


def _read_splits(root: Path, task: str, rows: Columns, st: ReadStats) -> None:
    title, encoding, files, parse = SPLIT_TASKS[task]
    for split, name in files.items():
        path = require_file(root / TASK_DIRS[task] / name, f"{title} {split} file")
        lines = _lines_by_iteration(_decode(path, encoding))
        first = 1
        if task == "mrpc":  # SentEval drops the header line
            if not lines or not lines[0].lstrip("\ufeff").startswith("Quality"):
                raise DataFormatError(
                    path, 1, "expected the header `Quality\\t#1 ID\\t#2 ID\\t#1 String\\t#2 String` (BOM allowed)"
                )
            first = 2
        for idx, (ln, line) in enumerate(enumerate(lines[first - 1 :], start=first)):
            s1, s2, label = parse(path, ln, line)
            s1, s2 = senteval_words(s1), None if s2 is None else senteval_words(s2)
            if not s1 or s2 == "":
                st.empty += 1
            rows.add(task, split, idx, s1, s2, label, f"{TASK_DIRS[task]}/{name}", ln)


def read_transfer(
    path: str | Path, tasks: tuple[str, ...] = TRANSFER_TASKS, check_counts: bool = True
) -> tuple[pa.Table, ReadStats]:
    """The transfer tasks' examples (schema `TRANSFER`). With `check_counts`, every (task, split) must hold
    SentEval's number of examples (`EXPECTED_COUNTS`), else `CountMismatchError` naming the files."""
    unknown = [t for t in tasks if t not in TRANSFER_TASKS]
    if unknown:
        raise ValueError(f"unknown transfer task(s) {unknown}; known: {', '.join(TRANSFER_TASKS)}")
    root = transfer_root(path)
    rows, st = Columns(TRANSFER), ReadStats()
    for task in tasks:
        (_read_binary if task in BINARY_FILES else _read_splits)(root, task, rows, st)
    table = rows.table()
    counts = Counter(zip(rows.cols["task"], rows.cols["split"]))
    for (t, s), n in counts.items():
        st.details[f"{t}/{s}"] = n
    if check_counts:
        bad = {
            f"{t}/{s}": (counts.get((t, s), 0), n)
            for (t, s), n in EXPECTED_COUNTS.items()
            if t in tasks and counts.get((t, s), 0) != n
        }
        if bad:
            files = ", ".join(str(root / TASK_DIRS[k.split("/")[0]]) for k in bad)
            raise CountMismatchError(f"transfer task sizes differ from SentEval's (got, expected): {bad} ({files})")
    st.rows = table.num_rows
    return table, st


def transfer_source_files(path: str | Path, tasks: tuple[str, ...] = TRANSFER_TASKS) -> list[Path]:
    """Every file `read_transfer` reads, in a fixed order (for content hashing)."""
    root = transfer_root(path)
    files: list[Path] = []
    for task in tasks:
        d = root / TASK_DIRS[task]
        files += [d / n for n in BINARY_FILES.get(task) or SPLIT_TASKS[task][2].values()]
    for f in files:
        require_file(f, "SentEval transfer file")
    return files


# ---------------------------------------------------------------- the evaluation stage's input


class TransferInput(EvaluationInput):
    """Transfer-task data (`load_transfer_input`)."""


def load_transfer_input(spec: str | None, root: DataRoot | None, shared_data: Path | None = None) -> TransferInput:
    """The transfer table for `spec`: an existing folder (SentEval layout), else a `transfer` dataset key.

    `spec=None`: `<shared_data>/senteval` when it holds the transfer tasks, else the newest ingested `transfer`
    dataset, else a FileNotFoundError saying to run the `ingest` flow with dataset `transfer`.
    """

    def default(from_folder: Callable[[Path], TransferInput]) -> TransferInput | None:
        if shared_data is None:
            return None
        try:
            return from_folder(transfer_root(Path(shared_data) / "senteval"))
        except FileNotFoundError:
            return None

    return resolve_input(
        root,
        "transfer",
        spec,
        cls=TransferInput,
        read_folder=lambda f: (read_transfer(f)[0], transfer_root(f), transfer_source_files(f)),
        default=default,
        no_default=lambda data_root: (
            f"no SentEval transfer data: neither {Path(shared_data or '.') / 'senteval' / 'downstream'} nor a "
            f'`transfer` dataset under {data_root.root}; run the `ingest` flow with datasets ["transfer"] (or pass '
            "`transfer` = a SentEval folder or a transfer dataset key)"
        ),
        not_found=lambda data_root: (
            f"transfer input {spec!r} is neither a SentEval folder nor a `transfer` dataset under {data_root.root}; "
            "run the `ingest` flow (dataset transfer) or pass an existing folder"
        ),
    )
