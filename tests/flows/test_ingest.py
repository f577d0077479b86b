"""Ingest and tokenise flows on the real local mirror, under a temporary Prefect server."""

from __future__ import annotations

import mlflow
import pytest

from cse.config.stages import IngestConfig, NliSource, TokenizeConfig
from cse.flows.ingest import ingest
from cse.flows.tokenization import tokenize
from cse.storage.catalog import query
from cse.storage.datasets import read_dataset
from cse.storage.layout import DataRoot
from cse.storage.settings import get_settings
from cse.tracking.store import configure_mlflow


def _data_runs():
    configure_mlflow()
    return mlflow.search_runs(experiment_names=["data"], output_format="list")


def test_ingest_writes_datasets_then_hits_cache(prefect_harness, local_ingest_config):
    first = ingest(local_ingest_config)
    assert {k: r.rows for k, r in first.items()} == {"wiki1m": 11913, "nli": 5864, "sts": 31099}
    assert not any(r.cache_hit for r in first.values())
    root = DataRoot(get_settings().data_root)
    sts = read_dataset(root, "sts", first["sts"].key).to_pandas()
    test_pairs = dict(sickr=4927, sts12=3108, sts13=1500, sts14=3750, sts15=3000, sts16=1186, stsb=1379)
    assert sts[sts.split == "test"].groupby("task").size().to_dict() == test_pairs
    m = root.require("wiki1m", first["wiki1m"].key)
    assert m.source["origin"] == "path" and m.inputs["source"] and m.stats["empty"] == 0

    second = ingest(local_ingest_config)
    assert all(r.cache_hit for r in second.values())
    assert {k: r.key for k, r in second.items()} == {k: r.key for k, r in first.items()}

    runs = _data_runs()
    assert len(runs) == 6 and all(r.info.status == "FINISHED" for r in runs)
    hits = sorted(r.data.metrics["cache_hit"] for r in runs)
    assert hits == [0, 0, 0, 1, 1, 1]
    assert all("content_hash" in r.data.tags and "git_commit" in r.data.tags for r in runs)
    assert query(root, "select count(*) n from manifests").n[0] == 3


def test_tokenize_is_cached_per_tokenizer_and_length(prefect_harness, local_ingest_config):
    cfg = TokenizeConfig(tokenizer="packaged:minilm", max_length=32)
    ref = tokenize("nli", local_ingest_config, cfg)
    assert ref.rows == 3 * 5864 and not ref.cache_hit
    again = tokenize("nli", local_ingest_config, cfg)
    assert again.cache_hit and again.key == ref.key
    shorter = tokenize("nli", local_ingest_config, TokenizeConfig(tokenizer="packaged:minilm", max_length=16))
    assert shorter.key != ref.key
    root = DataRoot(get_settings().data_root)
    t = read_dataset(root, "tokens", ref.key).to_pandas()
    assert t["length"].max() == 32 and (t.input_ids.map(lambda x: x[0]) == 101).all()
    assert list(t.column[:3]) == ["sent0", "sent1", "hard_neg"] and list(t.id[:3]) == [0, 0, 0]
    s = read_dataset(root, "tokens", shorter.key).to_pandas()
    assert s["length"].max() == 16 and (s.input_ids.map(lambda x: x[-1]) == 102).all()


def test_missing_source_fails_cleanly(prefect_harness, tmp_path):
    cfg = IngestConfig(datasets=("nli",), nli=NliSource(path=str(tmp_path / "absent.csv")))
    with pytest.raises(FileNotFoundError, match="absent.csv"):
        ingest(cfg)
    runs = _data_runs()
    assert [r.info.status for r in runs] == ["FAILED"]
    assert not DataRoot(get_settings().data_root).list("nli")


def test_mirror_variable_reads_local_copy(prefect_harness, shared_data, monkeypatch):
    monkeypatch.setenv("CSE_SOURCE_MIRROR", str(shared_data))
    refs = ingest(IngestConfig(datasets=("wiki1m",)))
    m = DataRoot(get_settings().data_root).require("wiki1m", refs["wiki1m"].key)
    assert m.source["origin"] == "mirror" and m.source["file"].endswith("wiki1m_head.txt") and m.rows == 11913
