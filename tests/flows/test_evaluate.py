"""Flow `evaluate` under a temporary Prefect server: MLflow run, artifacts, Parquet row, Prefect
artifacts; STS input from a folder or an ingested dataset; checkpoints from a folder or an MLflow
run; bad input fails with one clear error and leaves the MLflow run FAILED (never RUNNING)."""

from __future__ import annotations

import mlflow
import pytest
import torch
from pydantic import ValidationError

from cse.config.evaluation import EvalConfig
from cse.flows.evaluate import evaluate
from cse.storage import schemas
from cse.storage.catalog import query
from cse.storage.datasets import write_dataset
from cse.storage.evaluations import load_sts_input
from cse.storage.layout import DataRoot
from cse.storage.readers import read_senteval
from cse.storage.settings import get_settings
from cse.tasks.evaluate import record_evaluation
from cse.tasks.evaluate_common import resolve_checkpoint
from cse.tracking.store import configure_mlflow, ensure_experiment
from tests.batches import tiny_bert_config

SEVEN = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")


def _runs():
    configure_mlflow()
    return mlflow.search_runs(experiment_names=["evaluation"], output_format="list")


def _artifacts(run_id: str, path: str) -> set[str]:
    return {a.path for a in mlflow.MlflowClient().list_artifacts(run_id, path)}


def test_test_mode_records_everything(prefect_harness, shared_data, tiny_bert_dir):
    summary = evaluate(EvalConfig(model=str(tiny_bert_dir), pooler="cls", label="tiny-bert cls", progress=False))
    [run] = _runs()
    assert run.info.status == "FINISHED" and run.info.run_id == summary.mlflow_run_id
    m = run.data.metrics
    expected = {
        *SEVEN,
        "sts_avg",
        "sts_avg_pearson",
        *(f"{t}_pearson" for t in SEVEN),
        "sts12_mean",
        "sts12_wmean",
        "sts12/MSRpar",
        *(f"retrieval_r{k}" for k in (1, 3, 5, 10)),
        "retrieval_index_r1",
        "retrieval_string_r1",
        "alignment",
        "uniformity",
    }
    assert expected <= set(m)
    assert m["sts_avg"] == round(sum(round(m[t], 2) for t in SEVEN) / 7, 2)
    assert m["retrieval_r1"] == m["retrieval_string_r1"]  # the default headline rule
    assert run.data.params["pooler"] == "cls" and run.data.tags["stage"] == "evaluate"
    written = "result.json table1.md sts_tasks.csv sts_tasks.md sts_subsets.csv retrieval.csv qualitative.md".split()
    assert {f"evaluation/{name}" for name in written} <= _artifacts(run.info.run_id, "evaluation")
    assert _artifacts(run.info.run_id, "plots") == {"plots/cosine_by_gold.png", "plots/alignment_uniformity.png"}
    table1 = mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/evaluation/table1.md")
    assert "| tiny-bert cls |" in table1 and "| STS12 | STS13 |" in table1 and "Avg." in table1

    root = DataRoot(get_settings().data_root)
    row = query(root, "SELECT * FROM evaluations_all").iloc[0]
    assert row.evaluation_id == summary.evaluation_id and row.mlflow_run_id == run.info.run_id
    assert (
        row.sts_source.startswith("folder:") and row.sts12 == pytest.approx(m["sts12"]) and row.sts_avg == m["sts_avg"]
    )
    assert row.retrieval_match == "string" and row.alignment == pytest.approx(m["alignment"])
    assert '"mode":"test"' in row.details

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["evaluation-test"])))
        details = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["evaluation-test-details"]))
        )
    # the session's Prefect server also holds other tests' evaluations: find this one's by its model label
    ours = [a for a in arts if "tiny-bert cls" in str(a.data)]
    assert ours and ours[0].type == "table" and "STS-B" in str(ours[0].data)
    assert any(d.flow_run_id == ours[0].flow_run_id and "Retrieval" in str(d.data) for d in details)


def test_dev_mode_from_an_ingested_dataset(prefect_harness, shared_data, tiny_bert_dir):
    root = DataRoot(get_settings().data_root)
    table, _ = read_senteval(shared_data / "senteval")
    write_dataset(root, "sts", "sts-key-1", [table], schemas.STS)
    summary = evaluate(EvalConfig(model=str(tiny_bert_dir), pooler="avg", mode="dev", sts="sts-key-1", progress=False))
    assert {k for k in summary.metrics if "pearson" not in k and not k.startswith("eval_")} == {"stsb_dev", "sickr_dev"}
    [run] = _runs()
    assert run.info.status == "FINISHED" and run.data.tags["sts_source"] == "dataset:sts-key-1"
    [used] = run.inputs.dataset_inputs  # the ingested dataset, as the run's MLflow input
    assert used.dataset.name == "sts/sts-key-1"
    assert [(t.key, t.value) for t in used.tags] == [("mlflow.data.context", "eval")]
    assert _artifacts(run.info.run_id, "plots") == set()
    row = query(root, "SELECT mode, stsb_dev, sts12, sts_source FROM evaluations").iloc[0]
    assert row["mode"] == "dev" and row.stsb_dev == pytest.approx(summary.metrics["stsb_dev"])
    assert row.sts12 != row.sts12  # NaN


