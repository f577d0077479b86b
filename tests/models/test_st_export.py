"""Export of a checkpoint as a sentence-transformers folder (models/export/st_export.py): the folder's layout, embeddings
identical to the checkpoint model's `embed`, prompts and truncation, re-export, and bad folders."""

from __future__ import annotations

import json

import pytest
import torch
from sentence_transformers import SentenceTransformer

from cse.models.checkpoint import META_FILE, WEIGHTS_FILE, CheckpointError, load_checkpoint, save_checkpoint
from cse.models.export.st_export import CHECKPOINT_SUBDIR, PromptedEncoderModule, export_sentence_transformer
from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig
from cse.models.methods.diffcse import DiffCSE, DiffCSEConfig
from tests.batches import corrupted_views

SENTENCES = ["a woman is slicing an onion .", "nobody is here", "two dogs run on the beach today", "it rains"]


def _trained_checkpoint(method: str, tiny_bert_dir, tokenizer, folder):
    """A checkpoint after two optimiser steps (prompts or encoder, BN-MLP statistics all moved)."""
    torch.manual_seed(0)
    if method == "d2cse":
        model = D2CSE(D2CSEModelConfig(backbone=str(tiny_bert_dir), prefix_len=3, cls_prompt=True))
    else:
        model = DiffCSE(DiffCSEConfig(backbone=str(tiny_bert_dir)))
    model.train()
    ids, mask, cor, lab = corrupted_views(tokenizer)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(ids, mask, cor, lab).loss.backward()
        opt.step()
    return save_checkpoint(model.eval(), folder)


@pytest.fixture(scope="module", params=["d2cse", "diffcse"])
def checkpoint(request, tiny_bert_dir, tokenizer, tmp_path_factory):
    return _trained_checkpoint(request.param, tiny_bert_dir, tokenizer, tmp_path_factory.mktemp("ckpt") / "best")


def _embed(model, tokenizer, sentences):
    enc = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.inference_mode():
        return model.embed(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids"))


def test_exported_folder_layout(checkpoint, tmp_path):
    out = export_sentence_transformer(checkpoint, tmp_path / "st")
    assert out == tmp_path / "st"
    modules = json.loads((out / "modules.json").read_text())
    assert modules == [{"idx": 0, "name": "0", "path": "", "type": "cse.models.export.st_export.PromptedEncoderModule"}]
    for name in (META_FILE, WEIGHTS_FILE):  # the checkpoint travels byte for byte
        assert (out / CHECKPOINT_SUBDIR / name).read_bytes() == (checkpoint / name).read_bytes()
    assert json.loads((out / "config.json").read_text()) == {"max_seq_length": None}
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()


def test_exported_model_embeds_as_the_checkpoint(checkpoint, tokenizer, tmp_path):
    out = export_sentence_transformer(checkpoint, tmp_path / "st")
    st = SentenceTransformer(str(out), trust_remote_code=True, device="cpu")
    got = st.encode(SENTENCES, convert_to_tensor=True)
    want = _embed(load_checkpoint(checkpoint), tokenizer, SENTENCES)
    assert got.shape == (len(SENTENCES), 32)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert st[0].get_sentence_embedding_dimension() == 32
    # a prompt is prepended to the text before tokenisation
    prompted = st.encode(["a cat"], prompt="query: ", convert_to_tensor=True)
    torch.testing.assert_close(
        prompted, _embed(load_checkpoint(checkpoint), tokenizer, ["query: a cat"]), rtol=0, atol=1e-6
    )


def test_max_seq_length_truncates_and_survives_a_save(checkpoint, tmp_path):
    module = PromptedEncoderModule(checkpoint, max_seq_length=5)
    features = module.preprocess([SENTENCES[2], "hi"])
    assert features["input_ids"].shape == (2, 5) and features["attention_mask"].sum(1).tolist() == [5, 3]
    SentenceTransformer(modules=[module], device="cpu").save(str(tmp_path / "st"))
    reloaded = SentenceTransformer(str(tmp_path / "st"), trust_remote_code=True, device="cpu")
    assert reloaded[0].max_seq_length == 5
    assert reloaded[0].preprocess([SENTENCES[2]])["input_ids"].shape == (1, 5)
    assert PromptedEncoderModule(checkpoint).preprocess([SENTENCES[2]])["input_ids"].shape == (1, 9)  # None: no cut


def test_export_replaces_an_earlier_folder(checkpoint, tmp_path):
    out = tmp_path / "st"
    (out / "stale").mkdir(parents=True)
    (out / "stale" / "old.bin").write_bytes(b"x")
    export_sentence_transformer(checkpoint, out)
    assert not (out / "stale").exists() and (out / "modules.json").is_file()


def test_a_missing_checkpoint_is_refused_and_the_earlier_export_kept(checkpoint, tmp_path):
    out = export_sentence_transformer(checkpoint, tmp_path / "st")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(FileNotFoundError, match=META_FILE):
        export_sentence_transformer(tmp_path / "nothing", out)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_a_damaged_checkpoint_is_refused(checkpoint, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / META_FILE).write_text("{ not json")
    (bad / WEIGHTS_FILE).write_bytes((checkpoint / WEIGHTS_FILE).read_bytes())
    with pytest.raises(CheckpointError, match=META_FILE):
        export_sentence_transformer(bad, tmp_path / "st")
    assert not (tmp_path / "st").exists()
    not_ours = tmp_path / "not_ours"
    not_ours.mkdir()
    (not_ours / META_FILE).write_text(json.dumps({"method": "d2cse"}))
    with pytest.raises(CheckpointError, match="lacks the keys"):
        export_sentence_transformer(not_ours, tmp_path / "st")


def test_exporting_onto_the_checkpoint_is_refused(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="overwrite the checkpoint"):
        export_sentence_transformer(checkpoint, checkpoint)
    with pytest.raises(ValueError, match="overwrite the checkpoint"):
        export_sentence_transformer(checkpoint, checkpoint.parent)
    with pytest.raises(ValueError, match="overwrite the checkpoint"):
        export_sentence_transformer(checkpoint, checkpoint / "st")
    assert (checkpoint / META_FILE).is_file() and (checkpoint / WEIGHTS_FILE).is_file()
    assert sorted(p.name for p in checkpoint.iterdir()) == sorted([META_FILE, WEIGHTS_FILE])
