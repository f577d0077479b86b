"""train-d2cse end to end on a tiny backbone: MLflow contents, exports, resume after a kill."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

from cse.flows.train import train_d2cse
from cse.models.checkpoint import load_checkpoint
from cse.tracking.store import configure_mlflow
from cse.training.loop import TrainingInterrupted
from tests.loops import heads_ingest

SEVEN = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")


# The Wiki1M sample the smoke flow reads: the first 1,000 lines of the shared wiki1m_head.txt, under the sample's own
# file name (the card names the file); the corruption stage corrupts every row of it, the job trains on 256 of them.
WIKI_ROWS = 1_000


@pytest.fixture
def overrides(tiny_bert_dir, shared_data, wiki_cut):
    return {
        "backbone": str(tiny_bert_dir),
        "max_steps": 8,
        "eval_steps": 4,
        "max_train_sentences": 256,
        "ingest": {
            "datasets": ["wiki1m", "sts"],
            "wiki": {"path": str(wiki_cut(WIKI_ROWS, "wiki1m_head.txt"))},
            "senteval": {"path": str(shared_data / "senteval")},
        },
    }


def test_smoke_flow_logs_curves_scores_and_models(prefect_harness, overrides, tiny_bert_dir):
    result = train_d2cse("smoke", overrides)
    assert result.steps == 8 and result.resumed_from is None
    configure_mlflow()
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["method"] == "d2cse" and run.data.tags["preset"] == "smoke"
    assert {"tokens_hash", "corruption_hash", "git_commit", "prefect_flow_run_id"} <= run.data.tags.keys()
    assert run.data.tags["cse.data_warning"].startswith("Wiki1M is a sample: ")  # the preflight's warning
    assert run.data.params["model.prefix_len"] == "8" and run.data.params["corruption_reuse"]
    # the MLflow pages (tracking/run_pages.py): the name says what differs from the preset, the description is the
    # STS table beside the paper's BERT-base row, and no per-subset score sits before the loss curve
    assert run.info.run_name.startswith(f"d2cse-smoke backbone={tiny_bert_dir.name} eval_steps=4 ")
    note = run.data.tags["mlflow.note.content"]
    assert "| this run |" in note and "| difference (run − published) |" in note
    assert f"| published (BERT-base; this run uses {tiny_bert_dir.name}) |" in note
    # issue 34: the backbone before training is scored with the job's pooler and shown beside the run
    assert "| backbone before training (cls_before_pooler) |" in note and "| difference (run − backbone) |" in note
    assert f"(get-artifact?path=evaluation/sts_chart.png&run_uuid={result.run_id})" in note  # the chart, shown
    before = json.loads(run.data.tags["cse.backbone"])
    assert before["pooler"] == "cls_before_pooler" and before["evaluation_id"].startswith("backbone-")
    assert result.backbone["evaluation_id"] == before["evaluation_id"]
    assert run.data.tags["9 backbone Avg."] == f"{before['metrics']['sts_avg']:.2f}"  # the score tags: text
    assert run.data.tags["1 STS12"] == f"{run.data.metrics['sts12']:.2f}" and "8 Avg." in run.data.tags
    assert run.data.params["overrides"].startswith(f"backbone={tiny_bert_dir.name} eval_steps=4 ")
    m = run.data.metrics
    # the loop's curves in their sections (dev, loss, ...); the test scores unprefixed: no per-subset score, no
    # Pearson or timing single value; every metric a line (its latest step >= 1), none a one-bar chart
    sections = {k.split("/")[0] for k in m if "/" in k}
    # rtd_probe: CRTD runs; "STS test": the test scores again, the Model-metrics tab's first section (run_pages)
    assert sections == {"STS test", "dev", "loss", "optimizer", "progress", "rtd_probe", "throughput"}
    assert "progress/phase" not in m and not [k for k in m if k.startswith(("sts12/", "sts14/"))]
    assert "sts_avg_pearson" not in m and "eval_seconds" not in m and "sts12_wmean" not in m
    for name in (*SEVEN, "sts_avg", "retrieval_r1", "retrieval_r5", "alignment", "uniformity", "best_stsb_dev"):
        assert np.isfinite(m[name]), name
    assert m["sts_avg"] == round(np.mean([round(m[t], 2) for t in SEVEN]), 2)
    for name in m:
        latest = max(client.get_metric_history(result.run_id, name), key=lambda h: (h.step, h.timestamp))
        assert latest.step >= 1, name
    avg = sorted((h.step, h.value) for h in client.get_metric_history(result.run_id, "sts_avg"))
    assert avg == [(0, before["metrics"]["sts_avg"]), (8, m["sts_avg"])]  # the backbone, then the trained model
    assert len(client.get_metric_history(result.run_id, "loss/loss")) == 2  # log_steps 5 + the last step
    assert [h.step for h in client.get_metric_history(result.run_id, "dev/stsb_dev")] == [4, 8]
    # the RTD mechanism probe at every evaluation (training/job.py): true, rolled and no h, the gap, its cost
    probe = {
        name: client.get_metric_history(result.run_id, f"rtd_probe/{name}")
        for name in ("rtd_loss_true_h", "rtd_loss_rolled_h", "rtd_loss_no_h", "rtd_h_gap", "rtd_probe_seconds")
    }
    for name, history in probe.items():
        assert [h.step for h in history] == [4, 8] and all(np.isfinite(h.value) for h in history), name
    # the RTD term's gradient share beside it: D2CSE's prompts and BN-MLP (shares), its RTD head (a norm)
    grads = ("rtd_grad_share_prompts", "rtd_grad_share_mlp", "rtd_grad_norm_rtd_head")
    assert {k for k in m if k.startswith("rtd_probe/rtd_grad_")} == {f"rtd_probe/{g}" for g in grads}
    for name in grads:
        history = client.get_metric_history(result.run_id, f"rtd_probe/{name}")
        assert [h.step for h in history] == [4, 8] and all(np.isfinite(h.value) and h.value > 0 for h in history)
    share = client.get_metric_history(result.run_id, "rtd_probe/rtd_grad_share_prompts")[1].value
    assert "| ‖λ∇RTD‖ / ‖∇CL‖, prompts |" in note and f" {share:.2e} |" in note
    for true, rolled, gap in zip(probe["rtd_loss_true_h"], probe["rtd_loss_rolled_h"], probe["rtd_h_gap"]):
        assert gap.value == pytest.approx(rolled.value - true.value, abs=1e-6)
    assert run.data.params["rtd_probe_rows"] == (
        f"the last 64 of {WIKI_ROWS:,} sentences (text), never trained on (the job trains on the first 256); "
        "corruption variant 0"
    )
    assert "**RTD mechanism probe**" in note and "| rtd_h_gap (rolled − true) |" in note
    assert f"| 8 | {probe['rtd_loss_true_h'][1].value:.4f} |" in note
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"checkpoint", "sentence-transformers", "config.json", "evaluation", "plots"} <= artifacts
    assert "evaluation/sts_chart.png" in {a.path for a in client.list_artifacts(result.run_id, "evaluation")}
    # the backbone's evaluation is the cached `evaluations` dataset of its key; the run's row names it
    from cse.storage.catalog import query
    from cse.storage.layout import DataRoot
    from cse.storage.settings import get_settings

    rows = query(DataRoot(get_settings().data_root), "SELECT * FROM evaluations_all ORDER BY created")
    rows = rows.to_dict("records")
    assert rows[0]["evaluation_id"] == before["evaluation_id"]
    assert rows[0]["label"] == f"backbone {tiny_bert_dir} (cls_before_pooler)"
    assert not isinstance(rows[0]["mlflow_run_id"], str)  # (no MLflow run of its own: the training runs hold it)
    assert rows[1]["backbone_evaluation"] == before["evaluation_id"] and rows[1]["label"] == run.info.run_name

    sentences = ["a man is playing a guitar .", "a woman is slicing an onion ."]
    model = load_checkpoint(result.best_checkpoint)
    enc = model.tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.inference_mode():
        expected = model.embed(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]).numpy()
    pyfunc = mlflow.pyfunc.load_model(f"runs:/{result.run_id}/model")
    np.testing.assert_allclose(pyfunc.predict(sentences), expected, atol=1e-5)

    # lineage: the run's input datasets, as `mlflow.search_runs` returns them (the UI's "Datasets used")
    [found] = mlflow.search_runs(experiment_names=["d2cse"], output_format="list")
    inputs = {i.dataset.name.split("/")[0]: i for i in found.inputs.dataset_inputs}
    contexts = {kind: {t.key: t.value for t in i.tags}["mlflow.data.context"] for kind, i in inputs.items()}
    assert contexts == {"tokens": "train", "corruption": "corruption", "sts": "eval"}
    assert inputs["tokens"].dataset.digest == run.data.tags["tokens_hash"][:36]
    assert inputs["corruption"].dataset.digest == run.data.tags["corruption_hash"][:36]
    corruption_source = json.loads(inputs["corruption"].dataset.source)["uri"]
    assert corruption_source.endswith(f"/datasets/{inputs['corruption'].dataset.name}")
    assert json.loads(inputs["tokens"].dataset.profile)["num_rows"] > 0
    data_runs = {r.info.run_name: r for r in mlflow.search_runs(experiment_names=["data"], output_format="list")}
    [wiki_source] = data_runs["ingest-wiki1m"].inputs.dataset_inputs  # the raw file, by its sha256
    assert wiki_source.dataset.name == "wiki1m-source/wiki1m_head.txt"
    assert wiki_source.dataset.digest == data_runs["ingest-wiki1m"].data.tags["source_hash"][:36]
    [corrupted] = data_runs["corrupt"].inputs.dataset_inputs  # the tokens the corruption stage read ...
    assert corrupted.dataset.digest == inputs["tokens"].dataset.digest  # ... are the training run's tokens
    # the model: pyfunc (D2CSE's prompts need this package), registered as a version of cse-<method>-<backbone>-<preset>
    assert run.data.tags["cse.model_flavor"] == "python_function"
    [version] = client.search_model_versions(f"run_id = '{result.run_id}'")
    assert version.name == f"cse-d2cse-{tiny_bert_dir.name}-smoke" and version.tags["preset"] == "smoke"
    registered = mlflow.pyfunc.load_model(f"models:/{version.name}/{version.version}")
    np.testing.assert_allclose(registered.predict(sentences), expected, atol=1e-5)

    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(result.run_dir) + "/export", trust_remote_code=True, device="cpu")
    # the portable module shipped in the folder (models/export/st_prompted.py)
    assert type(st[0]).__name__ == "PromptedEncoder"
    np.testing.assert_allclose(st.encode(sentences), expected, atol=1e-5)

    # the PEFT adapter, loaded with transformers + peft only (its own peft_embed.py), gives the same embeddings
    adapter = Path(result.run_dir) / "peft-adapter"
    from cse.models.export.peft_loader import embed_sentences, load_prefix_encoder

    peft_model, peft_tokenizer, spec = load_prefix_encoder(adapter)
    np.testing.assert_allclose(
        embed_sentences(peft_model, peft_tokenizer, spec, sentences).numpy(), expected, atol=1e-5
    )
    assert {"peft-adapter", "sentence-transformers"} <= {a.path for a in client.list_artifacts(result.run_id)}
    # both exports carry the model card: the commit, the data hashes, the registered model's URI
    for folder in (Path(result.run_dir) / "export", adapter):
        card = (folder / "README.md").read_text()
        assert run.data.tags["git_commit"] in card and run.data.tags["corruption_hash"] in card
        assert f"models:/{version.name}/{version.version}" in card
        # the data it really trained on (the local sample, its rows, what the job used) and no temporary folder
        assert (
            f"| wiki1m | `wiki1m_head.txt` | local file | {WIKI_ROWS:,} | **a sample**: {WIKI_ROWS:,} of the full "
            "1,000,000"
        ) in card
        assert "The job trained on the first 256 rows (`max_train_sentences: 256`) of wiki1m: 8 optimiser steps" in card
        assert str(tiny_bert_dir.parent) not in card and "/tmp/" not in card
        assert "trust_remote_code=True" in card and "cse_prompted_encoder.py" in card  # the bundled module
        assert "| backbone before training (`" in card and "| gain over the backbone |" in card
    # one card, rendered once: both folders hold the same text (their front matter names their library)
    bodies = {(f / "README.md").read_text().split("\n---\n", 1)[1] for f in (Path(result.run_dir) / "export", adapter)}
    assert len(bodies) == 1


def test_killed_training_resumes_in_the_same_run(prefect_harness, overrides, wiki_head, senteval_head):
    """Killed after step 6, rerun: it resumes from the step-4 checkpoint in the same MLflow run. On the heads of the
    shared files (512 Wiki1M lines, 24 lines of every SentEval file): the corruption stage corrupts all of the corpus,
    and the dev evaluations only need a score."""
    small = {**overrides, "test_evaluation": False, "ingest": heads_ingest(wiki_head, senteval_head)}
    with pytest.raises(TrainingInterrupted):
        train_d2cse("smoke", small, stop_after=6)
    configure_mlflow()
    runs = mlflow.search_runs(experiment_names=["d2cse"], output_format="list")
    assert [r.info.status for r in runs] == ["KILLED"]
    result = train_d2cse("smoke", small)
    assert result.resumed_from == 4 and result.steps == 8
    assert result.run_id == runs[0].info.run_id
    assert mlflow.get_run(result.run_id).info.status == "FINISHED"


def test_the_printed_sts_table_shows_the_backbone_and_the_paper():
    from cse.config import published
    from cse.config.training import resolve_train_config
    from cse.flows.train import sts_table_text

    cfg = resolve_train_config("smoke", method="d2cse")
    metrics = {"sts12": 1, "sts13": 2, "sts14": 3, "sts15": 4, "sts16": 5, "stsb": 6, "sickr": 7, "sts_avg": 4}
    before = {"pooler": "cls_before_pooler", "metrics": {k: v + 0.5 for k, v in metrics.items()}}
    lines = sts_table_text(cfg, metrics, before).splitlines()
    paper = published.STS[("d2cse", "bert-base", "unsup")]
    assert lines[:4] == [
        "|  | STS12 | STS13 | STS14 | STS15 | STS16 | STS-B | SICK-R | Avg. |",
        "|---|---|---|---|---|---|---|---|---|",
        "| this run | 1.00 | 2.00 | 3.00 | 4.00 | 5.00 | 6.00 | 7.00 | 4.00 |",
        "| backbone before training (cls_before_pooler) | 1.50 | 2.50 | 3.50 | 4.50 | 5.50 | 6.50 | 7.50 | 4.50 |",
    ]
    assert lines[4].startswith("| published (BERT-base; this run uses packaged:minilm) | ")
    assert f"| {paper['sts_avg']:.2f} |" in lines[4]
    assert lines[5].startswith("| difference (run − published) | ")
    assert lines[6] == "| difference (run − backbone) | -0.50 | -0.50 | -0.50 | -0.50 | -0.50 | -0.50 | -0.50 | -0.50 |"
