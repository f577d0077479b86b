"""Export a trained checkpoint as a sentence-transformers model folder.

The folder holds `modules.json` naming `PromptedEncoderModule` (this module), the checkpoint
(backbone reference + prompt/pooler weights, a few MB) and the tokenizer. Load it with
`SentenceTransformer(folder, trust_remote_code=True)` where this package is installed; the
backbone weights come from its HF id or local folder, as at training time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from sentence_transformers.base.modules import InputModule

CHECKPOINT_SUBDIR = "checkpoint"


class PromptedEncoderModule(InputModule):
    """Tokenise, run the frozen backbone with the trained prompts, return the evaluation embedding."""

    config_keys = ["max_seq_length"]
    save_in_root = True

    def __init__(self, checkpoint_dir: str | Path, max_seq_length: int | None = None):
        super().__init__()
        from models.checkpoint import load_checkpoint
        from models.loading import load_tokenizer

        self.checkpoint_dir = Path(checkpoint_dir)
        self.encoder = load_checkpoint(self.checkpoint_dir, device="cpu")
        meta = json.loads((self.checkpoint_dir / "cse_model.json").read_text())
        self.tokenizer = getattr(self.encoder, "tokenizer", None) or load_tokenizer(meta["backbone"])
        self.max_seq_length = max_seq_length

    def preprocess(self, inputs, prompt: str | None = None, **kwargs) -> dict[str, torch.Tensor]:
        texts = [str(t) for t in inputs]
        if prompt:
            texts = [prompt + t for t in texts]
        return self.tokenizer(
            texts,
            padding=True,
            truncation=self.max_seq_length is not None,
            max_length=self.max_seq_length,
            return_tensors="pt",
        )

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        features["sentence_embedding"] = self.encoder.embed(
            features["input_ids"], features["attention_mask"], features.get("token_type_ids")
        )
        return features

    def get_sentence_embedding_dimension(self) -> int:
        with torch.inference_mode():
            enc = self.preprocess(["a"])
            return int(self.encoder.embed(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids")).shape[-1])

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        out = Path(output_path)
        if (out / CHECKPOINT_SUBDIR).resolve() != self.checkpoint_dir.resolve():
            shutil.copytree(self.checkpoint_dir, out / CHECKPOINT_SUBDIR, dirs_exist_ok=True)
        self.save_config(output_path)
        self.save_tokenizer(output_path)

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", **kwargs) -> PromptedEncoderModule:
        config = cls.load_config(model_name_or_path, subfolder=subfolder)
        return cls(Path(model_name_or_path) / subfolder / CHECKPOINT_SUBDIR, **config)


def export_sentence_transformer(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a folder that `SentenceTransformer(out_dir, trust_remote_code=True)` loads.

    An earlier `out_dir` is replaced, but only once the checkpoint has loaded; an `out_dir` that is, holds or lies
    inside the checkpoint folder is refused."""
    from sentence_transformers import SentenceTransformer

    out, source = Path(out_dir), Path(checkpoint_dir).resolve()
    if out.resolve() == source or out.resolve() in source.parents or source in out.resolve().parents:
        raise ValueError(f"exporting to {out} would overwrite the checkpoint {checkpoint_dir}: choose another folder")
    module = PromptedEncoderModule(checkpoint_dir)  # a missing or damaged checkpoint fails before anything is removed
    if out.exists():
        shutil.rmtree(out)
    SentenceTransformer(modules=[module]).save(str(out))
    return out
