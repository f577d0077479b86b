"""The DiffCSE model (models/methods/diffcse.py): trainable set, separate discriminator copy, conditioning through h,
supervised rows, parameter count and checkpoint round trip (Chuang et al., 2022)."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel

from cse.models.batching import TrainBatch
from cse.models.checkpoint import WEIGHTS_FILE, load_checkpoint, save_checkpoint
from cse.models.losses import contrastive_loss, rtd_loss
from cse.models.method import backbone_fingerprint
from cse.models.methods.diffcse import DiffCSE, DiffCSEConfig
from tests.batches import corrupted_views

B, T, D = 4, 9, 32


@pytest.fixture
def make_model(tiny_bert_dir):
    def make(**overrides) -> DiffCSE:
        torch.manual_seed(0)
        return DiffCSE(DiffCSEConfig(backbone=str(tiny_bert_dir), **overrides))

    return make


def _views(tokenizer, n: int = 2, seed: int = 0):
    return corrupted_views(tokenizer, n=n, seed=seed, length=T)


def _pretrained(tiny_bert_dir) -> dict[str, torch.Tensor]:
    return {
        k: v for k, v in BertModel.from_pretrained(tiny_bert_dir).state_dict().items() if not k.startswith("pooler.")
    }


def test_config_defaults_validation_and_registry(tiny_bert_dir):
    from cse.config.methods import build_model, model_class

    cfg = DiffCSEConfig(backbone="bert-base-uncased")
    assert (cfg.temperature, cfg.rtd_weight, cfg.hard_negative_weight, cfg.rtd_mean_over_padding) == (
        0.05,
        0.005,
        0.0,
        True,
    )
    assert DiffCSEConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        DiffCSEConfig.from_dict({**cfg.to_dict(), "prefix_len": 16})
    with pytest.raises(ValueError, match="temperature"):
        DiffCSEConfig(backbone="x", temperature=0.0)
    with pytest.raises(ValueError, match="rtd_weight"):
        DiffCSEConfig(backbone="x", rtd_weight=-1.0)
    assert model_class("diffcse") is DiffCSE and DiffCSE.config_class is DiffCSEConfig and DiffCSE.uses_corruption
    model = build_model("diffcse", {"backbone": str(tiny_bert_dir)})
    assert isinstance(model, DiffCSE) and model.tokenizer.cls_token_id == 101
    assert model.evaluation_pooler == "cls_before_pooler" and model.describe()["method"] == "diffcse"
    assert model.phases == ("main",)


def test_trainable_set_and_pooler_removed(make_model):
    model = make_model()
    assert model.encoder.pooler is None and model.discriminator.backbone.pooler is None
    assert all(p.requires_grad for p in model.parameters())
    prefixes = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert prefixes == {"encoder", "discriminator", "projection", "rtd_head"}
    assert not any("pooler" in n for n, _ in model.named_parameters())
    assert model.backbone is model.encoder
    bert = sum(p.numel() for p in model.encoder.parameters())
    assert sum(p.numel() for p in model.discriminator.parameters()) == bert
    assert model.trainable_parameter_count() == 2 * bert + (D * 2 * D + 2 * 2 * D + 2 * D * D) + (2 * D + 2)


def test_discriminator_is_a_separate_copy_of_the_pretrained_backbone(make_model, tiny_bert_dir):
    model = make_model()
    pretrained = _pretrained(tiny_bert_dir)
    enc, disc = model.encoder.state_dict(), model.discriminator.backbone.state_dict()
    assert set(enc) == set(disc) == set(pretrained)
    for name, tensor in pretrained.items():
        torch.testing.assert_close(enc[name], tensor, rtol=0, atol=0)
        torch.testing.assert_close(disc[name], tensor, rtol=0, atol=0)
    enc_storage = {p.untyped_storage().data_ptr() for p in model.encoder.parameters()}
    assert not enc_storage & {p.untyped_storage().data_ptr() for p in model.discriminator.parameters()}
    with torch.no_grad():
        model.encoder.embeddings.word_embeddings.weight.add_(1.0)
    torch.testing.assert_close(
        model.discriminator.backbone.embeddings.word_embeddings.weight,
        pretrained["embeddings.word_embeddings.weight"],
        rtol=0,
        atol=0,
    )
    # the fingerprint recorded for checkpoints is the pretrained one, taken before any update
    assert model.pretrained_fingerprint == backbone_fingerprint(BertModel.from_pretrained(tiny_bert_dir))


def _triplets(tokenizer):
    """(B, 3, T) NLI-style rows (anchor, entailment, contradiction) with one corruption per row."""
    columns = [
        ["a man is playing a guitar .", "the cat sleeps", "two dogs run on the beach today", "it rains"],
        ["a person plays music", "a cat is asleep", "dogs are running outside", "the weather is wet"],
        ["nobody plays anything", "the cat is awake", "the dogs sit at home", "it is sunny"],
    ]
    encs = [tokenizer(c, padding="max_length", max_length=T, truncation=True, return_tensors="pt") for c in columns]
    ids = torch.stack([e["input_ids"] for e in encs], dim=1)
    mask = torch.stack([e["attention_mask"] for e in encs], dim=1)
    g = torch.Generator().manual_seed(0)
    corrupted = ids.clone()
    inner = (mask == 1) & (ids != tokenizer.cls_token_id) & (ids != tokenizer.sep_token_id)
    pick = inner & (torch.rand(ids.shape, generator=g) < 0.4)
    corrupted[pick] = torch.randint(2000, 3000, (int(pick.sum()),), generator=g)
    return ids, mask, corrupted


def test_loss_decreases_and_every_tensor_updates(tiny_bert_dir, tokenizer):
    """Dropout off so the loss of the fixed batch is a deterministic function of the weights: the tiny random
    BERT's CLS vectors differ mostly by dropout noise (BatchNorm amplifies it), so one dropout sample's loss
    says little about progress. Supervised rows keep the contrastive term non-trivial without dropout."""
    backbone = BertModel.from_pretrained(tiny_bert_dir, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = DiffCSE(DiffCSEConfig(backbone=str(tiny_bert_dir)), backbone=backbone, tokenizer=tokenizer).train()
    ids, mask, cor = _triplets(tokenizer)
    batch = TrainBatch(ids, mask, cor)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    history = []
    for step in range(5):
        opt.zero_grad()
        out = model.training_step(batch, step=step)
        out.loss.backward()
        opt.step()
        history.append({k: v.item() for k, v in out.metrics.items()} | {"loss": out.loss.item()})
    assert set(out.metrics) == {"loss_contrastive", "loss_rtd", "rtd_accuracy"}
    assert all(not v.requires_grad and v.dim() == 0 for v in out.metrics.values())
    assert out.loss.item() == pytest.approx(
        out.metrics["loss_contrastive"].item() + 0.005 * out.metrics["loss_rtd"].item(), rel=1e-6
    )
    for key in ("loss", "loss_contrastive", "loss_rtd"):
        values = [h[key] for h in history]
        assert all(b < a for a, b in zip(values, values[1:])), (key, values)
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), name  # encoder, discriminator, BN-MLP, RTD head: all move


def test_discriminator_conditioning_on_h(make_model, tokenizer):
    model = make_model().eval()  # deterministic passes
    _, mask, cor, lab = _views(tokenizer)
    cor, mask, lab = cor[:, 0], mask[:, 0], lab[:, 0]
    h = torch.randn(B, D, requires_grad=True)
    logits = model.discriminate(cor, mask, h)
    assert logits.shape == (B, T, 2)
    assert (logits - model.discriminate(cor, mask, h.detach() + torch.randn(B, D))).abs().max() > 1e-4
    assert (logits - model.discriminate(cor, mask, None)).abs().max() > 1e-4
    torch.nn.functional.cross_entropy(logits.reshape(-1, 2), lab.reshape(-1)).backward()
    assert h.grad is not None and h.grad.abs().sum() > 0


def test_rtd_gradient_reaches_the_encoder_through_h(make_model, tokenizer):
    model = make_model().train()
    ids, mask, cor, lab = _views(tokenizer)
    out = model(ids, mask, cor, lab)
    encoder_params = [p for p in model.encoder.parameters()]
    grads = torch.autograd.grad(
        out.rtd_loss, encoder_params + [model.projection.net[0].weight], allow_unused=True, retain_graph=True
    )
    assert all(g is not None for g in grads)
    assert grads[-1].abs().sum() > 0
    assert sum(g.abs().sum() for g in grads[:-1]) > 0
    last_layer = model.encoder.encoder.layer[-1].output.dense.weight
    (g_last,) = torch.autograd.grad(out.rtd_loss, last_layer, retain_graph=True)
    assert g_last.abs().sum() > 0
    # ...and only through h: the encoder is not in the discriminator's pass otherwise
    h = out.h.reshape(B * 2, D).detach()
    logits = model.discriminate(cor.reshape(-1, T), mask.reshape(-1, T), h)
    detached = rtd_loss(logits, lab.reshape(-1, T), mask.reshape(-1, T))
    assert torch.autograd.grad(detached, last_layer, allow_unused=True)[0] is None


def test_rtd_loss_mean_over_padding_flag(make_model, tokenizer):
    ids, mask, cor, lab = _views(tokenizer)
    assert (mask == 0).any()
    losses = {}
    for flag in (True, False):
        model = make_model(rtd_mean_over_padding=flag).eval()  # eval: deterministic, BN on running statistics
        with torch.no_grad():
            out = model(ids, mask, cor, lab)
            logits = model.discriminate(cor.reshape(-1, T), mask.reshape(-1, T), out.h.reshape(-1, D))
            want = rtd_loss(logits, lab.reshape(-1, T), mask.reshape(-1, T), mean_over_padding=flag)
        torch.testing.assert_close(out.rtd_loss, want, rtol=0, atol=0)
        losses[flag] = out.rtd_loss.item()
    assert losses[True] != pytest.approx(losses[False])


def test_supervised_three_views(make_model, tokenizer):
    model = make_model().train()
    ids, mask, cor, lab = _views(tokenizer, n=3)
    rows = []
    model.discriminator.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    out = model(ids, mask, cor, lab)
    assert out.h.shape == (B, 3, D) and rows == [3 * B]  # CRTD on anchor, entailment and contradiction
    z = out.h.detach()
    want = contrastive_loss(z[:, 0], z[:, 1], z[:, 2], temperature=0.05)
    torch.testing.assert_close(out.contrastive_loss.detach(), want)
    assert out.contrastive_loss.item() != pytest.approx(contrastive_loss(z[:, 0], z[:, 1], temperature=0.05).item())
    out.loss.backward()
    assert model.rtd_head.classifier.weight.grad.abs().sum() > 0
    assert model.encoder.embeddings.word_embeddings.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="corrupted_ids"):
        model(ids, mask, cor[:, :2])


def test_shared_corruption_and_default_labels(make_model, tokenizer):
    model = make_model().train()
    ids, mask, cor, lab = _views(tokenizer)
    torch.manual_seed(5)
    shared = model(ids, mask, cor[:, :1], lab[:, :1])
    torch.manual_seed(5)
    repeated = model(ids, mask, cor[:, :1].repeat(1, 2, 1), lab[:, :1].repeat(1, 2, 1))
    torch.manual_seed(5)
    derived = model(ids, mask, cor[:, :1])
    torch.testing.assert_close(shared.loss, repeated.loss, rtol=0, atol=0)
    torch.testing.assert_close(derived.rtd_loss, shared.rtd_loss, rtol=0, atol=0)


def test_embed_is_encoder_cls_before_pooler(make_model, tokenizer):
    model = make_model().eval()
    ids, mask, _, _ = _views(tokenizer)
    with torch.inference_mode():
        emb = model.embed(ids[:, 0], mask[:, 0])
        want = model.encoder(input_ids=ids[:, 0], attention_mask=mask[:, 0]).last_hidden_state[:, 0]
    assert emb.shape == (B, D)
    torch.testing.assert_close(emb, want, rtol=0, atol=0)
    assert model.token_ids(["a cat"]) == [tokenizer("a cat")["input_ids"]]


def test_bert_base_trainable_parameter_count():
    """2 × BERT-base without pooler (109,482,240 − 590,592 = 108,891,648) + BN-MLP (768·1536 + 2·1536 + 1536·768
    = 2,362,368) + RTD head (768·2 + 2 = 1,538) = 220,147,202."""
    torch.manual_seed(0)
    backbone = BertModel(BertConfig())  # 12 layers, 768, vocab 30522; random weights, no download
    total = sum(p.numel() for p in backbone.parameters())
    pooler = sum(p.numel() for p in backbone.pooler.parameters())
    assert (total, pooler) == (109_482_240, 590_592)
    model = DiffCSE(DiffCSEConfig(backbone="bert-base-uncased"), backbone=backbone)
    parts = {k: sum(p.numel() for p in m.parameters() if p.requires_grad) for k, m in model.named_children()}
    assert parts == {"encoder": 108_891_648, "projection": 2_362_368, "discriminator": 108_891_648, "rtd_head": 1_538}
    assert model.trainable_parameter_count() == 2 * 108_891_648 + 2_362_368 + 1_538 == 220_147_202


def test_checkpoint_round_trip(make_model, tokenizer, tmp_path):
    model = make_model().train()
    ids, mask, cor, lab = _views(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(ids, mask, cor, lab).loss.backward()
        opt.step()
    model.eval()
    folder = save_checkpoint(model, tmp_path / "ckpt", extra_meta={"step": 2})
    loaded = load_checkpoint(folder)
    assert isinstance(loaded, DiffCSE) and not loaded.training and loaded.config == model.config
    with torch.inference_mode():
        torch.testing.assert_close(
            loaded.embed(ids[:, 0], mask[:, 0]), model.embed(ids[:, 0], mask[:, 0]), rtol=0, atol=0
        )
    inference = {k: v for k, v in model.state_dict().items() if not k.startswith(("discriminator.", "rtd_head."))}
    for name, tensor in inference.items():  # encoder, BN-MLP and BatchNorm statistics travel
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    from safetensors.torch import load_file

    # the discriminator and RTD head are training-only: the checkpoint holds one encoder, not two
    assert set(load_file(str(folder / WEIGHTS_FILE))) == set(inference)


def test_discriminator_learning_rate_puts_the_rtd_side_in_a_group_of_its_own(tiny_bert_dir):
    """The evidence benchmark's proxy knob: D and the RTD head at their own rate; None (the default) keeps the paper's
    single group."""
    torch.manual_seed(0)
    plain = DiffCSE(DiffCSEConfig(backbone=str(tiny_bert_dir)))
    [group] = plain.parameter_groups("main")
    assert len(group["params"]) == sum(p.requires_grad for p in plain.parameters()) and "lr" not in group
    model = DiffCSE(DiffCSEConfig(backbone=str(tiny_bert_dir), discriminator_learning_rate=1e-4))
    shared, own = model.parameter_groups("main")
    rtd_side = {id(p) for p in (*model.discriminator.parameters(), *model.rtd_head.parameters())}
    assert own["lr"] == 1e-4 and own["name"] == "discriminator" and {id(p) for p in own["params"]} == rtd_side
    assert not rtd_side & {id(p) for p in shared["params"]} and "lr" not in shared
    assert {id(p) for p in model.encoder.parameters()} <= {id(p) for p in shared["params"]}
    with pytest.raises(ValueError, match="discriminator_learning_rate must be positive"):
        DiffCSEConfig(backbone=str(tiny_bert_dir), discriminator_learning_rate=0.0)
