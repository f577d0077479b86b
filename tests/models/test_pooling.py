"""Poolers on hand-made hidden states, and PooledEncoder / checkpoint-folder loading on the tiny BERT."""

from __future__ import annotations

import json
import typing

import pytest
import torch

from cse.config.evaluation import Pooler
from cse.models.checkpoint import load_checkpoint_folder, read_checkpoint_config
from cse.models.embedder import CheckpointMismatchError, PooledEncoder
from cse.models.pooling import POOLERS, UnknownPoolerError, masked_mean, needs_hidden_states, pool

# Two rows, three positions, d = 2; row 1 has one pad at the end.
LAST = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], [[10.0, 0.0], [20.0, 2.0], [99.0, 99.0]]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
EMB = torch.zeros_like(LAST)  # hidden_states[0]
L1 = torch.ones_like(LAST)  # hidden_states[1]
HIDDEN = (EMB, L1, LAST)  # embeddings, layer 1, layer 2 (= last)


def test_pooler_names_agree_with_config():
    assert set(typing.get_args(Pooler)) == set(POOLERS)


def test_cls_poolers():
    assert torch.equal(pool("cls_before_pooler", LAST, MASK), LAST[:, 0])
    mlp = torch.nn.Linear(2, 2)
    with torch.no_grad():
        mlp.weight.copy_(torch.eye(2) * 2)
        mlp.bias.fill_(1.0)
    assert torch.equal(pool("cls", LAST, MASK, mlp=mlp), torch.tensor([[3.0, 5.0], [21.0, 1.0]]))
    with pytest.raises(ValueError, match="needs an MLP"):
        pool("cls", LAST, MASK)


def test_avg_excludes_padding():
    out = pool("avg", LAST, MASK)
    assert torch.allclose(out, torch.tensor([[3.0, 4.0], [15.0, 1.0]]))
    assert torch.allclose(masked_mean(LAST, torch.ones(2, 3)), LAST.mean(dim=1))


def test_avg_first_last_layer_choice_and_top2():
    first0 = pool("avg_first_last", LAST, MASK, hidden_states=HIDDEN, first_layer=0)
    assert torch.allclose(first0, torch.tensor([[1.5, 2.0], [7.5, 0.5]]))  # (0 + last) / 2
    first1 = pool("avg_first_last", LAST, MASK, hidden_states=HIDDEN, first_layer=1)
    assert torch.allclose(first1, torch.tensor([[2.0, 2.5], [8.0, 1.0]]))  # (1 + last) / 2
    top2 = pool("avg_top2", LAST, MASK, hidden_states=HIDDEN)
    assert torch.allclose(top2, first1)  # second-last = layer 1 here
    with pytest.raises(ValueError, match="hidden states"):
        pool("avg_top2", LAST, MASK)
    with pytest.raises(ValueError, match="first_layer"):
        pool("avg_first_last", LAST, MASK, hidden_states=HIDDEN, first_layer=2)
    assert needs_hidden_states("avg_top2") and not needs_hidden_states("avg")


def test_mask_pooler_takes_first_mask_token():
    ids = torch.tensor([[101, 103, 103], [101, 7, 103]])
    assert torch.equal(
        pool("mask", LAST, MASK, input_ids=ids, mask_token_id=103), torch.tensor([[3.0, 4.0], [99.0, 99.0]])
    )
    with pytest.raises(ValueError, match="no \\[MASK\\]"):
        pool("mask", LAST, MASK, input_ids=torch.tensor([[101, 103, 5], [101, 7, 8]]), mask_token_id=103)


def test_unknown_pooler():
    with pytest.raises(UnknownPoolerError, match="unknown pooler 'max'.*cls_before_pooler"):
        pool("max", LAST, MASK)


# ---------------------------------------------------------------- PooledEncoder


@pytest.fixture(scope="module")
def tiny_cls(tiny_bert_dir):
    return PooledEncoder.from_pretrained(str(tiny_bert_dir), "cls")


def _batch(enc, sentences):
    from cse.evaluation.encode import pad_batch

    return pad_batch(enc.token_ids(sentences), enc.pad_token_id)


