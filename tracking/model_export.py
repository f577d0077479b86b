"""The trained encoder as an MLflow model: a pyfunc that maps sentences to embeddings."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import mlflow
import numpy as np
import torch


class SentenceEmbeddingModel(mlflow.pyfunc.PythonModel):
    """pyfunc: a list of sentences → an (n, d) float32 array."""

    def load_context(self, context) -> None:
        from models.checkpoint import load_checkpoint
        from models.loading import load_tokenizer

        ckpt = Path(context.artifacts["checkpoint"])
        self.encoder = load_checkpoint(ckpt, device="cpu")
        self.tokenizer = getattr(self.encoder, "tokenizer", None) or load_tokenizer(
            json.loads((ckpt / "cse_model.json").read_text())["backbone"])

    def predict(self, context, model_input: list[str], params: dict | None = None) -> np.ndarray:
        sentences = [str(s) for s in model_input]
        batch_size = int((params or {}).get("batch_size", 64))
        out = []
        with torch.inference_mode():
            for i in range(0, len(sentences), batch_size):
                enc = self.tokenizer(sentences[i:i + batch_size], padding=True, return_tensors="pt")
                out.append(self.encoder.embed(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids")).float().numpy())
        return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)


# What loading the model needs, pinned to the versions that logged it. Stated, not inferred: MLflow's inference
# loads the model again in a subprocess (seconds per training run) and finds the same packages.
REQUIREMENTS = ("torch", "transformers", "safetensors", "numpy", "mlflow")


def pip_requirements() -> list[str]:
    return [f"{name}=={metadata.version(name)}" for name in REQUIREMENTS]


def log_encoder_model(checkpoint_dir: str | Path, name: str = "model"):
    """Log the checkpoint as an MLflow pyfunc model in the active run."""
    return mlflow.pyfunc.log_model(
        name=name,
        python_model=SentenceEmbeddingModel(),
        artifacts={"checkpoint": str(checkpoint_dir)},
        input_example=["a man is playing a guitar ."],
        pip_requirements=pip_requirements(),
    )
