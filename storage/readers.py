"""Parsers of the canonical source formats, exactly as SimCSE/SentEval read them.

Every parser reads strict UTF-8 line by line; a malformed line raises `DataFormatError` naming the
file and the 1-based line number. Empty sentences are kept and counted, never dropped silently; "empty" means blank
(`is_blank`): nothing but whitespace, format and control characters of any script (NBSP, U+3000, U+200B, U+FEFF,
U+2060 count as nothing, as an ASCII space does).

One rule for every text source (`iter_lines`): a UTF-8 byte-order mark at the start of a line is stripped and
counted (`bom`): at the start of the file, and where files were concatenated (`cat a.txt b.txt` keeps the second
file's mark at the start of its first line); lines with control characters (C0 but tab, DEL, C1: NUL bytes, a stray carriage return, U+0092)
and lines longer than `max_line_chars` are counted (`control_lines`, `long_lines`, the first ones named in
`examples`), and with `strict` they are errors naming file and line.
"""

from __future__ import annotations

import csv
import io
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from cse.storage import schemas

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
# How tables and model cards title the tasks and their average (the one definition; evaluation/results.py re-exports it).
TASK_TITLES = {
    "sts12": "STS12",
    "sts13": "STS13",
    "sts14": "STS14",
    "sts15": "STS15",
    "sts16": "STS16",
    "stsb": "STS-B",
    "sickr": "SICK-R",
    "stsb_dev": "STS-B dev",
    "sickr_dev": "SICK-R dev",
    "sts_avg": "Avg.",
}


class DataFormatError(ValueError):
    """A source file does not have the expected format; names the file and line."""

    def __init__(self, path: str | Path, line: int | None, message: str):
        self.path, self.line = str(path), line
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")


MAX_LINE_CHARS = 10_000  # default limit of `long_lines` (the real sources' longest line: 1,203 characters)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 except tab and line feed, DEL, C1
_EXAMPLES = 10  # file:line examples kept per kind of finding


_INVISIBLE = frozenset({"Zs", "Zl", "Zp", "Cc", "Cf"})  # separators, control and format characters


def is_blank(text: str | None) -> bool:
    """Whether `text` shows nothing: empty, or only Unicode whitespace, separators, control and format characters
    (categories Zs, Zl, Zp, Cc, Cf: NBSP, U+3000, the zero-width space U+200B, U+FEFF, the word joiner U+2060, ...).

    Examples:
        >>> from cse.storage.readers import is_blank
        >>> is_blank("\u00a0\u3000\u200b\ufeff\u2060"), is_blank(" a ")
        (True, False)
    """
    return not text or all(ch.isspace() or unicodedata.category(ch) in _INVISIBLE for ch in text)


@dataclass
class ReadStats:
    """Counts and first examples of what a source reader found (rows, empty, skipped and per-finding counts)."""

    rows: int = 0
    empty: int = 0  # rows with at least one blank sentence (`is_blank`; kept)
    skipped: int = 0  # rows skipped by the format's own rule (e.g. unscored STS pairs)
    details: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)  # finding -> the first "file:line: what"
    strict: bool = False  # control characters and over-long lines are errors
    max_line_chars: int = MAX_LINE_CHARS

    def count(self, finding: str, path: str | Path, line: int, what: str) -> None:
        self.count_at(finding, f"{path}:{line}", what)

    def count_at(self, finding: str, where: str, what: str) -> None:
        """Count a finding at `where` ("file:line", or "hf:<dataset>@<split> row N"), keeping the first examples."""
        self.details[finding] = self.details.get(finding, 0) + 1
        ex = self.examples.setdefault(finding, [])
        if len(ex) < _EXAMPLES:
            ex.append(f"{where}: {what}")

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rows": self.rows, "empty": self.empty, "skipped": self.skipped, **self.details}
        if self.examples:
            out["examples"] = {k: list(v) for k, v in self.examples.items()}
        return out


class Columns:
    """Rows collected column by column (`add` takes one value per field of `schema`, in its order), then one table."""

    def __init__(self, schema: pa.Schema):
        self.schema = schema
        self.cols: dict[str, list] = {f.name: [] for f in schema}

    def add(self, *values: Any) -> None:
        for col, v in zip(self.cols.values(), values, strict=True):
            col.append(v)

    def table(self) -> pa.Table:
        return pa.table({f.name: pa.array(self.cols[f.name], f.type) for f in self.schema}, schema=self.schema)


