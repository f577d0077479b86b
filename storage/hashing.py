"""Content hashes: of files, of folders of files, and of parameter dictionaries."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_files(paths: Iterable[str | Path]) -> str:
    """One hash over several files, order-sensitive, names excluded (content only)."""
    return combine_hashes(sha256_file(p) for p in paths)


def combine_hashes(digests: Iterable[str]) -> str:
    """The hash `sha256_files` gives for files with these sha256 hex digests, in order."""
    h = hashlib.sha256()
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def stable_hash(obj: Any, length: int = 16) -> str:
    """Hash of a JSON-serialisable object, independent of dict order."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:length]
