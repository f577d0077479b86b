"""The only package that knows paths, file formats and Parquet schemas."""

from cse import refuse_bare_name
from cse.storage.atomic import atomic_dir, atomic_file, write_json, write_parquet
from cse.storage.hashing import sha256_file, stable_hash
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest

refuse_bare_name(__name__)

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
