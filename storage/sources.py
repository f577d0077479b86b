"""Resolving a configured source (local path, Hugging Face dataset, mirror or URL) to its rows, and reading them.

A file source resolves to a file on disk (its content hash: the file's sha256); an HF dataset source
(storage/hf_sources.py) to its loaded, memory-mapped rows (its content hash: that of the rows read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from cse.storage import readers
from cse.storage.fetch import ChecksumError, download, extract_tar, mirror_lookup, verify
from cse.storage.hashing import combine_hashes, sha256_file, sha256_files
from cse.storage.hf_sources import HFRows, HFSource, hf_rows, read_hf
from cse.storage.layout import DataRoot
from cse.storage.readers import DataFormatError, ReadStats
from cse.storage.secrets import redact

CANONICAL_NAMES = {"wiki1m": "wiki1m_for_simcse.txt", "nli": "nli_for_simcse.csv", "sts": "senteval"}
# Rows of the full canonical sources (SimCSE's files): fewer rows ingested means a sample stood in for them.
FULL_ROWS = {"wiki1m": 1_000_000, "nli": 275_601}


@dataclass(frozen=True)
class ResolvedSource:
    """A resolved ingest source: the local file or folder, where it came from and its content hash."""

    dataset: str
    path: Path  # a file (wiki1m, nli) or the SentEval folder (sts); an HF source: the folder of its (first) dataset
    origin: str  # "path" | "mirror" | "url" | "hf"
    location: str  # the path or URL (credentials masked) it came from (`hf:<dataset>@<split>`, " + "-joined for HF)
    content_hash: str
    hf: tuple[HFRows, ...] = field(default=(), compare=False, repr=False)  # the loaded rows of an HF source

    @property
    def where(self) -> str:
        """What error messages name: the file or folder, or the HF dataset(s) (`hf:<dataset>@<split>`)."""
        return self.location if self.origin == "hf" else str(self.path)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dataset": self.dataset,
            "origin": self.origin,
            "location": self.location,
            "file": self.where,
        }
        if self.hf:
            out["hf"] = [rows.describe() for rows in self.hf]
        return out


def resolve_source(
    root: DataRoot,
    dataset: str,
    path: str | None,
    url: str,
    *,
    sha256: str | None,
    retries: int,
    hf: Sequence[HFSource] = (),
) -> ResolvedSource:
    """Local `path` wins; then the HF dataset(s) `hf` (loaded, memory-mapped; hub downloads cached under
    `<data_root>/downloads/hf`); then `$CSE_SOURCE_MIRROR`; else the canonical URL (downloaded once, cached).
    `sha256` is checked against the file, or against the rows' content hash of an HF source."""
    canonical = CANONICAL_NAMES[dataset]
    if path is None and hf:
        parts = tuple(hf_rows(dataset, spec, root.downloads / "hf") for spec in hf)
        digest = parts[0].content_hash() if len(parts) == 1 else combine_hashes(p.content_hash() for p in parts)
        location = " + ".join(p.where for p in parts)
        if sha256 is not None and digest != sha256.lower():
            raise ChecksumError(f"{location}: sha256 of the rows read is {digest}, expected {sha256.lower()}")
        return ResolvedSource(
            dataset=dataset, path=parts[0].folder, origin="hf", location=location, content_hash=digest, hf=parts
        )
    if path is not None:
        p, origin, location = Path(path).expanduser().resolve(), "path", str(path)
        if not p.exists():
            raise FileNotFoundError(
                f"missing {dataset} source: expected {'a folder' if dataset == 'sts' else 'a file'} at {p}"
            )
    elif (m := mirror_lookup(canonical)) is not None:
        p, origin, location = m, "mirror", str(m)
    else:
        origin, location = "url", redact(url)  # what manifests, MLflow and cards record: no credential
        if dataset == "sts":
            archive = download(url, root.downloads / "senteval.tar", retries=retries, sha256=sha256)
            p = extract_tar(archive, root.downloads / "senteval")
        else:
            p = download(url, root.downloads / canonical, retries=retries, sha256=sha256)
    if dataset == "sts":
        files = readers.senteval_source_files(p)
        digest = sha256_files(files)
    else:
        if p.is_dir():
            raise FileNotFoundError(f"{dataset} source {p} is a folder: expected the file {canonical}")
        if sha256 is not None and origin != "url":
            verify(p, sha256)
        digest = sha256_file(p)
    return ResolvedSource(dataset=dataset, path=p, origin=origin, location=location, content_hash=digest)


def read_source(
    src: ResolvedSource, *, strict: bool = False, max_line_chars: int = readers.MAX_LINE_CHARS
) -> tuple[pa.Table, ReadStats]:
    """Parse the source; `strict` turns control characters and lines over `max_line_chars` into errors."""
    stats = ReadStats(strict=strict, max_line_chars=max_line_chars)
    if src.origin == "hf":
        return read_hf(src.dataset, list(src.hf), stats)
    reader = {"wiki1m": readers.read_wiki1m, "nli": readers.read_nli, "sts": readers.read_senteval}[src.dataset]
    return reader(src.path, stats)


def check_sts_counts(src: ResolvedSource, stats: ReadStats, expected: dict[str, int]) -> None:
    """The STS pairs read against `expected` (`readers.check_senteval_counts`): a difference raises `DataFormatError`
    naming the file, or for an HF source the HF dataset(s) holding that task."""
    if src.origin != "hf":
        readers.check_senteval_counts(src.path, stats, expected)
        return
    for name, found, want in readers.sts_count_mismatches(stats, expected)[:1]:
        task = name.split("/")[0]
        holders = [rows.where for rows in src.hf if rows.constants.get("task") in (task, None)] or [src.location]
        raise DataFormatError(
            " + ".join(holders),
            None,
            f"{found:,d} scored pairs of {name}, expected {want:,d} "
            "(a different or partial dataset? set senteval.expected_rows)",
        )


def ingested_origin(root: DataRoot, tokens: str) -> dict | None:
    """Where the training rows of a tokens dataset came from, without local paths (for model cards).

    Args:
        root: the data root.
        tokens: the tokens dataset's key or content hash.

    Returns:
        `{"dataset", "dataset_key", "origin", "source", "rows", "full_rows", "sample"}`: the ingested dataset's kind
        (`wiki1m`, `nli`) and key, how its source was found (`path`, `mirror`, `url`, `hf`), the source as a file name,
        URL or `hf:<id>@<split>` (never a local folder), its rows, the full canonical source's rows and whether fewer
        rows than those were ingested (None where the full size is unknown). None when the tokens dataset or the
        dataset it was tokenised from is not in `root`.
    """
    manifest = root.find("tokens", tokens) if "/" not in tokens else None
    if manifest is None:
        manifest = next((m for _, m in reversed(root.list("tokens")) if m.content_hash == tokens), None)
    if manifest is None or not manifest.source.get("kind") or not manifest.source.get("key"):
        return None
    kind, key = str(manifest.source["kind"]), str(manifest.source["key"])
    ingested = root.find(kind, key)
    if ingested is None:
        return None
    src = ingested.source
    origin = str(src.get("origin", "unknown"))
    location = str(src.get("location") or src.get("file") or "")
    source = location if origin in ("url", "hf") else Path(str(src.get("file") or location)).name
    full = FULL_ROWS.get(kind)
    return {
        "dataset": kind,
        "dataset_key": key,
        "origin": origin,
        "source": source,
        "rows": ingested.rows,
        "full_rows": full,
        "sample": None if full is None else ingested.rows < full,
    }
