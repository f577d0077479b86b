"""The SimCSE model (models/methods/simcse.py): full fine-tuning, `cls` MLP, poolers, checkpoints (Gao et al., 2021)."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel

from cse.config.methods import build_model, model_class
from cse.models.batching import TrainBatch
from cse.models.checkpoint import load_checkpoint, save_checkpoint
from cse.models.losses import contrastive_loss
from cse.models.methods.simcse import SimCSE, SimCSEConfig

B, T, D, LAYERS = 4, 9, 32, 2
SENTENCES = ["a man is playing a guitar .", "the cat sleeps", "two dogs run on the beach today", "it rains"]


@pytest.fixture
def make_model(tiny_bert_dir):
    def make(**overrides) -> SimCSE:
        torch.manual_seed(0)
        return SimCSE(SimCSEConfig(backbone=str(tiny_bert_dir), **overrides))

    return make


def _views(tokenizer, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(SENTENCES, padding="max_length", max_length=T, truncation=True, return_tensors="pt")
    return enc["input_ids"].unsqueeze(1).repeat(1, n, 1), enc["attention_mask"].unsqueeze(1).repeat(1, n, 1)


def _seeded_loss(model, ids, mask, seed: int = 123) -> float:
    """The loss under a fixed dropout sample, so two evaluations differ only by the weights."""
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(ids, mask)[0].item()


def test_registry_and_config():
    assert model_class("simcse") is SimCSE and SimCSE.config_class is SimCSEConfig
    cfg = SimCSEConfig(backbone="x")
    assert (cfg.temperature, cfg.mlp_only_train, cfg.hard_negative_weight) == (0.05, True, 0.0)
    assert SimCSEConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="temperature"):
        SimCSEConfig(backbone="x", temperature=0.0)
    with pytest.raises(ValueError, match="unknown"):
        SimCSEConfig.from_dict({"backbone": "x", "mlm": True})
    with pytest.raises(ValueError, match="train_mlp"):
        SimCSEConfig(backbone="x", train_mlp=False, mlp_only_train=False)


def test_everything_trainable_pooler_dropped_and_tiny_count(make_model):
    model = make_model()
    assert model.backbone.pooler is None
    assert all(p.requires_grad for p in model.parameters())
    assert model.evaluation_pooler == "cls_before_pooler"
    assert make_model(mlp_only_train=False).evaluation_pooler == "cls"
    # tiny BERT (V = 30522, 128 positions, d = 32, intermediate 64) without pooler, plus the d×d + d MLP
    vocab = model.backbone.config.vocab_size
    embeddings = vocab * D + 128 * D + 2 * D + 2 * D
    layer = 4 * (D * D + D) + 2 * D + (D * 64 + 64) + (64 * D + D) + 2 * D
    assert model.trainable_parameter_count() == embeddings + LAYERS * layer + (D * D + D)
    assert model.describe()["mlp_only_train"] is True


def test_bert_base_trainable_parameter_count():
    """BERT-base (random weights, no download): every backbone tensor but the dropped pooler, plus the MLP.

    embeddings: word 30522·768 = 23,440,896 + positions 512·768 = 393,216 + token types 2·768 = 1,536
                + LayerNorm 2·768 = 1,536                                               = 23,837,184
    one layer:  Q, K, V, O 4·(768·768 + 768) = 2,362,368 + LayerNorm 1,536
                + intermediate 768·3072 + 3072 = 2,362,368 + output 3072·768 + 768 = 2,360,064
                + LayerNorm 1,536                                                       =  7,087,872
    12 layers = 85,054,464; backbone without pooler = 108,891,648; `cls` MLP 768·768 + 768 = 590,592
    → 109,482,240 trainable (the size of BERT-base with its pooler, which the MLP replaces).
    """
    torch.manual_seed(0)
    backbone = BertModel(BertConfig())
    model = SimCSE(SimCSEConfig(backbone="bert-base-uncased"), backbone=backbone)
    embeddings = 30522 * 768 + 512 * 768 + 2 * 768 + 2 * 768
    layer = 4 * (768 * 768 + 768) + 2 * 768 + (768 * 3072 + 3072) + (3072 * 768 + 768) + 2 * 768
    assert (embeddings, layer) == (23_837_184, 7_087_872)
    assert sum(p.numel() for p in model.backbone.parameters()) == embeddings + 12 * layer == 108_891_648
    assert sum(p.numel() for p in model.mlp.parameters()) == 590_592
    assert model.trainable_parameter_count() == 109_482_240


def test_loss_decreases_and_every_backbone_tensor_changes(make_model, tokenizer):
    model = make_model().train()
    ids, mask = _views(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = _seeded_loss(model, ids, mask)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for step in range(5):
        opt.zero_grad()
        out = model.training_step(TrainBatch(ids, mask), step=step)
        out.loss.backward()
        opt.step()
    assert set(out.metrics) == {"loss_contrastive"}
    assert _seeded_loss(model, ids, mask) < start - 0.1
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), n


def test_gradients_reach_every_tensor(make_model, tokenizer):
    model = make_model().train()
    ids, mask = _views(tokenizer)
    model(ids, mask)[0].backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


@pytest.mark.parametrize("train_mlp", [True, False])
def test_training_loss_is_contrastive_on_mlp_of_cls(make_model, tokenizer, train_mlp):
    """`train_mlp=False` (the sentence-transformers peer setting): CLS pooling + the contrastive loss, MLP unused."""
    model = make_model(train_mlp=train_mlp).train()
    ids, mask = _views(tokenizer)
    torch.manual_seed(7)
    loss, z = model(ids, mask)
    torch.manual_seed(7)  # same dropout sample: the rows are encoded in the same single pass
    cls = model.backbone(input_ids=ids.reshape(-1, T), attention_mask=mask.reshape(-1, T)).last_hidden_state[:, 0]
    want_z = (torch.tanh(model.mlp.dense(cls)) if train_mlp else cls).view(B, 2, D)
    torch.testing.assert_close(z, want_z, rtol=0, atol=0)
    torch.testing.assert_close(loss, contrastive_loss(want_z[:, 0], want_z[:, 1], temperature=0.05), rtol=0, atol=0)
    assert (z[:, 0] - z[:, 1]).abs().max() > 1e-4  # dropout makes the two views differ
    loss.backward()
    assert all((p.grad is not None) == train_mlp for p in model.mlp.parameters())


def test_supervised_three_views(make_model, tokenizer):
    model = make_model(mlp_only_train=False).train()
    ids, mask = _views(tokenizer, n=3)
    loss, z = model(ids, mask)
    assert z.shape == (B, 3, D) and torch.isfinite(loss)
    loss.backward()
    assert model.mlp.dense.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="input_ids"):
        model(ids[:, 0], mask[:, 0])


def test_embed_poolers(make_model, tokenizer):
    ids, mask = _views(tokenizer)
    ids, mask = ids[:, 0], mask[:, 0]
    unsup, sup = make_model().eval(), make_model(mlp_only_train=False).eval()
    with torch.inference_mode():
        cls = unsup.backbone(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        torch.testing.assert_close(unsup.embed(ids, mask), cls, rtol=0, atol=0)
        torch.testing.assert_close(unsup.embed(ids, mask), unsup.embed(ids, mask), rtol=0, atol=0)
        cls_sup = sup.backbone(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        torch.testing.assert_close(sup.embed(ids, mask), sup.mlp(cls_sup), rtol=0, atol=0)
    assert unsup.embed(ids, mask).shape == (B, D)


def test_checkpoint_round_trip_gives_identical_embeddings(make_model, tokenizer, tmp_path):
    model = make_model(mlp_only_train=False).train()
    ids, mask = _views(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(ids, mask)[0].backward()
    opt.step()  # the fine-tuned backbone and MLP must both travel in the checkpoint
    model.eval()
    folder = save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_checkpoint(folder)
    assert isinstance(loaded, SimCSE) and not loaded.training and loaded.config == model.config
    with torch.inference_mode():
        torch.testing.assert_close(
            loaded.embed(ids[:, 0], mask[:, 0]), model.embed(ids[:, 0], mask[:, 0]), rtol=0, atol=0
        )
    rebuilt = build_model("simcse", model.config.to_dict())
    assert rebuilt.evaluation_pooler == "cls"
