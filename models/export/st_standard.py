"""A checkpoint as a sentence-transformers pipeline of standard modules (Transformer, Pooling, Dense), where one
computes the checkpoint's embedding exactly: a fully trained encoder (every backbone tensor in the checkpoint: SimCSE,
DiffCSE) read by a standard pooler. Used by the MLflow model (tracking/model_export.py) and the portable
sentence-transformers export (models/export/st_export.py). sentence-transformers is imported only when a pipeline is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from cse.models.method import CSEModel

INPUT_EXAMPLE = ["a man is playing a guitar .", "a woman is slicing an onion ."]
_ATOL = 1e-5  # a standard pipeline must reproduce the checkpoint's embeddings this closely to be used

_POOLING_MODES = {"cls_before_pooler": "cls", "cls": "cls", "avg": "mean"}


def _embed(model: CSEModel, sentences: list[str]) -> np.ndarray:
    enc = model.tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.inference_mode():
        return model.embed(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids")).float().numpy()


def standard_sentence_transformer(
    checkpoint_dir: str | Path, workdir: str | Path
) -> tuple[SentenceTransformer | None, str]:
    """A sentence-transformers model of standard modules that computes the checkpoint's embedding, or None.

    Returns `(model or None, reason)`. The backbone is written (`save_pretrained`, with its tokenizer) under `workdir`,
    which must outlive the model until it is saved. Only a checkpoint whose pooler is standard (`cls_before_pooler`,
    `cls`, `avg`) and which holds every backbone tensor (a fully trained encoder) is tried; the pipeline must then
    reproduce the checkpoint's embeddings of `INPUT_EXAMPLE` within 1e-5."""
    from cse.models.checkpoint import load_checkpoint, read_checkpoint_meta

    meta = read_checkpoint_meta(checkpoint_dir)
    pooler = meta.get("pooler")
    if pooler not in _POOLING_MODES:
        return None, f"pooler {pooler!r} has no sentence-transformers equivalent"
    model = load_checkpoint(checkpoint_dir, device="cpu")
    backbone = model.backbone
    prefix = next(name for name, module in model.named_modules() if module is backbone)
    saved = set(meta.get("tensors", ()))
    if not saved >= {f"{prefix}.{k}" for k in backbone.state_dict()}:
        return None, f"{meta['method']} keeps its backbone frozen (prompts or prefixes carry the training)"
    if not hasattr(backbone, "save_pretrained"):
        return None, f"the backbone is a {type(backbone).__name__}, not a transformers model"

    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Pooling, Transformer

    hf_dir = Path(workdir) / "backbone"
    backbone.save_pretrained(hf_dir)
    model.tokenizer.save_pretrained(hf_dir)
    dim = int(backbone.config.hidden_size)
    modules = [Transformer(str(hf_dir)), Pooling(dim, pooling_mode=_POOLING_MODES[pooler])]
    if pooler == "cls":  # SimCSE's `cls` pooler: CLS → Linear(d, d) + tanh, the trained MLP
        dense = getattr(getattr(model, "mlp", None), "dense", None)
        if not isinstance(dense, torch.nn.Linear):
            return None, f"pooler 'cls' of {meta['method']} has no Linear+tanh MLP (`mlp.dense`)"
        modules.append(
            Dense(
                dim,
                dense.out_features,
                activation_function=torch.nn.Tanh(),
                init_weight=dense.weight.detach().clone(),
                init_bias=dense.bias.detach().clone(),
            )
        )
    st = SentenceTransformer(modules=modules, device="cpu")
    # what it was fine-tuned from (MLflow records it as the flavour's `source_model_name`), not the temporary folder
    modules[0].auto_model.name_or_path = modules[0].auto_model.config._name_or_path = str(meta["backbone"])
    expected = _embed(model, INPUT_EXAMPLE)
    found = st.encode(INPUT_EXAMPLE, convert_to_numpy=True)
    if found.shape != expected.shape or not np.allclose(found, expected, atol=_ATOL, rtol=0):
        gap = float(np.abs(found - expected).max()) if found.shape == expected.shape else float("inf")
        return None, f"the standard pipeline differs from the checkpoint's embedding (max |diff| {gap:.2e})"
    return st, f"{meta['method']}: fully trained encoder with pooler {pooler!r}"
