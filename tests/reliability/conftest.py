"""Small data roots for the reliability suite: the heads of the real mirror's files (../shared/data), ingested
through the real stage functions (called without Prefect, `.fn`), so each test damages and rebuilds in seconds; and
one tiny SimCSE job (`job`) on a data root built once per session."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import pytest

from cse.config.stages import IngestConfig, NliSource, SentEvalSource, TokenizeConfig, WikiSource
from cse.config.training import resolve_train_config
from cse.storage.layout import DataRoot
from cse.storage.settings import get_settings
from cse.tracking.store import configure_mlflow
from tests.loops import loop_config

WIKI_LINES = 300
NLI_ROWS = 200
STEPS = 2  # the training steps of the tiny job (`job`)


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


@pytest.fixture(scope="session")
def data_root(tmp_path_factory, shared_data, tiny_bert_dir, _shared_tracking_store):
    """wiki1m (the first 300 lines), sts and the wiki1m tokens of the tiny BERT, in a data root built once (tests
    read it; the jobs they run write under their own `CSE_HOME`)."""
    from cse.tasks.tokenize import tokenize_dataset

    home = tmp_path_factory.mktemp("job_results_home")
    wiki = home / "wiki.txt"
    with open(shared_data / "wiki1m_head.txt", "rb") as f:
        wiki.write_bytes(b"".join(next(f) for _ in range(300)))
    senteval = home / "senteval"  # the STS and SICK files cut to their first 100 lines: dev selection in a blink
    for src in (shared_data / "senteval").glob("S*/**/*"):
        if src.is_file():
            dst = senteval / src.relative_to(shared_data / "senteval")
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(src, "rb") as f:
                dst.write_bytes(b"".join(line for _, line in zip(range(100), f)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CSE_HOME", str(home))
        mp.setenv("MLFLOW_TRACKING_URI", _shared_tracking_store)
        config = IngestConfig(
            wiki=WikiSource(path=str(wiki)), senteval=SentEvalSource(path=str(senteval), expected_rows=None)
        )
        refs = {"sts": ingest("sts", config)}
        refs["tokens"] = tokenize_dataset.fn(
            ingest("wiki1m", config), TokenizeConfig(tokenizer=str(tiny_bert_dir), max_length=32)
        )
    return home / "data", refs


@pytest.fixture
def job(data_root, tiny_bert_dir, monkeypatch, prefect_harness):
    """Run the tiny job's stage tasks (flows/train.py `train_job`: fit, evaluate, export) with config overrides."""
    folder, refs = data_root
    monkeypatch.setenv("CSE_DATA_ROOT", str(folder))

    def run(**overrides):
        from cse.flows.train import train_job

        return train_job(tiny_job_config(tiny_bert_dir, **overrides), refs["tokens"], None, refs["sts"])

    return run


def tiny_job_config(tiny_bert: Path, /, **overrides):
    """The tiny SimCSE job's config (`job`): `STEPS` steps of batch 8 on 64 sentences of the tiny BERT, with
    `overrides` (a `backbone` among them too)."""
    base = {"backbone": str(tiny_bert), "max_steps": STEPS, "eval_steps": STEPS, "batch_size": 8, "max_length": 32}
    base |= {"max_train_sentences": 64, "test_evaluation": False, "system_metrics": False}
    return resolve_train_config("smoke", base | overrides, method="simcse")


def eight_rows_and_loop(lr: float, precision: str = "fp32", checkpoint_steps: int = 100):
    """Eight 3-token rows (`[1, i + 3, 2]`) and a 2-epoch loop of batch 4 over them, logging every step: the tiny
    training of the non-finite and precision cases (returns `(rows, loop)`)."""
    import numpy as np

    from cse.storage.training_data import TokenRows
    from cse.training.rows import TrainingRows

    seqs = [np.array([1, i + 3, 2]) for i in range(8)]
    rows = TrainingRows(TokenRows(ids=np.arange(8), seqs={"text": seqs}), None, supervised=False, pad_id=0)
    loop = loop_config(learning_rate=lr, epochs=2, checkpoint_steps=checkpoint_steps, precision=precision)
    return rows, loop
