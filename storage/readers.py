"""Parsers of the canonical source formats, exactly as SimCSE/SentEval read them.

Every parser reads strict UTF-8 line by line; a malformed line raises `DataFormatError` naming the
file and the 1-based line number. Empty sentences are kept and counted, never dropped silently.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from storage import schemas

# SentEval's subset lists (STS13 without the licensed SMT subset).
STS_SUBSETS: dict[str, tuple[str, ...]] = {
    "sts12": ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"),
    "sts13": ("FNWN", "headlines", "OnWN"),
    "sts14": ("deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"),
    "sts15": ("answers-forums", "answers-students", "belief", "headlines", "images"),
    "sts16": ("answer-answer", "headlines", "plagiarism", "postediting", "question-question"),
}
STS_DIRS = {t: f"STS{t[3:]}-en-test" for t in STS_SUBSETS}
STSB_FILES = {"train": "sts-train.csv", "dev": "sts-dev.csv", "test": "sts-test.csv"}
SICK_FILES = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}
SEVEN_TASKS = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")


class DataFormatError(ValueError):
    """A source file does not have the expected format; names the file and line."""

    def __init__(self, path: str | Path, line: int | None, message: str):
        self.path, self.line = str(path), line
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")


@dataclass
class ReadStats:
    rows: int = 0
    empty: int = 0  # rows with at least one empty sentence (kept)
    skipped: int = 0  # rows skipped by the format's own rule (e.g. unscored STS pairs)
    details: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        return {"rows": self.rows, "empty": self.empty, "skipped": self.skipped, **self.details}


def require_file(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"missing {what}: expected a file at {p}")
    return p


def iter_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text without the line break), decoding strict UTF-8 per line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataFormatError(path, n, f"invalid UTF-8 at byte {e.start}: {raw[max(0, e.start - 10):e.end + 10]!r}") from None
            yield n, text.rstrip("\r\n")


def _senteval_words(s: str) -> str:
    """SentEval splits every sentence on whitespace and we re-join with single spaces."""
    return " ".join(s.split())


def _score(path: Path, line: int, raw: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise DataFormatError(path, line, f"gold score {raw!r} is not a number") from None
    if not 0.0 <= v <= 5.0:
        raise DataFormatError(path, line, f"gold score {v} outside [0, 5]")
    return v


# ---------------------------------------------------------------- training text


def read_wiki1m(path: str | Path) -> tuple[pa.Table, ReadStats]:
    """One sentence a line (HF `text` loader semantics: the line break is removed, nothing else)."""
    path = require_file(path, "Wiki1M text file (one sentence a line)")
    texts: list[str] = []
    st = ReadStats()
    for _, line in iter_lines(path):
        texts.append(line)
        if not line.strip():
            st.empty += 1
    st.rows = len(texts)
    table = pa.table({"id": pa.array(range(len(texts)), pa.int64()), "text": pa.array(texts, pa.string())}, schema=schemas.WIKI1M)
    return table, st


NLI_HEADER = ["sent0", "sent1", "hard_neg"]


def read_nli(path: str | Path) -> tuple[pa.Table, ReadStats]:
    """SimCSE's NLI CSV: header `sent0,sent1,hard_neg`, standard CSV quoting."""
    path = require_file(path, "NLI triplet CSV (sent0,sent1,hard_neg)")
    cols: dict[str, list[str]] = {c: [] for c in NLI_HEADER}
    st = ReadStats()
    text = "\n".join(line for _, line in iter_lines(path))  # strict UTF-8 with line numbers first
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None:
        raise DataFormatError(path, 1, "empty file: expected the header sent0,sent1,hard_neg")
    if [h.strip() for h in header] != NLI_HEADER:
        raise DataFormatError(path, 1, f"header {header} is not {NLI_HEADER}")
    for row in reader:
        if not row:
            raise DataFormatError(path, reader.line_num, "empty line inside the CSV")
        if len(row) != 3:
            raise DataFormatError(path, reader.line_num, f"{len(row)} columns, expected 3 (sent0,sent1,hard_neg)")
        if any(not c.strip() for c in row):
            st.empty += 1
        for c, v in zip(NLI_HEADER, row):
            cols[c].append(v)
    st.rows = len(cols["sent0"])
    table = pa.table({"id": pa.array(range(st.rows), pa.int64()), **{c: pa.array(v, pa.string()) for c, v in cols.items()}}, schema=schemas.NLI)
    return table, st


# ---------------------------------------------------------------- SentEval STS


def senteval_root(path: str | Path) -> Path:
    """Accept a folder holding STS/ and SICK/, or SentEval's `data/downstream` / `downstream` level."""
    p = Path(path)
    for cand in (p, p / "downstream", p / "data" / "downstream", p / "SentEval" / "data" / "downstream"):
        if (cand / "STS").is_dir() and (cand / "SICK").is_dir():
            return cand
    raise FileNotFoundError(f"missing SentEval data: expected folders STS/ and SICK/ under {p} (or {p}/downstream)")


