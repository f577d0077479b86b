"""Resolving a configured source (local path, mirror or URL) to a file on disk, and reading it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from storage import readers
from storage.fetch import download, extract_tar, mirror_lookup, verify
from storage.hashing import sha256_file, sha256_files
from storage.layout import DataRoot
from storage.readers import ReadStats

CANONICAL_NAMES = {"wiki1m": "wiki1m_for_simcse.txt", "nli": "nli_for_simcse.csv", "sts": "senteval"}


@dataclass(frozen=True)
class ResolvedSource:
    dataset: str
    path: Path  # a file (wiki1m, nli) or the SentEval folder (sts)
    origin: str  # "path" | "mirror" | "url"
    location: str  # the path or URL it came from
    content_hash: str

    def describe(self) -> dict[str, str]:
        return {"dataset": self.dataset, "origin": self.origin, "location": self.location, "file": str(self.path)}


def resolve_source(root: DataRoot, dataset: str, path: str | None, url: str, *, sha256: str | None, retries: int) -> ResolvedSource:
    """Local `path` wins; then `$CSE_SOURCE_MIRROR`; else the canonical URL (downloaded once, cached)."""
    canonical = CANONICAL_NAMES[dataset]
    if path is not None:
        p, origin, location = Path(path).expanduser().resolve(), "path", str(path)
        if not p.exists():
            raise FileNotFoundError(f"missing {dataset} source: expected {'a folder' if dataset == 'sts' else 'a file'} at {p}")
    elif (m := mirror_lookup(canonical)) is not None:
        p, origin, location = m, "mirror", str(m)
    else:
        origin, location = "url", url
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


def read_source(src: ResolvedSource, *, strict: bool = False,
                max_line_chars: int = readers.MAX_LINE_CHARS) -> tuple[pa.Table, ReadStats]:
    """Parse the source; `strict` turns control characters and lines over `max_line_chars` into errors."""
    reader = {"wiki1m": readers.read_wiki1m, "nli": readers.read_nli, "sts": readers.read_senteval}[src.dataset]
    return reader(src.path, ReadStats(strict=strict, max_line_chars=max_line_chars))
