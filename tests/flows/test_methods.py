"""Every method's smoke preset end to end through its `train-<method>` flow on a tiny backbone (issue: all methods).

Checks per method: the flow completes under the Prefect test harness, the MLflow run is tagged with the method
and logs its own loss terms, the trainable-parameter count is logged, only the stages the method needs ran
(corruption for D2CSE/DiffCSE, NLI tokens for DiffAug), and the checkpoint reloads as the same method.
"""

from __future__ import annotations

import mlflow
import numpy as np
import pytest

from cse.config.presets import PRESETS
from cse.config.training import resolve_train_config
from cse.flows.train import TRAIN_FLOWS
from cse.models.checkpoint import load_checkpoint, read_checkpoint_meta
from cse.tracking.store import configure_mlflow

LOSS_TERMS = {
    "d2cse": ("loss_contrastive", "loss_rtd", "rtd_accuracy"),
    "diffcse": ("loss_contrastive", "loss_rtd", "rtd_accuracy"),
    "simcse": ("loss_contrastive",),
    "dcpcse": ("loss_contrastive",),
    "diffaug": ("loss_contrastive", "loss_nli"),
}


@pytest.fixture
def tiny_overrides(tiny_bert_dir, shared_data, wiki_head):
    return {
        "backbone": str(tiny_bert_dir),
        "max_steps": 4,
        "eval_steps": 2,
        "log_steps": 1,
        "max_train_sentences": 128,
        "test_evaluation": False,
        "ingest": {
            "datasets": ["wiki1m", "nli", "sts"],
            "wiki": {"path": str(wiki_head)},
            "nli": {"path": str(shared_data / "snli_triplets.csv")},
            "senteval": {"path": str(shared_data / "senteval")},
        },
    }


@pytest.mark.parametrize("method", sorted(PRESETS))
def test_every_preset_resolves(method):
    for preset in PRESETS[method]:
        cfg = resolve_train_config(preset, method=method)
        assert cfg.method == method and cfg.preset == preset
        model = cfg.model_dump()["model"]
        assert model and "backbone" not in model  # completed with the method's defaults


def test_presets_follow_the_papers():
    assert resolve_train_config("default", method="simcse").learning_rate == 3e-5
    dcp = resolve_train_config("roberta-base", method="dcpcse")
    assert dcp.model.mlm is True and dcp.model.prefix_len == 14 and dcp.batch_size == 64
    diff = resolve_train_config("default", method="diffcse")
    assert (diff.learning_rate, diff.corrupt.mask_ratio, diff.model.rtd_weight, diff.epochs) == (7e-6, 0.3, 0.005, 2)
    aug = resolve_train_config("semi-aux", method="diffaug")
    assert aug.prefix_phase.steps == 1500 and aug.model.aux_weight == 1e-3 and aug.needs_nli and aug.max_length == 34
    assert not resolve_train_config("sup", method="diffaug").aux_nli_batch_size


def test_bad_overrides_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        resolve_train_config("default", {"model": {"prefix_lenn": 3}}, method="d2cse")
    with pytest.raises(ValueError, match="prefix phase"):
        resolve_train_config("default", {"prefix_phase": {"steps": 3}}, method="simcse")
    with pytest.raises(ValueError, match="unknown simcse preset"):
        resolve_train_config("semi", method="simcse")


@pytest.mark.parametrize("method", ["simcse", "dcpcse", "diffcse", "diffaug"])
def test_smoke_flow_of_each_method(prefect_harness, tiny_overrides, method):
    overrides = dict(tiny_overrides)
    if method == "diffaug":
        overrides.update(
            prefix_phase={"steps": 2, "batch_size": 8},
            aux_nli_batch_size=4,
            model={"aux_weight": 1e-3, "denoise_copies": 48},
        )
    result = TRAIN_FLOWS[method]("smoke", overrides)
    total = 4 + (2 if method == "diffaug" else 0)
    assert result.steps == total

    configure_mlflow()
    client = mlflow.tracking.MlflowClient()
    dev = [m.value for m in client.get_metric_history(result.run_id, "dev/stsb_dev")]
    assert len(dev) == total // 2 and result.best_stsb_dev == pytest.approx(max(dev))  # every 2 steps; the best kept
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["method"] == method
    assert int(run.data.params["trainable_parameters"]) > 0
    assert (run.data.tags["corruption_hash"] != "none") == (method == "diffcse")
    assert ("nli_tokens_hash" in run.data.tags) == (method == "diffaug")
    # a fully trained encoder with a CLS pooler is MLflow's native sentence_transformers model; prompts stay a pyfunc
    assert run.data.tags["cse.model_flavor"] == (
        "sentence_transformers" if method in ("simcse", "diffcse") else "python_function"
    )
    for term in LOSS_TERMS[method]:
        assert np.isfinite(client.get_metric_history(result.run_id, f"loss/{term}")[-1].value), term
    if method == "diffaug":
        phases = [h.value for h in client.get_metric_history(result.run_id, "progress/phase")]
        assert phases[0] == 0.0 and phases[-1] == 1.0  # prefix phase, then joint tuning

    assert read_checkpoint_meta(result.best_checkpoint)["method"] == method
    model = load_checkpoint(result.best_checkpoint)
    assert model.method == method

    again = TRAIN_FLOWS[method]("smoke", overrides)  # a finished job is not trained again
    assert again.run_id == result.run_id and again.steps == total


def test_a_supervised_job_with_grad_cache_logs_its_chunk_size_and_peak_memory(prefect_harness, tiny_overrides):
    """`train-simcse/sup -p overrides='{"grad_cache": {"chunk_size": ...}}'` through the flow: the chunk size is a
    param of the run and every log window has the steps' peak memory."""
    overrides = dict(tiny_overrides, grad_cache={"chunk_size": 5}, batch_size=8, max_steps=2, eval_steps=2)
    result = TRAIN_FLOWS["simcse"]("sup", overrides)
    assert result.steps == 2
    configure_mlflow()
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(result.run_id)
    assert run.data.params["grad_cache.chunk_size"] == "5" and run.data.tags["preset"] == "sup"
    peaks = client.get_metric_history(result.run_id, "throughput/peak_memory_gb")
    assert len(peaks) == 2 and all(m.value > 0 for m in peaks)  # log_steps 1: one window per step
