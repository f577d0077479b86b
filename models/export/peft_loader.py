"""The loader side of a PEFT prefix-tuning export: sentence embeddings with transformers + peft only.

`cse.models.export.peft_export.export_peft_adapter` writes an adapter folder (`adapter_config.json` +
`adapter_model.safetensors`, standard PEFT files, plus the tokenizer and `cse_peft.json`, the pooling this file applies)
and copies this file into it as `peft_embed.py`. This module therefore imports nothing from this project (a test checks
its imports): a user with transformers and peft installed embeds sentences with

    from peft_embed import load_prefix_encoder, embed_sentences
    model, tokenizer, spec = load_prefix_encoder("path/to/adapter")
    vectors = embed_sentences(model, tokenizer, spec, ["A man plays a guitar."])

What the stock libraries do with the adapter (transformers 5.23, peft 0.21.2): `PeftModel.from_pretrained` wraps the
base encoder; every forward builds the prefix keys/values as a `DynamicCache` of length P; BERT/RoBERTa self-attention
prepends them to its keys/values (`Cache.update`); the model derives "past length" = P from the cache and numbers the
token positions from P (BERT) or `padding_idx + 1 + P` (RoBERTa), as HF 4.x did; PEFT prepends P ones to the
attention mask and drops `token_type_ids` (all-zero segments, which is what single sentences have anyway).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from peft import PeftModel
from transformers import AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

SPEC_FILE = "cse_peft.json"
BUNDLED_BASE = "base_model"
SENTENCE_PLACEHOLDER = "{sentence}"
POOLINGS = ("cls", "pooler_output", "mask")


def read_spec(adapter_dir: str | Path) -> dict[str, Any]:
    """`cse_peft.json` of an adapter folder: pooling, template, base model and the export's notes."""
    path = Path(adapter_dir) / SPEC_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir} is not a CSE prefix adapter: {path} is missing")
    spec = json.loads(path.read_text(encoding="utf-8"))
    kind = spec.get("pooling", {}).get("kind")
    if kind not in POOLINGS:
        raise ValueError(f"{path}: pooling kind {kind!r} is not one of {POOLINGS}")
    return spec


def base_model_path(adapter_dir: str | Path) -> str:
    """The base encoder the adapter belongs to: the folder's bundled `base_model/` if there is one (a method that
    fine-tunes its encoder, DiffAug), else `base_model_name_or_path` of `adapter_config.json` (an HF id or a folder)."""
    bundled = Path(adapter_dir) / BUNDLED_BASE
    if (bundled / "config.json").is_file():
        return str(bundled)
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text(encoding="utf-8"))
    return config["base_model_name_or_path"]


def load_prefix_encoder(
    adapter_dir: str | Path, base_model: str | None = None, device: str | torch.device = "cpu"
) -> tuple[PeftModel, PreTrainedTokenizerBase, dict[str, Any]]:
    """`(PeftModel in eval mode, tokenizer, spec)`. `base_model` overrides the recorded base (e.g. a local copy of the
    same weights). The base is loaded with its pooling layer, which the `pooler_output` pooling needs."""
    spec = read_spec(adapter_dir)
    base = AutoModel.from_pretrained(base_model or base_model_path(adapter_dir))
    model = PeftModel.from_pretrained(base, str(adapter_dir)).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(adapter_dir))
    tokenizer.padding_side = "right"  # the [CLS]-prompt fold and the references assume right padding
    return model, tokenizer, spec


def model_inputs(spec: dict[str, Any], sentences: list[str]) -> list[str]:
    """The texts the tokenizer sees: the sentences, or each wrapped in the method's prompt template (DiffAug)."""
    template = spec["pooling"].get("template")
    if template is None:
        return [str(s) for s in sentences]
    head, tail = template.split(SENTENCE_PLACEHOLDER)
    return [(head + str(s) + tail).strip() for s in sentences]


def pool(spec: dict[str, Any], output: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The sentence vectors `(B, d)` of one forward: first-token state, the (carried) pooler, or the template's mask."""
    kind = spec["pooling"]["kind"]
    if kind == "cls":
        return output.last_hidden_state[:, 0]
    if kind == "pooler_output":
        if output.pooler_output is None:
            raise ValueError("pooling 'pooler_output' needs the base model's pooling layer (load it with AutoModel)")
        return output.pooler_output
    mask_id = int(spec["pooling"]["mask_token_id"])
    is_mask = (input_ids == mask_id) & attention_mask.bool()
    if not bool(is_mask.any(dim=1).all()):
        raise ValueError(f"pooling 'mask': a row holds no mask token (id {mask_id}); rows must come from the template")
    last = input_ids.shape[1] - 1 - is_mask.flip(1).to(torch.int8).argmax(dim=1)
    return output.last_hidden_state[torch.arange(input_ids.shape[0], device=input_ids.device), last]


@torch.inference_mode()
def embed_sentences(
    model: PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    spec: dict[str, Any],
    sentences: list[str],
    batch_size: int = 64,
) -> torch.Tensor:
    """Sentence embeddings `(N, d)` on the CPU: special tokens added, no truncation, right padding per batch."""
    device = next(model.parameters()).device
    texts = model_inputs(spec, sentences)
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i : i + batch_size], padding=True, truncation=False, return_tensors="pt")
        ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        output = model(input_ids=ids, attention_mask=mask)  # no token_type_ids: PEFT would drop them with a warning
        out.append(pool(spec, output, ids, mask).float().cpu())
    if not out:
        base = cast(PreTrainedModel, model.get_base_model())  # the transformers encoder PEFT wraps
        return torch.zeros(0, base.config.hidden_size)
    return torch.cat(out)
