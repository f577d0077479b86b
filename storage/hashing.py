"""Content hashes: of files, of folders of files, and of parameter dictionaries."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa


def sha256_file(path: str | Path) -> str:
    """The SHA-256 hex digest of a file (`hashlib.file_digest`: read in chunks, no copy of the whole file).

    Args:
        path: the file to hash.

    Returns:
        The hex digest.
    """
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_files(paths: Iterable[str | Path]) -> str:
    """One hash over several files, order-sensitive, names excluded (content only)."""
    return combine_hashes(sha256_file(p) for p in paths)


def sha256_folder(folder: str | Path) -> str:
    """One hash over the regular files directly in `folder` (names starting with `.` left out), of their names and
    contents in name order: what a model folder is to `from_pretrained` (config, weights, tokenizer files). A file
    replaced by other content changes it whatever its modification time; renaming or adding a file changes it too.

    Args:
        folder: the folder to hash.

    Returns:
        The hex digest.
    """
    files = sorted(p for p in Path(folder).iterdir() if p.is_file() and not p.name.startswith("."))
    return combine_hashes(hashlib.sha256(f"{p.name}\t{sha256_file(p)}".encode()).hexdigest() for p in files)


def combine_hashes(digests: Iterable[str]) -> str:
    """The hash `sha256_files` gives for files with these sha256 hex digests, in order."""
    h = hashlib.sha256()
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    """A canonical JSON string of `obj` (sorted keys, no whitespace) for stable hashing.

    Args:
        obj: a JSON-serialisable object (other values are written with `str`).

    Returns:
        The JSON text.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def stable_hash(obj: Any, length: int = 16) -> str:
    """Hash of a JSON-serialisable object, independent of dict order."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:length]


def arrow_column_hash(column: pa.ChunkedArray) -> str:
    """sha256 of an Arrow column's values, independent of how it is chunked or where it is stored (memory-mapped or
    not): text as its UTF-8 bytes plus every value's length, numbers as float64, nulls by position. For content
    hashes of rows read from a table (Hugging Face dataset sources)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    lengths, data, nulls, row = hashlib.sha256(), hashlib.sha256(), hashlib.sha256(), 0
    text = (
        pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or pa.types.is_string_view(column.type)
    )
    for chunk in column.chunks:
        if chunk.null_count:
            nulls.update((np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False)) + row).astype("<i8").tobytes())
        if text:
            chunk = chunk.cast(pa.large_string())
            offsets = np.frombuffer(chunk.buffers()[1], dtype="<i8")[chunk.offset : chunk.offset + len(chunk) + 1]
            lengths.update(np.diff(offsets).astype("<i8").tobytes())
            if len(chunk) and chunk.buffers()[2] is not None:
                data.update(memoryview(chunk.buffers()[2])[offsets[0] : offsets[-1]])
        else:
            values = pc.cast(chunk, pa.float64()).to_numpy(zero_copy_only=False)
            data.update(np.nan_to_num(values, nan=0.0).astype("<f8").tobytes())
        row += len(chunk)
    kind = "text" if text else "number"
    return combine_hashes(
        [hashlib.sha256(f"{kind}:{row}".encode()).hexdigest(), lengths.hexdigest(), data.hexdigest(), nulls.hexdigest()]
    )