def require_file(path: str | Path, what: str) -> Path:
    """Return `path` if it is an existing file, else fail naming `what` was expected.

    Args:
        path: the expected file.
        what: a description of the file for the error message.

    Returns:
        The path.

    Raises:
        FileNotFoundError: `path` is not a file.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"missing {what}: expected a file at {p}")
    return p


BOM = "\ufeff"


def iter_lines(path: str | Path, stats: ReadStats | None = None) -> Iterator[tuple[int, str]]:
    """(line number, text without the line break), decoding strict UTF-8 per line.

    A byte-order mark at the start of a line is stripped (and counted as `bom` in `stats`): the file's own, and
    those of files concatenated into it. With `stats`, control characters and lines over `stats.max_line_chars` are
    counted, or raise when `stats.strict`."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataFormatError(
                    path, n, f"invalid UTF-8 at byte {e.start}: {raw[max(0, e.start - 10) : e.end + 10]!r}"
                ) from None
            text = text.rstrip("\r\n")
            if text.startswith(BOM):
                text = text.lstrip(BOM)
                if stats is not None:
                    stats.count("bom", path, n, "byte-order mark stripped")
            if stats is not None:
                _check_line(path, n, text, stats)
            yield n, text


def text_findings(text: str, max_line_chars: int) -> list[tuple[str, str, str]]:
    """(finding, what, strict rule) for a line or value with control characters or over `max_line_chars`: the one
    rule of every text source (files here, Hugging Face datasets in storage/hf_sources.py)."""
    found = []
    if (m := _CONTROL.search(text)) is not None:
        found.append(
            (
                "control_lines",
                f"control character U+{ord(m.group()):04X} at column {m.start() + 1}",
                "strict: control characters are errors",
            )
        )
    if len(text) > max_line_chars:
        found.append(
            (
                "long_lines",
                f"{len(text):,d} characters, over max_line_chars {max_line_chars:,d}",
                "strict: over-long lines are errors",
            )
        )
    return found


def _check_line(path: str | Path, n: int, text: str, stats: ReadStats) -> None:
    for finding, what, rule in text_findings(text, stats.max_line_chars):
        if stats.strict:
            raise DataFormatError(path, n, f"{what} ({rule})")
        stats.count(finding, path, n, what)


def senteval_words(s: str) -> str:
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


def read_wiki1m(path: str | Path, stats: ReadStats | None = None) -> tuple[pa.Table, ReadStats]:
    """One sentence a line (HF `text` loader semantics: the line break is removed, nothing else; a leading
    byte-order mark is stripped). `stats` carries the strictness settings in and the counts out."""
    path = require_file(path, "Wiki1M text file (one sentence a line)")
    texts: list[str] = []
    st = stats if stats is not None else ReadStats()
    for _, line in iter_lines(path, st):
        texts.append(line)
        if is_blank(line):
            st.empty += 1
    st.rows = len(texts)
    table = pa.table(
        {"id": pa.array(range(len(texts)), pa.int64()), "text": pa.array(texts, pa.string())}, schema=schemas.WIKI1M
    )
    return table, st


NLI_HEADER = ["sent0", "sent1", "hard_neg"]


def read_nli(path: str | Path, stats: ReadStats | None = None) -> tuple[pa.Table, ReadStats]:
    """SimCSE's NLI CSV: header `sent0,sent1,hard_neg`, standard CSV quoting."""
    path = require_file(path, "NLI triplet CSV (sent0,sent1,hard_neg)")
    cols: dict[str, list[str]] = {c: [] for c in NLI_HEADER}
    st = stats if stats is not None else ReadStats()
    text = "\n".join(line for _, line in iter_lines(path, st))  # strict UTF-8 with line numbers first
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
        if any(is_blank(c) for c in row):
            st.empty += 1
        for c, v in zip(NLI_HEADER, row):
            cols[c].append(v)
    st.rows = len(cols["sent0"])
    table = pa.table(
        {"id": pa.array(range(st.rows), pa.int64()), **{c: pa.array(v, pa.string()) for c, v in cols.items()}},
        schema=schemas.NLI,
    )
    return table, st


# ---------------------------------------------------------------- SentEval STS


def root_candidates(p: Path) -> tuple[Path, ...]:
    """Where SentEval's data folder may be, given `p`: itself, or its `downstream` level (SentEval's layout)."""
    return p, p / "downstream", p / "data" / "downstream", p / "SentEval" / "data" / "downstream"


def senteval_root(path: str | Path) -> Path:
    """Accept a folder holding STS/ and SICK/, or SentEval's `data/downstream` / `downstream` level."""
    p = Path(path)
    for cand in root_candidates(p):
        if (cand / "STS").is_dir() and (cand / "SICK").is_dir():
            return cand
    raise FileNotFoundError(f"missing SentEval data: expected folders STS/ and SICK/ under {p} (or {p}/downstream)")


def _read_sts_subset(folder: Path, task: str, subset: str, rows: Columns, st: ReadStats) -> None:
    inp = require_file(folder / f"STS.input.{subset}.txt", f"{task} input of subset {subset}")
    gs = require_file(folder / f"STS.gs.{subset}.txt", f"{task} gold scores of subset {subset}")
    pairs = list(iter_lines(inp, st))
    golds = list(iter_lines(gs, st))
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
        s1, s2 = (senteval_words(x) for x in parts)
        if is_blank(s1) or is_blank(s2):
            st.empty += 1
        rows.add(task, subset, "test", n, s1, s2, _score(gs, gn, gold.strip()))
        n += 1
    st.details[f"{task}/{subset}"] = n


