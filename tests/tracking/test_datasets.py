"""Dataset inputs (tracking/datasets.py, cse.tracking.lineage.log_dataset_inputs): what a run read, as MLflow shows it
in "Datasets used" and returns in `run.inputs` — name, digest (our content hash), source (the dataset folder or the raw
file/URL), schema, profile and the context tag — against a real SQLite store."""

from __future__ import annotations

import json

import mlflow
import pyarrow as pa
import pytest
from mlflow.types.schema import Array, DataType, Object

from cse.storage import schemas
from cse.storage.datasets import DatasetRef, write_dataset
from cse.storage.evaluations import StsInput
from cse.storage.hashing import sha256_file
from cse.storage.layout import DataRoot
from cse.storage.settings import get_settings
from cse.storage.sources import ResolvedSource
from cse.tracking.datasets import DIGEST_CHARS, ParquetDataset, as_dataset, mlflow_schema
from cse.tracking.lineage import CONTEXT_CORRUPTION, CONTEXT_EVAL, CONTEXT_TRAIN, log_dataset_inputs, run_dataset_inputs
from cse.tracking.stage_runs import stage_run


def _tokens(root: DataRoot, key: str, ids: list[list[int]]) -> DatasetRef:
    table = pa.table(
        {
            "id": pa.array(range(len(ids)), pa.int64()),
            "column": ["text"] * len(ids),
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "length": pa.array([len(i) for i in ids], pa.int16()),
        },
        schema=schemas.TOKENS,
    )
    return DatasetRef.of(
        root, write_dataset(root, "tokens", key, [table.slice(0, 2), table.slice(2)], schemas.TOKENS), cache_hit=False
    )


def test_arrow_schemas_become_mlflow_column_specs():
    schema = mlflow_schema(
        pa.schema(
            [
                pa.field("id", pa.int64(), nullable=False),
                pa.field("text", pa.string()),
                pa.field("ids", pa.list_(pa.int32())),
                pa.field("n", pa.int16()),
                pa.field("score", pa.float64()),
                pa.field("pair", pa.struct([("a", pa.int8())])),
            ]
        )
    )
    specs = {c.name: c for c in schema.inputs}
    assert specs["id"].type == DataType.long and specs["id"].required and not specs["text"].required
    assert specs["text"].type == DataType.string and specs["n"].type == DataType.integer
    assert specs["score"].type == DataType.double and specs["ids"].type == Array(DataType.integer)
    assert isinstance(specs["pair"].type, Object)
    with pytest.raises(TypeError, match="column when: Arrow type"):
        mlflow_schema(pa.schema([pa.field("when", pa.duration("s"))]))


def test_a_published_dataset_is_a_parquet_dataset_named_by_kind_and_key():
    root = DataRoot(get_settings().data_root)
    ref = _tokens(root, "tok1", [[101, 7, 102], [101, 102], [101, 9, 9, 102]])
    ds = as_dataset(ref)
    assert isinstance(ds, ParquetDataset)
    assert ds.name == "tokens/tok1" and ds.digest == ref.content_hash[:DIGEST_CHARS] and len(ds.digest) == 36
    assert json.loads(ds.source.to_json()) == {"uri": ref.path} and ds.source._get_source_type() == "local"
    assert ds.profile["num_rows"] == 3 and ds.profile["num_files"] == 2
    assert ds.profile["content_hash"] == ref.content_hash
    assert [c.name for c in ds.schema.inputs] == ["id", "column", "input_ids", "length"]
    assert as_dataset(root.require("tokens", "tok1")).to_dict() == ds.to_dict()  # a Manifest gives the same dataset
    with pytest.raises(TypeError, match="cannot log a dict"):
        as_dataset({"kind": "tokens"})


def test_raw_sources_and_evaluation_folders_are_source_datasets(tmp_path):
    raw = tmp_path / "wiki.txt"
    raw.write_text("a sentence .\nanother one .\n")
    digest = sha256_file(raw)
    local = as_dataset(
        ResolvedSource(dataset="wiki1m", path=raw, origin="path", location=str(raw), content_hash=digest)
    )
    assert local.name == "wiki1m-source/wiki.txt" and local.digest == digest[:DIGEST_CHARS]
    assert json.loads(local.source.to_json()) == {"uri": str(raw)} and local.profile["sha256"] == digest
    url = "https://example.org/wiki1m_for_simcse.txt"
    remote = as_dataset(ResolvedSource(dataset="wiki1m", path=raw, origin="url", location=url, content_hash=digest))
    assert remote.source._get_source_type() == "http" and json.loads(remote.source.to_json()) == {"url": url}

    folder = tmp_path / "senteval"
    table = pa.table({"task": ["stsb", "stsb"], "score": [1.0, 4.5]})
    sts = as_dataset(StsInput(table=table, origin="folder", location=str(folder), content_hash="ab" * 32))
    assert sts.name == "sts-source/senteval" and sts.profile["num_rows"] == 2
    assert [c.name for c in sts.schema.inputs] == ["task", "score"]


