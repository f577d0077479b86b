"""Dataset manifests: what a dataset holds and exactly what produced it.

Every dataset folder holds its Parquet files and a `manifest.json`. The manifest is written last,
so a folder without one is incomplete. `key` addresses the dataset (a hash of the stage name, its
parameters and the content hashes of its inputs); `content_hash` is a hash of the output files (the Parquet
parts only).

`arrow` records the dataset's memory-mappable Arrow copy (`hf/`, see storage/arrow_copy.py): one Arrow IPC
stream file per Parquet part in Hugging Face's `save_to_disk` layout, with its own sizes, rows and hashes. It is
derived from the parts, so it never enters `content_hash` (keys and run keys do not change with it); manifests
written before it existed have none, and the copy is built on first open.

`seal` (storage/seal.py) is an HMAC of every other field under the data root's key: a manifest rewritten to match
edited files no longer matches its seal.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypedDict

from pydantic import BaseModel, Field

from cse.storage.atomic import write_json
from cse.storage.hashing import combine_hashes, sha256_file
from cse.storage.seal import seal_for

MANIFEST_NAME = "manifest.json"


class ManifestError(ValueError):
    """A manifest that exists but cannot be read (damaged JSON, wrong fields); names the file."""

    def __init__(self, path: str | Path, message: str):
        self.path = str(path)
        super().__init__(f"{path}: {message}")


class ArrowCopy(BaseModel):
    """The Arrow copy of a dataset's Parquet parts: paths relative to the dataset folder (`hf/part-00000.arrow` ...,
    one per part and in the parts' order, then `hf/state.json`, `hf/dataset_info.json` in `meta_files`)."""

    folder: str
    files: list[str]
    meta_files: list[str] = Field(default_factory=list)
    file_sizes: dict[str, int] = Field(default_factory=dict, description="file -> size in bytes (data and meta files)")
    file_rows: dict[str, int] = Field(default_factory=dict, description="Arrow file -> rows")
    file_hashes: dict[str, str] = Field(default_factory=dict, description="file -> sha256 (data and meta files)")
    format: str = "arrow-ipc-stream"

    def all_files(self) -> list[str]:
        return [*self.files, *self.meta_files]


class Manifest(BaseModel):
    """The manifest of a dataset: kind, key, rows, content hash, files and their sizes, provenance and statistics."""

    kind: str
    key: str
    rows: int
    content_hash: str
    files: list[str]
    params: dict[str, Any] = Field(default_factory=dict)
    source: dict[str, Any] = Field(default_factory=dict)
    inputs: dict[str, str] = Field(default_factory=dict, description="input name -> content hash")
    stats: dict[str, Any] = Field(default_factory=dict)
    # Per part file, for verifying a cache hit (storage/integrity.py); empty in manifests written before they existed.
    file_sizes: dict[str, int] = Field(default_factory=dict, description="file -> size in bytes")
    file_rows: dict[str, int] = Field(default_factory=dict, description="file -> rows")
    file_hashes: dict[str, str] = Field(default_factory=dict, description="file -> sha256")
    arrow: ArrowCopy | None = Field(default=None, description="the memory-mappable Arrow copy; None before it is built")
    created: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())
    schema_version: int = 1
    seal: str | None = Field(
        default=None, description="HMAC of the other fields under the data root's seal key (storage/seal.py)"
    )

    def write(self, folder: str | Path) -> Path:
        """Write the manifest into `folder`, sealed when `folder` is in a data root (storage/seal.py; the seal is also
        set on this object, so it equals the manifest read back)."""
        data = json.loads(json.dumps(self.model_dump(), default=str))  # exactly what the file will hold
        data["seal"] = self.seal = seal_for(folder, data)
        return write_json(data, Path(folder) / MANIFEST_NAME)

    @classmethod
    def read(cls, folder: str | Path) -> Manifest:
        path = Path(folder) / MANIFEST_NAME
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(f"no manifest at {path}: the dataset is missing or incomplete") from None
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and pydantic's ValidationError are ValueErrors
            raise ManifestError(path, f"unreadable manifest ({type(e).__name__}: {str(e).splitlines()[0]})") from None

    def paths(self, folder: str | Path) -> list[Path]:
        return [Path(folder) / f for f in self.files]


def read_manifest_if_complete(folder: str | Path) -> Manifest | None:
    """The manifest when the folder holds a complete dataset (manifest and every listed file)."""
    folder = Path(folder)
    if not (folder / MANIFEST_NAME).is_file():
        return None
    m = Manifest.read(folder)
    if all((folder / f).is_file() for f in m.files):
        return m
    return None


class FileFacts(TypedDict):
    """The manifest fields `file_facts` gives: per part file its size, rows and sha256, and the content hash."""

    file_sizes: dict[str, int]
    file_rows: dict[str, int]
    file_hashes: dict[str, str]
    content_hash: str


def file_facts(folder: str | Path, files: list[str]) -> FileFacts:
    """What a manifest records per part file: size, rows (Parquet footer) and sha256."""
    import pyarrow.parquet as pq

    folder = Path(folder)
    sizes: dict[str, int] = {}
    rows: dict[str, int] = {}
    hashes: dict[str, str] = {}
    for f in files:
        p = folder / f
        sizes[f] = p.stat().st_size
        rows[f] = pq.ParquetFile(p).metadata.num_rows
        hashes[f] = sha256_file(p)
    return {
        "file_sizes": sizes,
        "file_rows": rows,
        "file_hashes": hashes,
        "content_hash": combine_hashes([hashes[f] for f in files]),
    }
