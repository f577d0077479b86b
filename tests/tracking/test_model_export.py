"""The logged MLflow model: MLflow's native sentence_transformers flavour where a standard pipeline reproduces the
checkpoint (SimCSE), else the pyfunc (D2CSE's prompts); a signature and input example, stated requirements, a
registered version named `cse-<method>-<backbone>-<setting>`, and the alias `best` on the best STS-B dev version."""

from __future__ import annotations

from importlib import metadata

import mlflow
import numpy as np
import pytest
import torch

from cse.config.methods import build_model
from cse.models.checkpoint import save_checkpoint
from cse.tracking.model_export import (
    backbone_label,
    log_encoder_model,
    pip_requirements,
    registered_model_name,
    set_best_alias,
)
from cse.tracking.store import ensure_experiment

SENTENCES = ["a man is playing a guitar .", "two dogs run ."]


def _checkpoint(method: str, backbone, folder, **config):
    """A checkpoint whose trainable tensors moved away from their initial values (so a wrong pipeline would show)."""
    torch.manual_seed(0)
    model = build_model(method, {"backbone": str(backbone), **config}).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)
    enc = model.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.inference_mode():
        expected = model.embed(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]).numpy()
    return save_checkpoint(model, folder), expected


def test_pip_requirements_pin_the_installed_versions():
    assert pip_requirements() == [
        f"{n}=={metadata.version(n)}" for n in ("torch", "transformers", "safetensors", "numpy", "mlflow")
    ]


def test_registered_model_names(tmp_path):
    (tmp_path / "tiny_bert0").mkdir()
    assert backbone_label(str(tmp_path / "tiny_bert0")) == "tiny_bert0"
    assert backbone_label(str(tmp_path / "tiny_bert0") + "/") == "tiny_bert0"
    assert backbone_label("packaged:minilm") == "minilm"
    assert backbone_label("bert-base-uncased") == "bert-base-uncased"
    assert (
        backbone_label("princeton-nlp/unsup-simcse-bert-base-uncased") == "princeton-nlp-unsup-simcse-bert-base-uncased"
    )
    assert registered_model_name("d2cse", "packaged:minilm", "smoke") == "cse-d2cse-minilm-smoke"
    assert registered_model_name("simcse", "./models/my bert:v2", "sup") == "cse-simcse-my-bert-v2-sup"
    with pytest.raises(ValueError, match="a part is empty"):
        registered_model_name("d2cse", "bert-base-uncased", "//")


def test_fully_trained_encoders_log_as_sentence_transformers_prompt_models_as_pyfunc(tiny_bert_dir, tmp_path):
    experiment = ensure_experiment("export")  # (artifacts under this test's CSE_HOME)
    logged = {}
    for method, config in (("simcse", {"mlp_only_train": False}), ("d2cse", {"prefix_len": 4})):
        folder, expected = _checkpoint(method, tiny_bert_dir, tmp_path / method, **config)
        with mlflow.start_run(experiment_id=experiment) as run:
            info = log_encoder_model(
                folder,
                registered_name=registered_model_name(method, str(tiny_bert_dir), "smoke"),
                version_tags={"method": method},
            )
            mlflow.log_metric("best_stsb_dev", {"simcse": 70.0, "d2cse": 60.0}[method])
        logged[method] = (run.info.run_id, info)
        model_info = mlflow.models.get_model_info(f"runs:/{run.info.run_id}/model")
        [output] = model_info.signature.outputs.inputs
        assert (output.type, output.shape) == (np.dtype("float32"), (-1, 32))  # one float32 vector per sentence
        assert [p.name for p in model_info.signature.params.params] == ["batch_size"]
        assert model_info.saved_input_example_info is not None
        requirements = mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/model") + "/requirements.txt"
        assert set(pip_requirements()) <= set(open(requirements).read().split())
        for uri in (f"runs:/{run.info.run_id}/model", info.registry_uri):
            np.testing.assert_allclose(
                mlflow.pyfunc.load_model(uri).predict(SENTENCES, params={"batch_size": 1}), expected, atol=1e-5
            )

    simcse_run, simcse = logged["simcse"]
    assert simcse.flavor == "sentence_transformers" and "pooler 'cls'" in simcse.reason  # CLS + the trained tanh MLP
    st = mlflow.sentence_transformers.load_model(simcse.registry_uri)  # standard modules: no trust_remote_code needed
    assert [type(m).__name__ for m in st] == ["Transformer", "Pooling", "Dense"]
    d2cse_run, d2cse = logged["d2cse"]
    assert d2cse.flavor == "python_function" and "frozen" in d2cse.reason
    assert mlflow.get_run(d2cse_run).data.tags["cse.model_flavor"] == "python_function"

    client = mlflow.MlflowClient()
    [version] = client.search_model_versions(f"run_id = '{simcse_run}'")
    assert (version.name, str(version.version)) == (f"cse-simcse-{tiny_bert_dir.name}-smoke", "1")
    assert version.tags == {"flavor": "sentence_transformers", "method": "simcse"}
    assert mlflow.get_run(simcse_run).data.tags["cse.model_version"] == "1"


def test_the_best_alias_follows_the_best_stsb_dev_per_registered_model(tiny_bert_dir, tmp_path):
    experiment = ensure_experiment("export")
    folder, _ = _checkpoint("d2cse", tiny_bert_dir, tmp_path / "d2cse", prefix_len=2)
    name = registered_model_name("d2cse", "packaged:minilm", "smoke")
    runs = []
    for dev in (71.0, 74.5, None):
        with mlflow.start_run(experiment_id=experiment) as run:
            log_encoder_model(folder, registered_name=name)
            if dev is not None:
                mlflow.log_metric("best_stsb_dev", dev)
        runs.append(run.info.run_id)
    with mlflow.start_run(experiment_id=experiment) as unregistered:  # a run without a model version is skipped
        mlflow.log_metric("best_stsb_dev", 99.0)
    assert set_best_alias([*runs, unregistered.info.run_id, None]) == {name: "2"}
    assert mlflow.MlflowClient().get_model_version_by_alias(name, "best").run_id == runs[1]
    assert set_best_alias([runs[0]]) == {name: "1"}  # a later experiment moves the alias
    assert str(mlflow.MlflowClient().get_model_version_by_alias(name, "best").version) == "1"
    assert set_best_alias([runs[2]]) == {}  # no dev score: nothing to choose
