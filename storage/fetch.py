"""Fetching canonical source files: retries, a progress bar, size and checksum checks, atomic.

`CSE_SOURCE_MIRROR` (a folder) replaces the network: each source is looked up there under its
canonical name and then under the name of the sample the project's local mirror ships. Which file
was read is recorded in every manifest and MLflow run, so a sample never passes for the full data.
"""

from __future__ import annotations

import logging
import os
import tarfile
import time
from pathlib import Path

import requests
from tqdm.auto import tqdm

from cse.storage.atomic import atomic_dir, atomic_file
from cse.storage.hashing import sha256_file
from cse.storage.secrets import redact

log = logging.getLogger(__name__)

# canonical file name -> names it may carry in a local mirror (canonical first)
MIRROR_NAMES: dict[str, tuple[str, ...]] = {
    "wiki1m_for_simcse.txt": ("wiki1m_for_simcse.txt", "wiki1m_head.txt"),
    "nli_for_simcse.csv": ("nli_for_simcse.csv", "snli_triplets.csv"),
    "senteval": ("senteval", "SentEval/data/downstream", "downstream"),
}


class ChecksumError(ValueError):
    """A downloaded file's size or SHA-256 differs from the expected value."""


def mirror_lookup(canonical: str) -> Path | None:
    """The file (or folder) standing for `canonical` in `$CSE_SOURCE_MIRROR`, if that is set."""
    mirror = os.environ.get("CSE_SOURCE_MIRROR")
    if not mirror:
        return None
    root = Path(mirror).expanduser()
    for name in MIRROR_NAMES.get(canonical, (canonical,)):
        if (root / name).exists():
            if name != canonical:
                log.warning(
                    "reading %s from the mirror's sample %s, not the full canonical file", canonical, root / name
                )
            return (root / name).resolve()
    raise FileNotFoundError(f"CSE_SOURCE_MIRROR={root} holds none of {list(MIRROR_NAMES.get(canonical, (canonical,)))}")


def verify(path: Path, sha256: str | None = None, size: int | None = None) -> None:
    """Check a file's size and SHA-256 against expected values; a value left `None` is not checked.

    Args:
        path: the file to check.
        sha256: the expected hex digest (case-insensitive).
        size: the expected size in bytes.

    Raises:
        ChecksumError: the size or digest differs.
    """
    if size is not None and path.stat().st_size != size:
        raise ChecksumError(f"{path}: size {path.stat().st_size} bytes, expected {size}")
    if sha256 is not None and (got := sha256_file(path)) != sha256.lower():
        raise ChecksumError(f"{path}: sha256 {got}, expected {sha256}")


def download(url: str, dest: str | Path, *, retries: int = 3, sha256: str | None = None, timeout: float = 60.0) -> Path:
    """Download `url` to `dest` (kept as a cache: an existing verified file is reused)."""
    dest = Path(dest)
    if dest.is_file():
        verify(dest, sha256)
        return dest
    last: Exception | None = None
    for attempt in range(retries + 1):
        try:
            with requests.get(url, stream=True, timeout=timeout) as r:
                r.raise_for_status()
                total = int(r.headers.get("content-length", 0)) or None
                with (
                    atomic_file(dest) as tmp,
                    open(tmp, "wb") as f,
                    tqdm(total=total, unit="B", unit_scale=True, desc=f"download {dest.name}") as bar,
                ):
                    for chunk in r.iter_content(chunk_size=1 << 20):
                        f.write(chunk)
                        bar.update(len(chunk))
                    f.flush()
                    if total is not None and f.tell() != total:
                        raise OSError(f"truncated download of {redact(url)}: {f.tell()} of {total} bytes")
            verify(dest, sha256)
            return dest
        except (requests.RequestException, OSError) as e:
            last = e
            if attempt < retries:
                wait = 2**attempt
                log.warning(
                    "download of %s failed (%s); retry %d/%d in %ds", redact(url), redact(e), attempt + 1, retries, wait
                )
                time.sleep(wait)
    raise ConnectionError(
        f"could not download {redact(url)} after {retries + 1} attempts ({redact(last)}); "
        "set the source's `path` to a local copy, or CSE_SOURCE_MIRROR to a folder holding it"
    )


def extract_tar(archive: str | Path, dest: str | Path) -> Path:
    """Extract a tar archive into `dest` atomically (reused when `dest` already exists)."""
    dest = Path(dest)
    if dest.is_dir():
        return dest
    with atomic_dir(dest) as tmp, tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    return dest
