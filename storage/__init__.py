"""The only package that knows paths, file formats and Parquet schemas."""

from storage.atomic import atomic_dir, atomic_file, write_json, write_parquet
from storage.hashing import sha256_file, stable_hash
from storage.layout import DataRoot
from storage.manifest import Manifest

__all__ = [
    "DataRoot",
    "Manifest",
    "atomic_dir",
    "atomic_file",
    "sha256_file",
    "stable_hash",
    "write_json",
    "write_parquet",
]
