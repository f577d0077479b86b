"""The D2CSE model (models/methods/d2cse.py): trainable set, frozen backbone, conditioning, ablation wiring (Lee, 2023)."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel

from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig
from tests.batches import corrupted_views
from tests.tolerance import assert_close_scaled

B, T = 4, 9


@pytest.fixture
def make_model(tiny_bert_dir):
    def make(**overrides) -> D2CSE:
        torch.manual_seed(0)
        return D2CSE(D2CSEModelConfig(backbone=str(tiny_bert_dir), prefix_len=3, **overrides))

    return make


def _views(tokenizer, n: int = 2, seed: int = 0):
    return corrupted_views(tokenizer, n=n, seed=seed, length=T)


def _trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def test_trainable_set_and_counts(make_model):
    model = make_model()
    names = set(_trainable(model))
    assert names == {
        "encoder.prefix_encoder.embedding.weight",
        "projection.net.0.weight",
        "projection.net.1.weight",
        "projection.net.1.bias",
        "projection.net.3.weight",
        "rtd_head.classifier.weight",
        "rtd_head.classifier.bias",
    }
    d, layers = 32, 2
    want = 3 * 2 * layers * d + (d * 2 * d + 2 * 2 * d + 2 * d * d) + (2 * d + 2)
    assert sum(p.numel() for p in _trainable(model).values()) == want
    assert model.encoder.backbone.pooler is None
    assert all(not p.requires_grad for p in model.encoder.backbone.parameters())
    assert model.tokenizer is not None and model.tokenizer.cls_token_id == 101


def test_bert_base_trainable_parameter_count():
    torch.manual_seed(0)
    backbone = BertModel(BertConfig())  # 12 layers, 768, vocab 30522; random weights
    plain = D2CSE(D2CSEModelConfig(backbone="bert-base-uncased", prefix_len=16), backbone=backbone)
    parts = {"prefix": plain.prompts, "bn_mlp": plain.projection, "rtd": plain.rtd_head}
    counts = {k: sum(p.numel() for p in m.parameters() if p.requires_grad) for k, m in parts.items()}
    assert counts == {"prefix": 294_912, "bn_mlp": 2_362_368, "rtd": 1_538}
    assert sum(p.numel() for p in plain.parameters() if p.requires_grad) == 2_658_818
    with_cls = D2CSE(
        D2CSEModelConfig(backbone="bert-base-uncased", prefix_len=16, cls_prompt=True),
        backbone=backbone,
        cls_token_id=101,
    )
    assert sum(p.numel() for p in with_cls.parameters() if p.requires_grad) == 2_659_586


def test_gradients_reach_only_trainable_tensors(make_model, tokenizer):
    model = make_model(cls_prompt=True).train()
    ids, mask, cor, lab = _views(tokenizer)
    out = model(ids, mask, cor, lab)
    out.loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    assert out.loss.item() == pytest.approx(out.contrastive_loss.item() + 0.005 * out.rtd_loss.item(), rel=1e-6)
    assert 0.0 <= out.rtd_accuracy.item() <= 1.0


def test_frozen_weights_bit_identical_after_optimizer_steps(make_model, tokenizer):
    model = make_model(cls_prompt=True).train()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {n: p.detach().clone() for n, p in _trainable(model).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # frozen ones included, as HF Trainer does
    ids, mask, cor, lab = _views(tokenizer)
    for _ in range(3):
        opt.zero_grad()
        model(ids, mask, cor, lab).loss.backward()
        opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
        else:
            assert not torch.equal(p, trainable[n]), n


def test_backbone_stays_in_train_mode_so_dropout_makes_two_views(make_model, tokenizer):
    model = make_model().train()
    assert model.encoder.backbone.training and model.prompts.training
    ids, mask, cor, lab = _views(tokenizer)
    out = model(ids, mask, cor, lab)
    assert (out.h[:, 0] - out.h[:, 1]).abs().max() > 1e-4
    flat_ids, flat_mask = ids[:, 0], mask[:, 0]
    a, b = model.encode_cls(flat_ids, flat_mask), model.encode_cls(flat_ids, flat_mask)
    assert (a - b).abs().max() > 1e-4
    model.eval()
    with torch.inference_mode():
        torch.testing.assert_close(model.embed(flat_ids, flat_mask), model.embed(flat_ids, flat_mask), rtol=0, atol=0)


def test_embed_is_cls_before_pooler_with_prompts(make_model, tokenizer):
    model = make_model().eval()
    ids, mask, _, _ = _views(tokenizer)
    with torch.inference_mode():
        emb = model.embed(ids[:, 0], mask[:, 0])
        with_prompts = model.encoder(ids[:, 0], mask[:, 0], prefix=True).last_hidden_state[:, 0]
        without = model.encoder(ids[:, 0], mask[:, 0], prefix=False).last_hidden_state[:, 0]
    assert emb.shape == (B, 32)
    torch.testing.assert_close(emb, with_prompts, rtol=0, atol=0)
    assert (emb - without).abs().max() > 1e-4


def test_discriminator_is_conditioned_on_h_and_h_gets_rtd_gradient(make_model, tokenizer):
    model = make_model().eval()  # deterministic passes
    ids, mask, cor, lab = _views(tokenizer)
    cor, mask, lab = cor[:, 0], mask[:, 0], lab[:, 0]
    h = torch.randn(B, 32, requires_grad=True)
    logits = model.discriminate(cor, mask, h)
    other = model.discriminate(cor, mask, h.detach() + 1.0)
    assert (logits - other).abs().max() > 1e-4
    torch.nn.functional.cross_entropy(logits.reshape(-1, 2), lab.reshape(-1)).backward()
    assert h.grad is not None and h.grad.abs().sum() > 0


def test_rtd_loss_reaches_projection_through_h(make_model, tokenizer):
    model = make_model().train()
    ids, mask, cor, lab = _views(tokenizer)
    out = model(ids, mask, cor, lab)
    (grad_rtd,) = torch.autograd.grad(out.rtd_loss, model.projection.net[0].weight, retain_graph=True)
    assert grad_rtd.abs().sum() > 0
    no_cond = make_model(condition_discriminator=False).train()
    out = no_cond(ids, mask, cor, lab)
    (grad_rtd,) = torch.autograd.grad(out.rtd_loss, no_cond.projection.net[0].weight, allow_unused=True)
    assert grad_rtd is None  # ablation (c): the discriminator does not see h


def test_cls_prompt_initialised_from_cls_row_and_trainable(make_model, tokenizer):
    model = make_model(cls_prompt=True)
    row = model.encoder.backbone.embeddings.word_embeddings.weight[tokenizer.cls_token_id]
    assert model.cls_prompt.requires_grad
    torch.testing.assert_close(model.cls_prompt.detach(), row, rtol=0, atol=0)
    ids, mask, _, _ = _views(tokenizer)
    model.eval()
    with torch.no_grad():  # initialised at the [CLS] row, it encodes exactly as the plain [CLS] input
        same = model.embed(ids[:, 0], mask[:, 0])
        plain = model.encoder(ids[:, 0], mask[:, 0], prefix=True).last_hidden_state[:, 0]
        assert_close_scaled(same, plain, rtol=0)
        model.cls_prompt.add_(torch.randn(32))  # (a constant shift would vanish in LayerNorm)
        assert (model.embed(ids[:, 0], mask[:, 0]) - plain).abs().max() > 1e-4
    assert not model.encoder.backbone.embeddings.word_embeddings.weight.requires_grad


def test_shared_corruption_equals_explicitly_repeated_one(make_model, tokenizer):
    model = make_model().train()
    ids, mask, cor, lab = _views(tokenizer)
    torch.manual_seed(5)
    shared = model(ids, mask, cor[:, :1], lab[:, :1])
    torch.manual_seed(5)
    repeated = model(ids, mask, cor[:, :1].repeat(1, 2, 1), lab[:, :1].repeat(1, 2, 1))
    torch.testing.assert_close(shared.loss, repeated.loss, rtol=0, atol=0)
    torch.manual_seed(5)
    derived = model(ids, mask, cor[:, :1])  # labels default to corrupted != original on real tokens
    torch.testing.assert_close(derived.rtd_loss, shared.rtd_loss, rtol=0, atol=0)


def test_supervised_three_views(make_model, tokenizer):
    model = make_model(cls_prompt=True).train()
    ids, mask, cor, lab = _views(tokenizer, n=3)
    out = model(ids, mask, cor, lab)
    assert out.h.shape == (B, 3, 32)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.rtd_head.classifier.weight.grad.abs().sum() > 0


def test_input_shapes_are_checked(make_model, tokenizer):
    model = make_model()
    ids, mask, cor, lab = _views(tokenizer)
    with pytest.raises(ValueError, match="input_ids"):
        model(ids[:, 0], mask[:, 0], cor[:, 0])
    with pytest.raises(ValueError, match="corrupted_ids"):
        model(ids, mask, cor[:, :, :-1])


def test_ablation_a_discriminator_without_prompts(make_model, tokenizer):
    model = make_model(discriminator_prompts=False).eval()
    _, mask, cor, _ = _views(tokenizer)
    h = torch.randn(B, 32)
    before = model.discriminate(cor[:, 0], mask[:, 0], h)
    with torch.no_grad():
        model.prompts.embedding.weight.add_(1.0)
    torch.testing.assert_close(model.discriminate(cor[:, 0], mask[:, 0], h), before, rtol=0, atol=0)
    shared = make_model().eval()
    after_shared = shared.discriminate(cor[:, 0], mask[:, 0], h)
    with torch.no_grad():
        shared.prompts.embedding.weight.add_(1.0)
    assert (shared.discriminate(cor[:, 0], mask[:, 0], h) - after_shared).abs().max() > 1e-4


def test_ablation_b_trained_discriminator_copy(make_model, tokenizer):
    model = make_model(discriminator_prompts=False, train_discriminator=True).train()
    enc_params = {id(p) for p in model.encoder.backbone.parameters()}
    disc_params = list(model.discriminator.backbone.parameters())
    assert all(p.requires_grad and id(p) not in enc_params for p in disc_params)
    ids, mask, cor, lab = _views(tokenizer)
    model(ids, mask, cor, lab).loss.backward()
    assert model.discriminator.backbone.encoder.layer[0].attention.self.query.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.encoder.backbone.parameters())


def test_reused_prefix_sample_option(make_model, tokenizer):
    with pytest.raises(ValueError, match="discriminator_prompts"):
        D2CSEModelConfig(backbone="x", discriminator_prompts=False, discriminator_reuses_prefix_sample=True)
    model = make_model(discriminator_reuses_prefix_sample=True).train()
    calls = []
    model.prompts.register_forward_hook(lambda m, args, out: calls.append(args))
    ids, mask, cor, lab = _views(tokenizer)
    model(ids, mask, cor, lab)
    assert len(calls) == 1
    fresh = make_model().train()
    fresh.prompts.register_forward_hook(lambda m, args, out: calls.append(args))
    fresh(ids, mask, cor, lab)
    assert len(calls) == 3


def test_config_round_trip():
    cfg = D2CSEModelConfig(backbone="roberta-base", prefix_len=12, cls_prompt=True)
    assert D2CSEModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown"):
        D2CSEModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_roberta_backbone_with_cls_prompt():
    from transformers import RobertaConfig, RobertaModel

    torch.manual_seed(0)
    cfg = RobertaConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        type_vocab_size=1,
    )
    backbone = RobertaModel(cfg)
    model = D2CSE(
        D2CSEModelConfig(backbone="tiny-roberta", prefix_len=3, cls_prompt=True), backbone=backbone, cls_token_id=0
    ).train()
    torch.testing.assert_close(model.cls_prompt.detach(), backbone.embeddings.word_embeddings.weight[0], rtol=0, atol=0)
    ids = torch.randint(5, 120, (B, 2, T))
    ids[:, :, 0] = 0
    mask = torch.ones_like(ids)
    mask[1, :, 5:] = 0
    ids = ids.masked_fill(mask == 0, 1)
    out = model(ids, mask, ids.roll(1, dims=-1)[:, :1])
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.cls_prompt.grad.abs().sum() > 0
    model.eval()
    with torch.inference_mode():
        assert model.embed(ids[:, 0], mask[:, 0]).shape == (B, 32)


def test_is_a_sentence_embedder(make_model, tokenizer):
    from cse.models.embedder import SentenceEmbedder

    model = make_model()
    assert isinstance(model, SentenceEmbedder)
    assert model.token_ids(["a cat"]) == [tokenizer("a cat")["input_ids"]]
    assert model.describe()["pooler"] == "cls_before_pooler"
    assert model.pad_token_id == 0 and model.device == torch.device("cpu")


def test_head_learning_rate_puts_the_bn_mlp_and_rtd_head_in_a_group_of_their_own(make_model):
    default = make_model().parameter_groups("main")
    assert len(default) == 1 and "lr" not in default[0]  # the paper's single learning rate
    model = make_model(head_learning_rate=1e-3)
    rest, head = model.parameter_groups("main")
    head_ids = {id(p) for p in [*model.projection.parameters(), *model.rtd_head.parameters()]}
    assert (head["name"], head["lr"]) == ("head", 1e-3) and {id(p) for p in head["params"]} == head_ids
    assert {id(p) for p in rest["params"]} == {id(model.encoder.prefix_encoder.embedding.weight)}
    both = make_model(head_learning_rate=1e-3, discriminator_prompts=False, train_discriminator=True)
    names = [g.get("name") for g in both.parameter_groups("main")]
    assert names == [None, "head", "discriminator"]
    with pytest.raises(ValueError, match="head_learning_rate"):
        make_model(head_learning_rate=0.0)
