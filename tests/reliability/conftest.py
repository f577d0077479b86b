"""Small data roots for the reliability suite: the heads of the real mirror's files (../shared/data), ingested
through the real stage functions (called without Prefect, `.fn`), so each test damages and rebuilds in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import pytest

from cse.config.settings import get_settings
from cse.config.stages import IngestConfig, NliSource, SentEvalSource, WikiSource
from cse.storage.layout import DataRoot
from cse.tracking.store import configure_mlflow

WIKI_LINES = 300
NLI_ROWS = 200


@pytest.fixture
def sources(shared_data, tmp_path) -> dict[str, Path]:
    """Source files in tmp_path: the first lines of Wiki1M and NLI, and a copy of SentEval's STS and SICK."""
    d = tmp_path / "sources"
    d.mkdir()
    with open(shared_data / "wiki1m_head.txt", "rb") as f:
        (d / "wiki.txt").write_bytes(b"".join(next(f) for _ in range(WIKI_LINES)))
    with open(shared_data / "snli_triplets.csv", "rb") as f:
        (d / "nli.csv").write_bytes(b"".join(next(f) for _ in range(NLI_ROWS + 1)))
    senteval = d / "senteval"
    for sub in ("STS", "SICK"):
        shutil.copytree(shared_data / "senteval" / sub, senteval / sub)
    return {"wiki1m": d / "wiki.txt", "nli": d / "nli.csv", "sts": senteval}


@pytest.fixture
def ingest_config(sources) -> IngestConfig:
    return IngestConfig(
        wiki=WikiSource(path=str(sources["wiki1m"])),
        nli=NliSource(path=str(sources["nli"])),
        senteval=SentEvalSource(path=str(sources["sts"])),
    )


@pytest.fixture
def root() -> DataRoot:
    return DataRoot(get_settings().data_root)


def ingest(dataset: str, config: IngestConfig, **kw):
    from cse.tasks.ingest import ingest_dataset

    return ingest_dataset.fn(dataset, config, **kw)


def data_runs(run_name: str | None = None) -> list:
    """The MLflow runs of experiment `data`, oldest first (optionally only those named `run_name`)."""
    configure_mlflow()
    runs = mlflow.search_runs(experiment_names=["data"], output_format="list", order_by=["attributes.start_time ASC"])
    return [r for r in runs if run_name is None or r.info.run_name == run_name]


def part(root: DataRoot, kind: str, key: str, i: int = 0) -> Path:
    return root.dataset_dir(kind, key) / f"part-{i:05d}.parquet"


def flip_byte_in_data(path: Path) -> int:
    """Flip one byte inside the first column chunk of a Parquet file (size and footer unchanged); returns its offset."""
    import pyarrow.parquet as pq

    col = pq.ParquetFile(path).metadata.row_group(0).column(0)
    start = col.dictionary_page_offset or col.data_page_offset
    offset = start + col.total_compressed_size - 3  # inside the page data, before the footer
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    return offset


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.fixture(scope="session")
def _shared_tracking_store(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('reliability_mlflow') / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def shared_tracking_store(isolated_home, _shared_tracking_store, monkeypatch) -> str:
    """One MLflow store for the whole suite (creating a SQLite store costs seconds); each test still has its own
    data root, and tests read only their newest runs."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _shared_tracking_store)
    return _shared_tracking_store