@dataclass
class _Rows:
    task: list[str] = field(default_factory=list)
    subset: list[str] = field(default_factory=list)
    split: list[str] = field(default_factory=list)
    pair_index: list[int] = field(default_factory=list)
    s1: list[str] = field(default_factory=list)
    s2: list[str] = field(default_factory=list)
    score: list[float] = field(default_factory=list)

    def add(self, task, subset, split, idx, s1, s2, score):
        self.task.append(task)
        self.subset.append(subset)
        self.split.append(split)
        self.pair_index.append(idx)
        self.s1.append(s1)
        self.s2.append(s2)
        self.score.append(score)

    def table(self) -> pa.Table:
        return pa.table(
            {
                "task": self.task,
                "subset": self.subset,
                "split": self.split,
                "pair_index": pa.array(self.pair_index, pa.int32()),
                "sentence1": self.s1,
                "sentence2": self.s2,
                "score": pa.array(self.score, pa.float64()),
            },
            schema=schemas.STS,
        )


def _read_sts_subset(folder: Path, task: str, subset: str, rows: _Rows, st: ReadStats) -> None:
    inp = require_file(folder / f"STS.input.{subset}.txt", f"{task} input of subset {subset}")
    gs = require_file(folder / f"STS.gs.{subset}.txt", f"{task} gold scores of subset {subset}")
    pairs = list(iter_lines(inp))
    golds = list(iter_lines(gs))
    if len(pairs) != len(golds):
        raise DataFormatError(gs, None, f"{len(golds)} gold lines but {len(pairs)} input lines in {inp.name}")
    n = 0
    for (ln, line), (gn, gold) in zip(pairs, golds):
        if gold.strip() == "":  # unscored pair: SentEval drops it
            st.skipped += 1
            continue
        parts = line.split("\t")
        if len(parts) != 2:
            raise DataFormatError(inp, ln, f"{len(parts)} tab-separated fields, expected 2 sentences")
        s1, s2 = (_senteval_words(x) for x in parts)
        if not s1 or not s2:
            st.empty += 1
        rows.add(task, subset, "test", n, s1, s2, _score(gs, gn, gold.strip()))
        n += 1
    st.details[f"{task}/{subset}"] = n


def _read_stsb(path: Path, split: str, rows: _Rows, st: ReadStats) -> None:
    n = 0
    for ln, line in iter_lines(path):
        parts = line.strip().split("\t")
        if len(parts) < 7:
            raise DataFormatError(path, ln, f"{len(parts)} tab-separated fields, expected >= 7 (genre, file, year, id, score, s1, s2)")
        s1, s2 = _senteval_words(parts[5]), _senteval_words(parts[6])
        if not s1 or not s2:
            st.empty += 1
        rows.add("stsb", "all", split, n, s1, s2, _score(path, ln, parts[4]))
        n += 1
    st.details[f"stsb/{split}"] = n


def _read_sick(path: Path, split: str, rows: _Rows, st: ReadStats) -> None:
    n = 0
    for ln, line in iter_lines(path):
        if ln == 1:
            continue  # header
        parts = line.strip().split("\t")
        if len(parts) < 4:
            raise DataFormatError(path, ln, f"{len(parts)} tab-separated fields, expected >= 4 (pair_ID, A, B, score)")
        s1, s2 = _senteval_words(parts[1]), _senteval_words(parts[2])
        if not s1 or not s2:
            st.empty += 1
        rows.add("sickr", "all", split, n, s1, s2, _score(path, ln, parts[3]))
        n += 1
    st.details[f"sickr/{split}"] = n


def read_senteval(path: str | Path) -> tuple[pa.Table, ReadStats]:
    """All STS pairs: STS12–16 (test), STS-B train/dev/test, SICK-R train/dev(trial)/test."""
    root = senteval_root(path)
    rows, st = _Rows(), ReadStats()
    for task, subsets in STS_SUBSETS.items():
        folder = root / "STS" / STS_DIRS[task]
        if not folder.is_dir():
            raise FileNotFoundError(f"missing {task}: expected folder {folder}")
        for subset in subsets:
            _read_sts_subset(folder, task, subset, rows, st)
    for split, name in STSB_FILES.items():
        _read_stsb(require_file(root / "STS" / "STSBenchmark" / name, f"STS-B {split} split"), split, rows, st)
    for split, name in SICK_FILES.items():
        _read_sick(require_file(root / "SICK" / name, f"SICK {split} split"), split, rows, st)
    st.rows = len(rows.task)
    return rows.table(), st


def senteval_source_files(path: str | Path) -> list[Path]:
    """Every file `read_senteval` reads, in a fixed order (for content hashing)."""
    root = senteval_root(path)
    files: list[Path] = []
    for task, subsets in STS_SUBSETS.items():
        for subset in subsets:
            d = root / "STS" / STS_DIRS[task]
            files += [d / f"STS.input.{subset}.txt", d / f"STS.gs.{subset}.txt"]
    files += [root / "STS" / "STSBenchmark" / n for n in STSB_FILES.values()]
    files += [root / "SICK" / n for n in SICK_FILES.values()]
    for f in files:
        require_file(f, "SentEval file")
    return files
