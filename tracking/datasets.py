"""What a stage read, as MLflow datasets: the "Datasets used" of a run in the MLflow UI and `run.inputs`.

Two kinds, both `mlflow.data.dataset.Dataset` subclasses, so `mlflow.log_input` and the client's `log_inputs` take them:

- `ParquetDataset`: a published dataset of the data root (Parquet parts + `manifest.json`, storage/datasets.py).
  name `<kind>/<key>`; digest = the manifest's content hash (its first `DIGEST_CHARS` hex digits: MLflow stores at
  most 36 characters, a VARCHAR(36) column on PostgreSQL); source = the dataset folder
  (`DataRoot.dataset_dir`, a `local` source); schema = the Parquet schema as MLflow column specs; profile = rows,
  part files, bytes, the full content hash, the key and when it was written.
- `SourceDataset`: a raw input read as it came (an ingestion source file, a SentEval folder given as a path, a
  Hugging Face dataset): source = the URL it was downloaded from, else the file or folder (a hub dataset: a
  `hugging_face` source with its id, config and split); digest = its sha256 (an HF dataset: the hash of the rows read);
  profile = the full hash (and the rows read from it, with their schema, when the caller has them).

`as_dataset` / `as_datasets` turn what the stages hold (a `DatasetRef`, a `Manifest`, a `ResolvedSource` of a file,
folder, URL or Hugging Face dataset, an STS or transfer evaluation input) into them;
`cse.tracking.lineage.log_dataset_inputs` logs them with their context.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from mlflow.data.dataset import Dataset
from mlflow.data.dataset_source import DatasetSource
from mlflow.data.http_dataset_source import HTTPDatasetSource
from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource
from mlflow.data.sources import LocalArtifactDatasetSource  # type: ignore[attr-defined]  # made at import by MLflow's source registry
from mlflow.types.schema import Array, ColSpec, DataType, Object, Property, Schema

from cse.storage.datasets import DatasetRef
from cse.storage.evaluations import StsInput
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest
from cse.storage.settings import get_settings
from cse.storage.transfer import TransferInput

DIGEST_CHARS = 36  # mlflow.utils.validation.MAX_DATASET_DIGEST_SIZE (the SQL stores' digest column)
_SOURCE_FIELDS = ("dataset", "path", "origin", "location", "content_hash")  # cse.storage.sources.ResolvedSource


def digest_of(content_hash: str) -> str:
    """The MLflow digest of a content hash: its first `DIGEST_CHARS` characters (a prefix, so it still matches the
    hash printed by `cse dataset`, the manifests and the run tags)."""
    if not content_hash:
        raise ValueError("a dataset needs a content hash to be logged as an MLflow input")
    return content_hash[:DIGEST_CHARS]


# ------------------------------------------------------------------------------------------------ schemas
_SCALARS: dict[Any, DataType] = {
    pa.bool_(): DataType.boolean,
    pa.int8(): DataType.integer,
    pa.int16(): DataType.integer,
    pa.int32(): DataType.integer,
    pa.uint8(): DataType.integer,
    pa.uint16(): DataType.integer,
    pa.int64(): DataType.long,
    pa.uint32(): DataType.long,
    pa.uint64(): DataType.long,
    pa.float16(): DataType.float,
    pa.float32(): DataType.float,
    pa.float64(): DataType.double,
    pa.string(): DataType.string,
    pa.large_string(): DataType.string,
    pa.binary(): DataType.binary,
    pa.large_binary(): DataType.binary,
}


def _mlflow_type(t: pa.DataType, where: str):
    if t in _SCALARS:
        return _SCALARS[t]
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return DataType.datetime
    if pa.types.is_dictionary(t):
        return _mlflow_type(t.value_type, where)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return Array(_mlflow_type(t.value_type, f"{where}[]"))
    if pa.types.is_struct(t):
        return Object([Property(f.name, _mlflow_type(f.type, f"{where}.{f.name}"), required=not f.nullable) for f in t])
    raise TypeError(f"column {where}: Arrow type {t} has no MLflow schema type")


def mlflow_schema(schema: pa.Schema) -> Schema:
    """An Arrow schema as MLflow column specs (what the UI's dataset drawer lists): a column that cannot be null is
    `required`; lists become arrays, structs objects. An Arrow type MLflow cannot express raises a TypeError naming
    the column."""
    return Schema([ColSpec(_mlflow_type(f.type, f.name), f.name, required=not f.nullable) for f in schema])


# ------------------------------------------------------------------------------------------------ datasets
class _ArrowDataset(Dataset):
    """A dataset whose columns are an Arrow schema (`arrow_schema`, None: unknown) and whose digest is always given."""

    arrow_schema: pa.Schema | None

    @property
    def schema(self) -> Schema | None:
        return mlflow_schema(self.arrow_schema) if self.arrow_schema is not None else None

    def _compute_digest(self) -> str:
        """Never called: every dataset here is given its digest (`digest_of` refuses an empty content hash)."""
        raise ValueError(f"{type(self).__name__} {self.name}: no digest given")

    def to_dict(self) -> dict[str, str]:
        schema = self.schema
        colspec = json.dumps({"mlflow_colspec": schema.to_dict()}) if schema is not None else None
        return {
            **super().to_dict(),
            "schema": colspec,  # type: ignore[dict-item]  # None, as MLflow's own datasets give it: no schema
            "profile": json.dumps(self.profile, default=str),
        }


class ParquetDataset(_ArrowDataset):
    """A published dataset of the data root, as MLflow logs it (see the module docstring)."""

    def __init__(self, folder: str | Path, manifest: Manifest, schema: pa.Schema | None = None):
        self.folder = Path(folder)
        self.manifest = manifest
        self.arrow_schema = schema if schema is not None else self._read_schema()
        super().__init__(
            source=LocalArtifactDatasetSource(str(self.folder)),
            name=f"{manifest.kind}/{manifest.key}",
            digest=digest_of(manifest.content_hash),
        )

    @classmethod
    def from_manifest(cls, manifest: Manifest, root: DataRoot | None = None) -> ParquetDataset:
        """The dataset `manifest` describes, in `root` (default: the configured data root)."""
        root = root or DataRoot(get_settings().data_root)
        return cls(root.dataset_dir(manifest.kind, manifest.key), manifest)

    @classmethod
    def from_ref(cls, ref: DatasetRef) -> ParquetDataset:
        """The dataset a stage returned (its folder's manifest is read: the ref carries no schema or file list)."""
        return cls(ref.path, Manifest.read(ref.path))

    def _read_schema(self) -> pa.Schema | None:
        """The Arrow schema from the first part's Parquet footer (every part shares it); None without parts, or when
        the footer cannot be read (the stage that reads the data names a damaged file; lineage does not)."""
        parts = self.manifest.paths(self.folder)
        try:
            return pq.read_schema(parts[0]) if parts else None
        except (OSError, pa.ArrowException):
            return None

    @property
    def profile(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "num_rows": m.rows,
            "num_files": len(m.files),
            "size_bytes": sum(m.file_sizes.values()),
            "content_hash": m.content_hash,
            "kind": m.kind,
            "key": m.key,
            "created": m.created,
        }


class SourceDataset(_ArrowDataset):
    """A raw input read as it came: a source file or folder (or the URL it was downloaded from) and its sha256."""

    def __init__(
        self,
        name: str,
        source: DatasetSource,
        sha256: str,
        *,
        rows: int | None = None,
        schema: pa.Schema | None = None,
        details: dict[str, Any] | None = None,
    ):
        self.sha256, self.rows, self.arrow_schema = sha256, rows, schema
        self.details = dict(details or {})
        super().__init__(source=source, name=name, digest=digest_of(sha256))

    @staticmethod
    def source_for(location: str, path: str | Path | None = None) -> DatasetSource:
        """Where a raw input came from: an http(s) URL as an `http` source, else the local file or folder."""
        if location.startswith(("http://", "https://")):
            return HTTPDatasetSource(location)
        return LocalArtifactDatasetSource(str(Path(path if path is not None else location).expanduser().resolve()))

    @property
    def profile(self) -> dict[str, Any]:
        return {**({"num_rows": self.rows} if self.rows is not None else {}), "sha256": self.sha256, **self.details}


def _hf_dataset(kind: str, rows: Any) -> SourceDataset:
    """One Hugging Face dataset an ingestion source read (`cse.storage.hf_sources.HFRows`): a hub dataset as a
    `hugging_face` source (hub id, config, split, revision, data files), a local one as its folder; digest = the hash
    of the rows read; with their count and schema."""
    spec = rows.spec
    local = spec.dataset.startswith(("/", "./", "../", "~")) or Path(spec.dataset).expanduser().exists()
    source = (
        LocalArtifactDatasetSource(str(Path(rows.folder).resolve()))
        if local
        else HuggingFaceDatasetSource(
            path=spec.dataset,
            config_name=spec.config,
            data_files=spec.data_files,
            split=rows.split,
            revision=spec.revision,
        )
    )
    return SourceDataset(
        f"{kind}-source/{rows.where}",
        source,
        rows.content_hash(),
        rows=rows.table.num_rows,
        schema=rows.table.schema,
        details={"origin": "hf", "location": rows.where},
    )


def as_datasets(item: Any, root: DataRoot | None = None) -> list[Dataset]:
    """`as_dataset`, except that an ingestion source made of several Hugging Face datasets (`hf:a + hf:b`) gives one
    MLflow dataset per HF dataset (each with the hash of its own rows)."""
    parts = getattr(item, "hf", ()) if all(hasattr(item, a) for a in _SOURCE_FIELDS) else ()
    if parts:
        return [_hf_dataset(item.dataset, rows) for rows in parts]
    return [as_dataset(item, root)]


def as_dataset(item: Any, root: DataRoot | None = None) -> Dataset:
    """The MLflow dataset of what a stage read:
    - a `DatasetRef` or a `Manifest` (a published dataset) → `ParquetDataset`;
    - a resolved ingestion source (`cse.storage.sources.ResolvedSource`: dataset, path, origin, location, content hash)
      → `SourceDataset` named `<dataset>-source/<file or folder name>` (a Hugging Face source:
      `<dataset>-source/hf:<id>[:<config>][@<split>]`, its hub id or folder, the rows' hash, count and schema);
    - an evaluation input (`cse.storage.evaluations.StsInput`, `cse.storage.transfer.TransferInput`) → the
      `ParquetDataset` of its `sts` / `transfer` dataset when it came from one (origin `dataset`), else a
      `SourceDataset` of its SentEval folder with the table's rows and schema;
    - an MLflow `Dataset` → itself.
    Anything else raises a TypeError naming its type."""
    if isinstance(item, Dataset):
        return item
    if isinstance(item, DatasetRef):
        return ParquetDataset.from_ref(item)
    if isinstance(item, Manifest):
        return ParquetDataset.from_manifest(item, root)
    if isinstance(item, (StsInput, TransferInput)):
        kind = "sts" if isinstance(item, StsInput) else "transfer"
        if item.origin == "dataset":
            root = root or DataRoot(get_settings().data_root)
            return ParquetDataset(root.dataset_dir(kind, item.location), root.require(kind, item.location))
        folder = Path(item.location)
        return SourceDataset(
            f"{kind}-source/{folder.name}",
            SourceDataset.source_for(str(folder)),
            item.content_hash,
            rows=item.table.num_rows,
            schema=item.table.schema,
            details={"origin": item.origin, "location": item.location},
        )
    # cse.storage.sources.ResolvedSource (or any source shaped like it)
    if all(hasattr(item, a) for a in _SOURCE_FIELDS):
        parts: tuple[Any, ...] = getattr(item, "hf", ())
        if len(parts) == 1:
            return _hf_dataset(item.dataset, parts[0])
        if parts:
            raise ValueError(f"{item.location}: {len(parts)} Hugging Face datasets: use as_datasets (one per dataset)")
        path = Path(item.path)
        return SourceDataset(
            f"{item.dataset}-source/{path.name}",
            SourceDataset.source_for(item.location, path),
            item.content_hash,
            details={"origin": item.origin, "location": item.location, "file": str(path)},
        )
    raise TypeError(
        f"cannot log a {type(item).__name__} as an MLflow dataset input: pass a DatasetRef, a Manifest, a "
        "resolved source, an STS/transfer evaluation input or an mlflow.data Dataset"
    )
