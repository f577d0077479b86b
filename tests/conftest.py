"""Shared fixtures: one tiny model family, an isolated CSE_HOME, the local data mirror.

Tests needing `../shared/data` fail loudly when it is missing (they never skip).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")

import pytest
import torch
from prefect.logging.configuration import ensure_logging_setup

from cse.models.loading import PACKAGED_MINILM, load_tokenizer
from cse.storage.settings import REPO_ROOT
from tests.batches import tiny_bert_config

# Prefect's logging configured now, once, as a real process does at its first `import prefect`: the console handler it
# puts on the root logger keeps the sys.stderr of that moment. Configured at the first import inside a test using
# capsys, it would keep that test's capture stream, closed when the test ends, and every later warning in the session
# would print "--- Logging error ---" and a traceback into the next test's stderr (an order-dependent failure).
ensure_logging_setup()

SHARED_DATA = Path(os.environ.get("CSE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data")).resolve()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real local mirror. Missing → a hard failure naming what was expected."""
    expected = [
        SHARED_DATA / "wiki1m_head.txt",
        SHARED_DATA / "snli_triplets.csv",
        SHARED_DATA / "senteval" / "STS" / "STSBenchmark" / "sts-test.csv",
    ]
    missing = [str(p) for p in expected if not p.exists()]
    if missing:
        pytest.fail(f"the shared data mirror is missing (expected beside the repo): {missing}", pytrace=False)
    return SHARED_DATA


@pytest.fixture(scope="session")
def wiki_cut(shared_data, tmp_path_factory):
    """`wiki_cut(lines, name=None)`: a file (`name`, default `wiki1m_first_<lines>.txt`) holding the first `lines`
    lines of the real Wiki1M sample."""

    def cut(lines: int, name: str | None = None) -> Path:
        path = tmp_path_factory.mktemp(f"wiki_head_{lines}") / (name or f"wiki1m_first_{lines}.txt")
        with open(shared_data / "wiki1m_head.txt", encoding="utf-8") as f:
            path.write_text("".join(line for _, line in zip(range(lines), f)), encoding="utf-8")
        return path

    return cut


@pytest.fixture(scope="session")
def wiki_head(wiki_cut) -> Path:
    """The first 512 lines of the real Wiki1M sample: flows whose jobs each corrupt the whole corpus stay fast."""
    return wiki_cut(512)


@pytest.fixture(scope="session")
def senteval_cut(shared_data, tmp_path_factory):
    """`senteval_cut(lines)`: a folder holding every SentEval STS and SICK file cut to its first `lines` lines."""

    def cut(lines: int) -> Path:
        out, src = tmp_path_factory.mktemp(f"senteval_head_{lines}"), shared_data / "senteval"
        for f in [*src.glob("STS/*/*"), *src.glob("SICK/*")]:
            target = out / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(f, "rb") as fh:
                target.write_bytes(b"".join(line for _, line in zip(range(lines), fh)))
        return out

    return cut


@pytest.fixture(scope="session")
def senteval_head(senteval_cut) -> Path:
    """The real SentEval STS and SICK files cut to their first 24 lines (about 550 scored pairs): a test evaluation
    in seconds. Ingest it with `senteval: {"path": ..., "expected_rows": null}` (the counts of the full files do not
    hold)."""
    return senteval_cut(24)


@pytest.fixture(scope="session")
def mlflow_store_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store with its schema migrated once per session (seconds each time otherwise); None
    where MLflow is not installed (a GPU node with the training wheelhouse runs `pytest -m gpu` without it)."""
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        return None
    from cse.tracking.store import prepare_sqlite_store

    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    prepare_sqlite_store(path)
    return path


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory, monkeypatch, mlflow_store_template) -> Path:
    """Every test gets its own CSE_HOME (data root + MLflow store, a copy of the migrated empty store)."""
    home = tmp_path_factory.mktemp("cse_home")
    if mlflow_store_template is not None:
        shutil.copyfile(mlflow_store_template, home / "mlflow.db")
    monkeypatch.setenv("CSE_HOME", str(home))
    for name in ("CSE_DATA_ROOT", "MLFLOW_TRACKING_URI", "CSE_MLFLOW_ARTIFACTS"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture(scope="session")
def tokenizer():
    """The bert-base-uncased vocabulary (from the packaged MiniLM)."""
    return load_tokenizer(PACKAGED_MINILM)


@pytest.fixture(scope="session")
def minilm_path() -> str:
    from cse.models.loading import resolve_model_path

    return resolve_model_path(PACKAGED_MINILM)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory, tokenizer) -> Path:
    """A random-initialised 2-layer BERT (hidden 32) with the bert-base-uncased vocabulary, saved with its tokenizer."""
    from transformers import BertModel

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny_bert")
    BertModel(tiny_bert_config(len(tokenizer))).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_generator_dir(tmp_path_factory, tokenizer) -> Path:
    """A random-initialised small DistilBERT masked LM with the bert-base-uncased vocabulary."""
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny_generator")
    cfg = DistilBertConfig(
        vocab_size=len(tokenizer), dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=128
    )
    DistilBertForMaskedLM(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect server (SQLite) for every flow test of the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def local_ingest_config(shared_data):
    from cse.config.stages import local_mirror_ingest

    return local_mirror_ingest(shared_data)


# The end-to-end folders: flows through a Prefect server, the team stack, Dask, torchrun, damaged data roots.
# `make test-fast` (pytest -m "not slow") leaves them out; `make test` runs everything.
SLOW_FOLDERS = ("flows", "ops", "reliability")
# Unit tests that live beside their package's slow tests but start nothing (no server, stack or subprocess).
FAST_FILES = ("ops/test_cli_push.py", "ops/test_cli_fixes.py")
# The tests `make test` runs in a second pytest process beside the rest (marked `beside`): most drive other processes
# (servers, workers, torchrun ranks, Dask workers, the gpu-check rehearsal) and wait on them, while the suite alone
# keeps about one of the two cores busy; the experiment flows make the two processes end together (measured on a clean
# clone: 738 s for the rest and 561 s beside without them; they took 72 s). With `cse run`'s Ctrl-C and rerun tests
# beside: 676 s for the rest, mypy then 807 s beside (933 s in all); the gpu rehearsals moved to the suite made it
# 879 s against 675 s (978 s), so they stay here. Whole files, so that no two tests of a file (ports, workers) ever
# run at the same time.
BESIDE_FILES = (
    "ops/test_team_stack.py",
    "ops/test_cse_run_follow.py",
    "ops/test_distributed.py",
    "ops/test_dask_shards.py",
    "gpu/test_gpu_check_rehearsal.py",
    "tracking/test_mlflow_outage.py",
    "flows/test_experiments.py",
)


def pytest_collection_modifyitems(config, items):
    tests_root = Path(__file__).parent
    for item in items:
        parts = Path(item.fspath).relative_to(tests_root).parts
        if parts[0] in SLOW_FOLDERS and "/".join(parts) not in FAST_FILES:
            item.add_marker(pytest.mark.slow)
        if "/".join(parts) in BESIDE_FILES:
            item.add_marker(pytest.mark.beside)
