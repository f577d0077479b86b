"""Checkpoint round trip (models/checkpoint.py): small weight files, identical embeddings, backbone checks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertModel

from cse.models.checkpoint import META_FILE, WEIGHTS_FILE, BackboneMismatchError, load_checkpoint, save_checkpoint
from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig
from tests.batches import tiny_bert_config


def _trained(tiny_bert_dir, tokenizer, **overrides) -> D2CSE:
    """A model after two optimiser steps (prompts, heads and BatchNorm statistics all moved)."""
    torch.manual_seed(0)
    model = D2CSE(D2CSEModelConfig(backbone=str(tiny_bert_dir), prefix_len=3, **overrides)).train()
    enc = tokenizer(
        ["a man plays a guitar", "the cat sleeps", "dogs run", "it rains today"], padding=True, return_tensors="pt"
    )
    ids = enc["input_ids"].unsqueeze(1).repeat(1, 2, 1)
    mask = enc["attention_mask"].unsqueeze(1).repeat(1, 2, 1)
    cor = ids.clone()
    cor[:, :, 2] = 2000
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(ids, mask, cor).loss.backward()
        opt.step()
    return model.eval()


def _sentences(tokenizer):
    enc = tokenizer(["a woman is slicing an onion .", "nobody is here"], padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _save_tiny_bert(folder, tokenizer, hidden: int, seed: int):
    torch.manual_seed(seed)
    cfg = tiny_bert_config(len(tokenizer))
    cfg.hidden_size = hidden
    BertModel(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("cls_prompt", [False, True])
def test_round_trip_gives_identical_embeddings(tiny_bert_dir, tokenizer, tmp_path, cls_prompt):
    model = _trained(tiny_bert_dir, tokenizer, cls_prompt=cls_prompt)
    save_checkpoint(model, tmp_path / "ckpt", extra_meta={"step": 2, "stsb_dev": 12.5})
    loaded = load_checkpoint(tmp_path / "ckpt", device="cpu")
    assert (
        not loaded.training and loaded.tokenizer("a cat sleeps")["input_ids"] == tokenizer("a cat sleeps")["input_ids"]
    )
    assert loaded.config == model.config
    ids, mask = _sentences(tokenizer)
    with torch.inference_mode():
        torch.testing.assert_close(loaded.embed(ids, mask), model.embed(ids, mask), rtol=0, atol=0)
    for name, tensor in model.projection.state_dict().items():  # BatchNorm statistics travel too
        torch.testing.assert_close(loaded.projection.state_dict()[name], tensor, rtol=0, atol=0)


def test_weights_file_holds_only_trainable_tensors_and_buffers(tiny_bert_dir, tokenizer, tmp_path):
    model = _trained(tiny_bert_dir, tokenizer, cls_prompt=True)
    folder = save_checkpoint(model, tmp_path / "ckpt")
    state = load_file(str(folder / WEIGHTS_FILE))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    buffers = {
        "projection.net.1.running_mean",
        "projection.net.1.running_var",
        "projection.net.1.num_batches_tracked",
        "projection.net.4.running_mean",
        "projection.net.4.running_var",
        "projection.net.4.num_batches_tracked",
    }
    training_only = {"rtd_head.classifier.weight", "rtd_head.classifier.bias"}  # D2CSE.not_for_inference
    assert set(state) == (trainable - training_only) | buffers
    assert not any(k.startswith("encoder.backbone.") for k in state)
    meta = json.loads((folder / META_FILE).read_text())
    assert meta["method"] == "d2cse" and meta["backbone"] == str(tiny_bert_dir)
    assert meta["pooler"] == "cls_before_pooler" and meta["embedding_dim"] == 32
    assert meta["model_config"] == model.config.to_dict()
    assert meta["backbone_shape"]["hidden_size"] == 32 and meta["backbone_shape"]["vocab_size"] == len(tokenizer)
    assert meta["trainable_parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert meta["tensors"] == sorted(state)
    assert not any(p.name.startswith(".tmp-") for p in folder.iterdir())


def test_extra_meta_recorded_and_overwrite_in_place(tiny_bert_dir, tokenizer, tmp_path):
    model = _trained(tiny_bert_dir, tokenizer)
    save_checkpoint(model, tmp_path / "ckpt", extra_meta={"step": 1})
    save_checkpoint(model, tmp_path / "ckpt", extra_meta={"step": 2, "stsb_dev": 70.1})
    meta = json.loads((tmp_path / "ckpt" / META_FILE).read_text())
    assert meta["meta"] == {"step": 2, "stsb_dev": 70.1}


def test_backbone_with_other_shape_is_refused(tiny_bert_dir, tokenizer, tmp_path):
    folder = save_checkpoint(_trained(tiny_bert_dir, tokenizer), tmp_path / "ckpt")
    wider = _save_tiny_bert(tmp_path / "wider", tokenizer, hidden=48, seed=0)
    with pytest.raises(BackboneMismatchError, match=r"hidden_size \(checkpoint 32, found 48\)"):
        load_checkpoint(folder, backbone_override=str(wider))


def test_backbone_with_same_shape_other_weights_is_refused(tiny_bert_dir, tokenizer, tmp_path):
    folder = save_checkpoint(_trained(tiny_bert_dir, tokenizer), tmp_path / "ckpt")
    other = _save_tiny_bert(tmp_path / "other", tokenizer, hidden=32, seed=1)
    with pytest.raises(BackboneMismatchError, match="different weights"):
        load_checkpoint(folder, backbone_override=str(other))


def test_override_with_a_copy_of_the_same_backbone_loads(tiny_bert_dir, tokenizer, tmp_path):
    model = _trained(tiny_bert_dir, tokenizer)
    folder = save_checkpoint(model, tmp_path / "ckpt")
    copy_dir = tmp_path / "copy"
    BertModel.from_pretrained(tiny_bert_dir).save_pretrained(copy_dir)
    tokenizer.save_pretrained(copy_dir)
    loaded = load_checkpoint(folder, backbone_override=str(copy_dir))
    assert loaded.config.backbone == str(copy_dir)
    ids, mask = _sentences(tokenizer)
    with torch.inference_mode():
        torch.testing.assert_close(loaded.embed(ids, mask), model.embed(ids, mask), rtol=0, atol=0)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=META_FILE):
        load_checkpoint(tmp_path / "nothing")


def test_evaluator_loader_accepts_the_checkpoint(tiny_bert_dir, tokenizer, tmp_path):
    from cse.models.checkpoint import load_checkpoint_folder
    from cse.models.embedder import SentenceEmbedder

    model = _trained(tiny_bert_dir, tokenizer)
    folder = save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_checkpoint_folder(folder, expect_backbone=str(tiny_bert_dir), expect_pooler="cls_before_pooler")
    assert isinstance(loaded, SentenceEmbedder) and not loaded.training
    ids, mask = _sentences(tokenizer)
    with torch.inference_mode():
        torch.testing.assert_close(loaded.embed(ids, mask), model.embed(ids, mask), rtol=0, atol=0)