SICK_HEADER = ("pair_ID", "sentence_A", "sentence_B", "relatedness_score")
# STS-B and SICK: the tab-separated fields of sentence 1, sentence 2 and score, and what the fields are.
STSB_FIELDS = (5, 6, 4, "expected >= 7 (genre, file, year, id, score, s1, s2)")
SICK_FIELDS = (1, 2, 3, "expected >= 4 (pair_ID, A, B, score)")


def _read_scored(path: Path, task: str, split: str, rows: Columns, st: ReadStats) -> None:
    """An STS-B or SICK split: one scored pair a line (SICK's first line is its header, checked, not skipped: a file
    without it would silently lose its first pair)."""
    i1, i2, iscore, expected = STSB_FIELDS if task == "stsb" else SICK_FIELDS
    n = 0
    for ln, line in iter_lines(path, st):
        if task == "sickr" and ln == 1:
            if tuple(line.strip().split("\t")[:4]) != SICK_HEADER:
                raise DataFormatError(
                    path,
                    1,
                    f"expected the SICK header ({', '.join(SICK_HEADER)}, ...), found "
                    f"{line[:80]!r} (a file without its header line?)",
                )
            continue
        parts = line.strip().split("\t")
        if len(parts) <= max(i1, i2, iscore):
            raise DataFormatError(path, ln, f"{len(parts)} tab-separated fields, {expected}")
        s1, s2 = senteval_words(parts[i1]), senteval_words(parts[i2])
        if is_blank(s1) or is_blank(s2):
            st.empty += 1
        rows.add(task, "all", split, n, s1, s2, _score(path, ln, parts[iscore]))
        n += 1
    st.details[f"{task}/{split}"] = n


def read_senteval(path: str | Path, stats: ReadStats | None = None) -> tuple[pa.Table, ReadStats]:
    """All STS pairs: STS12–16 (test), STS-B train/dev/test, SICK-R train/dev(trial)/test."""
    root = senteval_root(path)
    rows, st = Columns(schemas.STS), (stats if stats is not None else ReadStats())
    for task, subsets in STS_SUBSETS.items():
        folder = root / "STS" / STS_DIRS[task]
        if not folder.is_dir():
            raise FileNotFoundError(f"missing {task}: expected folder {folder}")
        for subset in subsets:
            _read_sts_subset(folder, task, subset, rows, st)
    for split, name in STSB_FILES.items():
        _read_scored(
            require_file(root / "STS" / "STSBenchmark" / name, f"STS-B {split} split"), "stsb", split, rows, st
        )
    for split, name in SICK_FILES.items():
        _read_scored(require_file(root / "SICK" / name, f"SICK {split} split"), "sickr", split, rows, st)
    st.rows = len(rows.cols["task"])
    return rows.table(), st


# The scored pairs of every SentEval STS file set, as ../shared/data/README.md and the papers count them.
SENTEVAL_EXPECTED_ROWS: dict[str, int] = {
    "sts12": 3108,
    "sts13": 1500,
    "sts14": 3750,
    "sts15": 3000,
    "sts16": 1186,
    "stsb/train": 5749,
    "stsb/dev": 1500,
    "stsb/test": 1379,
    "sickr/train": 4500,
    "sickr/dev": 500,
    "sickr/test": 4927,
}


def sts_count_mismatches(stats: ReadStats, expected: dict[str, int]) -> list[tuple[str, int, int]]:
    """(name, found, expected) for every count of `expected` ("sts12" … per task, "stsb/dev" … per split) that the
    STS counts in `stats.details` ("<task>/<subset>" for STS12–16, "<task>/<split>" for STS-B and SICK-R) miss."""
    out = []
    for name, want in expected.items():
        if "/" in name:
            found = stats.details.get(name, 0)
        else:
            found = sum(v for k, v in stats.details.items() if k.startswith(f"{name}/"))
        if found != want:
            out.append((name, found, want))
    return out


def check_senteval_counts(path: str | Path, stats: ReadStats, expected: dict[str, int]) -> None:
    """Compare what `read_senteval` counted (`stats.details`) with `expected` ("sts12" … per task, "stsb/dev" …
    per split); a difference raises `DataFormatError` naming the file (or the task's folder)."""
    root = senteval_root(path)
    for name, found, want in sts_count_mismatches(stats, expected)[:1]:
        if "/" in name:
            task, split = name.split("/", 1)
            files = STSB_FILES if task == "stsb" else SICK_FILES
            where = root / ("STS/STSBenchmark" if task == "stsb" else "SICK") / files.get(split, "?")
        else:
            where = root / "STS" / STS_DIRS.get(name, name)
        raise DataFormatError(
            where, None, f"{found:,d} scored pairs of {name}, expected {want:,d} (a truncated or different file?)"
        )


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