def test_cls_uses_the_pretrained_pooler(tiny_cls):
    ids, mask = _batch(tiny_cls, ["a short one .", "a rather longer sentence than the first one ."])
    with torch.inference_mode():
        out = tiny_cls.embed(ids, mask)
        ref = tiny_cls.backbone(input_ids=ids, attention_mask=mask).pooler_output
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("pooler", ["cls_before_pooler", "avg", "avg_first_last", "avg_top2"])
def test_embedding_does_not_depend_on_padding(tiny_bert_dir, pooler):
    enc = PooledEncoder.from_pretrained(str(tiny_bert_dir), pooler)
    sents = ["a short one .", "a rather longer sentence than the first one , with a clause ."]
    ids, mask = _batch(enc, sents)
    with torch.inference_mode():
        batched = enc.embed(ids, mask)
        alone = enc.embed(*_batch(enc, sents[:1]))
    assert mask[0].sum() < mask.shape[1]  # row 0 is padded
    assert torch.allclose(batched[0], alone[0], atol=1e-5)


def test_mask_pooler_needs_a_template(tiny_bert_dir):
    with pytest.raises(ValueError, match="template"):
        PooledEncoder.from_pretrained(str(tiny_bert_dir), "mask")
    enc = PooledEncoder.from_pretrained(
        str(tiny_bert_dir), "mask", template='This sentence : "{sentence}" means [MASK] .'
    )
    ids = enc.token_ids(["hello world"])
    assert enc.tokenizer.mask_token_id in ids[0]
    ids_t, mask = _batch(enc, ["hello world", "a b c d e f"])
    with torch.inference_mode():
        out = enc.embed(ids_t, mask)
        last = enc.backbone(input_ids=ids_t, attention_mask=mask).last_hidden_state
    pos = (ids_t[0] == enc.tokenizer.mask_token_id).nonzero()[0, 0]
    assert torch.allclose(out[0], last[0, pos], atol=1e-6)


def test_cls_refuses_a_model_without_pooler_weights(tmp_path, tokenizer):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    BertModel(cfg, add_pooling_layer=False).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no pretrained pooler weights"):
        PooledEncoder.from_pretrained(str(tmp_path), "cls")
    assert PooledEncoder.from_pretrained(str(tmp_path), "cls_before_pooler").pooler_name == "cls_before_pooler"


def test_unknown_pooler_on_load(tiny_bert_dir):
    with pytest.raises(UnknownPoolerError):
        PooledEncoder.from_pretrained(str(tiny_bert_dir), "first_token")


# ---------------------------------------------------------------- checkpoint folders


def _fake_checkpoint(folder, **cfg):
    """A folder that passes `validate_checkpoint` (metadata keys, a well-formed safetensors file) but holds no model."""
    from safetensors.torch import save_file

    from cse.models.checkpoint import FORMAT_VERSION

    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "format_version": FORMAT_VERSION,
        "method": "d2cse",
        "backbone": "bert-base-uncased",
        "pooler": "cls_before_pooler",
        "backbone_shape": {},
        "backbone_fingerprint": "none",
        "model_config": {},
        **cfg,
    }
    (folder / "cse_model.json").write_text(json.dumps(meta))
    save_file({"unused": torch.zeros(1)}, str(folder / "weights.safetensors"))
    return folder


def test_checkpoint_folder_checks(tmp_path):
    with pytest.raises(FileNotFoundError, match="cse_model.json"):
        read_checkpoint_config(tmp_path)
    ck = _fake_checkpoint(tmp_path / "ck")
    assert read_checkpoint_config(ck)["method"] == "d2cse"
    with pytest.raises(CheckpointMismatchError, match="pooler 'cls_before_pooler', not 'avg'"):
        load_checkpoint_folder(ck, expect_pooler="avg")
    (ck / "weights.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights.safetensors"):
        read_checkpoint_config(ck)
    bad = _fake_checkpoint(tmp_path / "bad")
    (bad / "cse_model.json").write_text(json.dumps({"method": "d2cse"}))
    with pytest.raises(ValueError, match="lacks the keys .*'backbone'"):
        read_checkpoint_config(bad)