def _d2cse_checkpoint(tiny_bert_dir, folder):
    from cse.models.checkpoint import save_checkpoint
    from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig

    torch.manual_seed(0)
    model = D2CSE(D2CSEModelConfig(backbone=str(tiny_bert_dir), prefix_len=3)).eval()
    return save_checkpoint(model, folder), model


def test_checkpoint_from_folder_and_from_mlflow_run(prefect_harness, shared_data, tiny_bert_dir, tmp_path):
    folder, model = _d2cse_checkpoint(tiny_bert_dir, tmp_path / "best")
    local = evaluate(EvalConfig(checkpoint=str(folder), mode="dev", progress=False))
    configure_mlflow()
    # (no mlflow.set_experiment: it sets process-wide state that later tests would inherit)
    with mlflow.start_run(experiment_id=ensure_experiment("d2cse-test")) as train_run:
        mlflow.log_artifacts(str(folder), artifact_path="checkpoint")
    remote = evaluate(
        EvalConfig(checkpoint=f"runs:/{train_run.info.run_id}", pooler="cls_before_pooler", mode="dev", progress=False)
    )
    assert local.metrics["stsb_dev"] == remote.metrics["stsb_dev"]
    runs = _runs()
    assert len(runs) == 2 and all(r.info.status == "FINISHED" and r.data.tags["method"] == "d2cse" for r in runs)
    bare = resolve_checkpoint(train_run.info.run_id, tmp_path / "download")  # a bare run id works too
    assert (bare / "cse_model.json").read_text() == (folder / "cse_model.json").read_text()

    from cse.evaluation import Evaluator  # the same number in-process, as a training loop would compute it

    sts = load_sts_input(str(shared_data / "senteval"), DataRoot(get_settings().data_root))
    res = Evaluator(sts.table).run(model, "dev")
    assert res.dev_score == pytest.approx(local.metrics["stsb_dev"], abs=1e-9)
    with mlflow.start_run(experiment_id=train_run.info.experiment_id):  # how a training flow records its own result
        eid = record_evaluation(res, label="d2cse-tiny", sts=sts, what={"method": "d2cse", "checkpoint": str(folder)})
    row = query(
        DataRoot(get_settings().data_root), f"SELECT * FROM evaluations_all WHERE evaluation_id = '{eid}'"
    ).iloc[0]
    assert (row.model, row.pooler, row.method) == (str(tiny_bert_dir), "cls_before_pooler", "d2cse")


def _assert_one_failed_run():
    runs = _runs()
    assert [r.info.status for r in runs] == ["FAILED"]


def test_checkpoint_with_another_backbone_fails_cleanly(
    prefect_harness, shared_data, tiny_bert_dir, tmp_path, tokenizer
):
    from transformers import BertModel

    from cse.models.checkpoint import BackboneMismatchError

    folder, _ = _d2cse_checkpoint(tiny_bert_dir, tmp_path / "best")
    other = tmp_path / "other_bert"  # same shape, different weights
    torch.manual_seed(123)
    BertModel(tiny_bert_config(len(tokenizer))).save_pretrained(other)
    tokenizer.save_pretrained(other)
    with pytest.raises(BackboneMismatchError, match="different weights"):
        evaluate(EvalConfig(checkpoint=str(folder), model=str(other), mode="dev", progress=False))
    _assert_one_failed_run()


def test_checkpoint_with_another_pooler_fails_cleanly(prefect_harness, shared_data, tiny_bert_dir, tmp_path):
    folder, _ = _d2cse_checkpoint(tiny_bert_dir, tmp_path / "best")
    with pytest.raises(ValueError, match="evaluates with pooler 'cls_before_pooler', not 'avg'"):
        evaluate(EvalConfig(checkpoint=str(folder), pooler="avg", mode="dev", progress=False))
    _assert_one_failed_run()


def test_missing_data_fails_cleanly(prefect_harness, tiny_bert_dir, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="neither a SentEval folder nor an `sts` dataset"):
        evaluate(EvalConfig(model=str(tiny_bert_dir), pooler="avg", sts="no-such-key", progress=False))
    _assert_one_failed_run()
    monkeypatch.setenv("CSE_SHARED_DATA", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="run the `ingest` flow"):
        evaluate(EvalConfig(model=str(tiny_bert_dir), pooler="avg", mode="dev", progress=False))
    assert [r.info.status for r in _runs()] == ["FAILED", "FAILED"]


def test_missing_checkpoint_fails_cleanly(prefect_harness, shared_data, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local folder nor an MLflow run id"):
        evaluate(EvalConfig(checkpoint=str(tmp_path / "nowhere"), mode="dev", progress=False))
    _assert_one_failed_run()


def test_unknown_pooler_or_task_is_rejected_before_any_run(prefect_harness):
    with pytest.raises(ValidationError, match="pooler"):
        EvalConfig(model="packaged:minilm", pooler="max")
    with pytest.raises(ValidationError, match="tasks"):
        EvalConfig(model="packaged:minilm", pooler="avg", tasks=("sts17",))
    with pytest.raises(ValidationError, match="`pooler` is required"):
        EvalConfig(model="packaged:minilm")
    with pytest.raises(Exception, match="pooler"):
        evaluate(config={"model": "packaged:minilm", "pooler": "max"})
    assert _runs() == []
