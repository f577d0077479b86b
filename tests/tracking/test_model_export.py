"""The logged MLflow model: a pyfunc from sentences to the checkpoint's embeddings, with stated requirements."""

from __future__ import annotations

from importlib import metadata

import mlflow
import numpy as np
import torch

from config.methods import build_model
from models.checkpoint import save_checkpoint
from tracking.model_export import log_encoder_model, pip_requirements
from tracking.runs import configure_mlflow


def test_pip_requirements_pin_the_installed_versions():
    assert pip_requirements() == [f"{n}=={metadata.version(n)}" for n in ("torch", "transformers", "safetensors", "numpy", "mlflow")]


def test_logged_model_predicts_the_checkpoint_embeddings(tiny_bert_dir, tmp_path):
    torch.manual_seed(0)
    model = build_model("simcse", {"backbone": str(tiny_bert_dir)}).eval()
    folder = save_checkpoint(model, tmp_path / "ckpt")
    sentences = ["a man is playing a guitar .", "two dogs run ."]
    enc = model.tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.inference_mode():
        expected = model.embed(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]).numpy()
    configure_mlflow()
    with mlflow.start_run() as run:
        log_encoder_model(folder)
    uri = f"runs:/{run.info.run_id}/model"
    requirements = (mlflow.artifacts.download_artifacts(uri) + "/requirements.txt")
    assert set(pip_requirements()) <= set(open(requirements).read().split())
    np.testing.assert_allclose(mlflow.pyfunc.load_model(uri).predict(sentences), expected, atol=1e-5)