def test_a_run_lists_its_inputs_with_their_contexts_through_search_runs():
    root = DataRoot(get_settings().data_root)
    tokens = _tokens(root, "tok2", [[101, 102], [101, 5, 102], [101, 6, 102]])
    corruption = _tokens(root, "tok3", [[101, 103], [101, 5, 103], [101, 6, 1]])
    with stage_run("lineage", "train-like") as run:
        log_dataset_inputs(None, [(tokens, CONTEXT_TRAIN), (corruption, CONTEXT_CORRUPTION)])  # the active run
    log_dataset_inputs(run.info.run_id, [(tokens, CONTEXT_TRAIN)])  # again (a resumed job): nothing added
    [found] = mlflow.search_runs(experiment_names=["lineage"], output_format="list")
    inputs = {i.dataset.name: i for i in found.inputs.dataset_inputs}
    assert set(inputs) == {"tokens/tok2", "tokens/tok3"}
    tok = inputs["tokens/tok2"]
    assert {t.key: t.value for t in tok.tags} == {"mlflow.data.context": CONTEXT_TRAIN}
    assert tok.dataset.digest == tokens.content_hash[:DIGEST_CHARS] and tok.dataset.source_type == "local"
    assert json.loads(tok.dataset.source) == {"uri": tokens.path}
    assert json.loads(tok.dataset.profile)["num_rows"] == 3
    assert [c["name"] for c in json.loads(tok.dataset.schema)["mlflow_colspec"]] == [
        "id",
        "column",
        "input_ids",
        "length",
    ]
    assert {i["name"]: i["context"] for i in run_dataset_inputs(run.info.run_id)} == {
        "tokens/tok2": CONTEXT_TRAIN,
        "tokens/tok3": CONTEXT_CORRUPTION,
    }
    with pytest.raises(RuntimeError, match="needs a run"):
        log_dataset_inputs(None, [(tokens, CONTEXT_EVAL)])


def test_hugging_face_sources_log_one_input_per_dataset(tmp_path):
    from cse.storage.hf_sources import HFRows, HFSource

    def rows(spec: str, folder, texts: list[str]) -> HFRows:
        return HFRows(
            spec=HFSource.model_validate(spec),
            kind="wiki1m",
            table=pa.table({"text": texts}),
            constants={},
            split="train",
            loaded_with="test",
            folder=folder,
        )

    hub = rows("hf:princeton-nlp/datasets-for-simcse@train", tmp_path / "cache", ["a .", "b ."])
    local = rows(f"hf:{tmp_path}", tmp_path, ["c ."])
    source = ResolvedSource(
        dataset="wiki1m",
        path=tmp_path / "cache",
        origin="hf",
        location=f"{hub.where} + {local.where}",
        content_hash="cd" * 32,
        hf=(hub, local),
    )
    with stage_run("data", "ingest-wiki1m") as run:
        [first, second] = log_dataset_inputs(run.info.run_id, [(source, "source")])
    assert first.dataset.name == "wiki1m-source/hf:princeton-nlp/datasets-for-simcse@train"
    assert first.dataset.source_type == "hugging_face"
    assert json.loads(first.dataset.source)["path"] == "princeton-nlp/datasets-for-simcse"
    assert first.dataset.digest == hub.content_hash()[:DIGEST_CHARS]
    assert json.loads(first.dataset.profile)["num_rows"] == 2
    assert second.dataset.source_type == "local" and json.loads(second.dataset.source) == {"uri": str(tmp_path)}
    assert len(mlflow.get_run(run.info.run_id).inputs.dataset_inputs) == 2
    with pytest.raises(ValueError, match="use as_datasets"):
        as_dataset(source)


def test_a_dataset_registered_by_a_concurrent_run_is_retried_other_errors_are_not(monkeypatch):
    """Two sweep children logging the same dataset at the same moment: the second insert of it violates the store's
    unique key (seen on PostgreSQL in the team-stack test); logging again finds it and succeeds."""
    from mlflow.exceptions import MlflowException

    root = DataRoot(get_settings().data_root)
    tokens = _tokens(root, "tok4", [[101, 102]])
    original, calls = mlflow.MlflowClient.log_inputs, []

    def racing(self, run_id, datasets=None, models=None):
        calls.append(run_id)
        if len(calls) == 1:
            raise MlflowException(
                '(psycopg.errors.UniqueViolation) duplicate key value violates unique constraint "dataset_pk"'
            )
        return original(self, run_id, datasets=datasets)

    monkeypatch.setattr(mlflow.MlflowClient, "log_inputs", racing)
    with stage_run("lineage", "race") as run:
        log_dataset_inputs(None, [(tokens, CONTEXT_TRAIN)])
    assert len(calls) == 2 and [i["name"] for i in run_dataset_inputs(run.info.run_id)] == ["tokens/tok4"]

    def broken(self, run_id, datasets=None, models=None):
        calls.append(run_id)
        raise MlflowException("RESOURCE_DOES_NOT_EXIST: no run")

    monkeypatch.setattr(mlflow.MlflowClient, "log_inputs", broken)
    calls.clear()
    with pytest.raises(MlflowException, match="no run"):
        log_dataset_inputs(run.info.run_id, [(tokens, CONTEXT_TRAIN)])
    assert len(calls) == 1
