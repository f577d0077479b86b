"""Small real-sentence batches shared by the model tests, the default-dtype switch of the float64 checks, and the
tiny BERT shape of the test backbones."""

from __future__ import annotations

import contextlib

import torch

SENTENCES = ["a man is playing a guitar .", "the cat sleeps", "two dogs run on the beach today", "it rains"]


def corrupted_views(tokenizer, n: int = 2, seed: int = 0, length: int = 9):
    """(4, n, length) ids and mask of real sentences (short ones padded), plus a corruption per view: ids swapped at
    random non-special positions; labels 1 = replaced."""
    enc = tokenizer(SENTENCES, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    ids = enc["input_ids"].unsqueeze(1).repeat(1, n, 1)
    mask = enc["attention_mask"].unsqueeze(1).repeat(1, n, 1)
    g = torch.Generator().manual_seed(seed)
    corrupted = ids.clone()
    inner = (mask == 1) & (ids != tokenizer.cls_token_id) & (ids != tokenizer.sep_token_id)
    pick = inner & (torch.rand(ids.shape, generator=g) < 0.4)
    corrupted[pick] = torch.randint(2000, 3000, (int(pick.sum()),), generator=g)
    labels = (corrupted != ids).long() * mask
    return ids, mask, corrupted, labels


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Run the block with `dtype` as torch's default floating dtype (models built inside it use it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def tiny_bert_config(vocab_size: int, **overrides):
    """A 2-layer BERT of hidden size 32 (4 heads, feed-forward 64, 128 positions); `overrides` are BertConfig fields."""
    from transformers import BertConfig

    shape = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    return BertConfig(vocab_size=vocab_size, **shape, max_position_embeddings=128, **overrides)
