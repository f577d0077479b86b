"""The DCPCSE model (models/methods/dcpcse.py): frozen PLM + prefixes + `cls` MLP, the MLM auxiliary (Jiang & Wang, 2022)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

from cse.config.methods import model_class
from cse.models.batching import TrainBatch
from cse.models.checkpoint import load_checkpoint, save_checkpoint
from cse.models.losses import contrastive_loss
from cse.models.methods.dcpcse import (
    DCPCSE,
    DCPCSEConfig,
    MaskedLMHead,
    mask_tokens,
    mlm_head_from_masked_lm,
    mlm_weight_at,
)
from tests.batches import tiny_bert_config

B, T, D, LAYERS, P = 4, 9, 32, 2, 3
SENTENCES = ["a man is playing a guitar .", "the cat sleeps", "two dogs run on the beach today", "it rains"]
PREFIX = {"encoder.prefix_encoder.embedding.weight"}
MLP = {"mlp.dense.weight", "mlp.dense.bias"}
LM_HEAD = {
    "lm_head.dense.weight",
    "lm_head.dense.bias",
    "lm_head.layer_norm.weight",
    "lm_head.layer_norm.bias",
    "lm_head.decoder.weight",
    "lm_head.decoder.bias",
}


@pytest.fixture(scope="module")
def tiny_mlm_dir(tmp_path_factory, tokenizer):
    """A random tiny BertForMaskedLM (with its `cls.predictions` head) saved with its tokenizer."""
    torch.manual_seed(1)
    d = tmp_path_factory.mktemp("tiny_bert_mlm")
    BertForMaskedLM(tiny_bert_config(len(tokenizer))).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture
def make_model(tiny_bert_dir, tiny_mlm_dir):
    def make(mlm: bool = False, **overrides) -> DCPCSE:
        torch.manual_seed(0)
        path = tiny_mlm_dir if mlm else tiny_bert_dir
        return DCPCSE(DCPCSEConfig(backbone=str(path), prefix_len=P, mlm=mlm, **overrides))

    return make


@pytest.fixture(scope="module")
def bert_base_mlm():
    """BERT-base with its MLM head, random weights (no download); `.bert` is the encoder (no pooler)."""
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig())


def _views(tokenizer, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(SENTENCES, padding="max_length", max_length=T, truncation=True, return_tensors="pt")
    return enc["input_ids"].unsqueeze(1).repeat(1, n, 1), enc["attention_mask"].unsqueeze(1).repeat(1, n, 1)


def _trainable(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _seeded_loss(model, ids, mask, seed: int = 123) -> float:
    """The loss under fixed dropout/masking samples, so two evaluations differ only by the weights."""
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(ids, mask).loss.item()


# ------------------------------------------------------------------------------------------------ config, counts
def test_registry_and_config_defaults():
    assert model_class("dcpcse") is DCPCSE and DCPCSE.config_class is DCPCSEConfig
    cfg = DCPCSEConfig(backbone="x")
    assert (cfg.prefix_len, cfg.prefix_dropout, cfg.prefix_projection, cfg.shift_positions) == (16, 0.1, False, True)
    assert (cfg.temperature, cfg.mlp_only_train, cfg.hard_negative_weight) == (0.05, True, 0.0)
    assert (cfg.mlm, cfg.mlm_probability, cfg.mlm_weight, cfg.mlm_decay, cfg.mlm_decay_steps) == (
        False,
        0.15,
        0.1,
        0.95,
        100,
    )
    assert cfg.mlm_head_random_init is False
    assert DCPCSEConfig.from_dict(cfg.to_dict()) == cfg
    for bad in (
        {"prefix_len": 0},
        {"temperature": 0.0},
        {"mlm_probability": 0.0},
        {"mlm_decay": 1.5},
        {"mlm_decay_steps": 0},
        {"prefix_dropout": 1.0},
    ):
        with pytest.raises(ValueError):
            DCPCSEConfig(backbone="x", **bad)


def test_trainable_set_and_tiny_counts(make_model):
    model = make_model()
    assert set(_trainable(model)) == PREFIX | MLP
    assert model.trainable_parameter_count() == P * 2 * LAYERS * D + (D * D + D)
    assert model.backbone.pooler is None
    assert all(not p.requires_grad for p in model.backbone.parameters())
    assert model.evaluation_pooler == "cls_before_pooler"
    assert make_model(mlp_only_train=False).evaluation_pooler == "cls"
    with_mlm = make_model(mlm=True)
    assert set(_trainable(with_mlm)) == PREFIX | MLP | LM_HEAD
    vocab = with_mlm.backbone.config.vocab_size
    head = (D * D + D) + 2 * D + (vocab * D + vocab)
    assert with_mlm.trainable_parameter_count() == P * 2 * LAYERS * D + (D * D + D) + head
    assert with_mlm.describe()["mlm"] is True and with_mlm.describe()["prefix_len"] == P


def test_bert_base_trainable_parameter_counts(bert_base_mlm):
    """YJiangcm/DCPCSE layout: prefix P·2·L·d = 16·2·12·768 = 294,912, `cls` MLP 768·768 + 768 = 590,592.

    With MLM the BERT LM head is trainable too (DCPCSE, docs/methods-overview.md): dense 768·768 + 768 = 590,592, LayerNorm 1,536,
    untied decoder 30522·768 = 23,440,896 and its bias 30,522 → 24,063,546.
    """
    backbone = bert_base_mlm.bert
    plain = DCPCSE(DCPCSEConfig(backbone="bert-base-uncased", prefix_len=16), backbone=backbone)
    assert sum(p.numel() for p in plain.prompts.parameters()) == 294_912 == 16 * 2 * 12 * 768
    assert sum(p.numel() for p in plain.mlp.parameters()) == 590_592
    assert plain.trainable_parameter_count() == 294_912 + 590_592

    head = mlm_head_from_masked_lm(bert_base_mlm)
    with_mlm = DCPCSE(
        DCPCSEConfig(backbone="bert-base-uncased", prefix_len=16, mlm=True), backbone=backbone, mlm_head=head
    )
    assert sum(p.numel() for p in with_mlm.lm_head.parameters()) == 590_592 + 1_536 + 23_440_896 + 30_522 == 24_063_546
    assert with_mlm.trainable_parameter_count() == 294_912 + 590_592 + 24_063_546
    # the decoder is a copy, not the frozen input embedding matrix it is tied to in BertForMaskedLM
    assert with_mlm.lm_head.decoder.weight.data_ptr() != backbone.embeddings.word_embeddings.weight.data_ptr()
    assert torch.equal(with_mlm.lm_head.decoder.weight, backbone.embeddings.word_embeddings.weight)
    assert not backbone.embeddings.word_embeddings.weight.requires_grad


def test_roberta_base_lm_head_count():
    """DCPCSE reference prefixes: RoBERTa-base LM head ≈ 39.2 M = 590,592 + 1,536 + 50265·768 (38,603,520) + 50,265."""
    cfg = RobertaConfig()
    with torch.device("meta"):  # shapes only: no 39 M random draws
        head = MaskedLMHead.fresh(cfg)
    assert (head.dense.in_features, head.decoder.out_features) == (768, 50_265)
    assert sum(p.numel() for p in head.parameters()) == 590_592 + 1_536 + 38_603_520 + 50_265 == 39_245_913


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_masked_lm_head_copy_computes_the_hf_head(family):
    torch.manual_seed(0)
    if family == "bert":
        mlm = BertForMaskedLM(tiny_bert_config(50))
        hf_head = mlm.cls.predictions
    else:
        mlm = RobertaForMaskedLM(
            RobertaConfig(
                vocab_size=50, hidden_size=D, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
            )
        )
        hf_head = mlm.lm_head
    with torch.no_grad():
        for p in hf_head.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # non-trivial biases / LayerNorm
    x = torch.randn(3, 5, D)
    head = mlm_head_from_masked_lm(mlm)
    with torch.no_grad():
        torch.testing.assert_close(head(x), hf_head(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ MLM head loading
def test_mlm_head_loaded_from_pretrained_checkpoint(make_model, tiny_mlm_dir):
    model = make_model(mlm=True)
    reference = BertForMaskedLM.from_pretrained(tiny_mlm_dir).cls.predictions
    torch.testing.assert_close(model.lm_head.dense.weight, reference.transform.dense.weight, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.layer_norm.bias, reference.transform.LayerNorm.bias, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.decoder.bias, reference.bias, rtol=0, atol=0)
    torch.testing.assert_close(
        model.lm_head.decoder.weight, model.backbone.embeddings.word_embeddings.weight, rtol=0, atol=0
    )
    assert model.lm_head.decoder.weight.data_ptr() != model.backbone.embeddings.word_embeddings.weight.data_ptr()


def test_checkpoint_without_mlm_head_is_refused_unless_random_init_allowed(tiny_bert_dir):
    cfg = DCPCSEConfig(backbone=str(tiny_bert_dir), prefix_len=P, mlm=True)
    with pytest.raises(ValueError, match="no MLM head weights"):
        DCPCSE(cfg)
    model = DCPCSE(DCPCSEConfig(backbone=str(tiny_bert_dir), prefix_len=P, mlm=True, mlm_head_random_init=True))
    assert isinstance(model.lm_head, MaskedLMHead)
    assert model.lm_head.decoder.out_features == model.backbone.config.vocab_size
    embeddings = model.backbone.embeddings.word_embeddings.weight
    torch.testing.assert_close(model.lm_head.decoder.weight, embeddings, rtol=0, atol=0)  # an untied copy
    assert model.lm_head.decoder.weight.data_ptr() != embeddings.data_ptr()
    assert not model.lm_head.decoder.bias.any()
    assert set(_trainable(model)) == PREFIX | MLP | LM_HEAD


# ------------------------------------------------------------------------------------------------ MLM schedule, masking
def test_mlm_weight_schedule():
    assert mlm_weight_at(0) == pytest.approx(0.1, abs=1e-12)
    assert mlm_weight_at(100) == pytest.approx(0.095, abs=1e-12)
    assert mlm_weight_at(200) == pytest.approx(0.1 * 0.95**2, abs=1e-12)
    assert mlm_weight_at(50) == pytest.approx(0.1 * math.sqrt(0.95), abs=1e-12)  # continuous exponent
    assert mlm_weight_at(1350) == pytest.approx(0.05, rel=2e-3)  # halves about every 1,350 steps
    with pytest.raises(ValueError):
        mlm_weight_at(-1)


def test_mlm_weight_is_logged_and_applied(make_model, tokenizer):
    model = make_model(mlm=True).train()
    ids, mask = _views(tokenizer)
    for step in (0, 100, 1350):
        torch.manual_seed(3)
        out = model.training_step(TrainBatch(ids, mask), step=step)
        assert set(out.metrics) == {"loss_contrastive", "loss_mlm", "mlm_weight"}
        weight = out.metrics["mlm_weight"].item()
        assert weight == pytest.approx(mlm_weight_at(step), rel=1e-6)
        expected = out.metrics["loss_contrastive"] + weight * out.metrics["loss_mlm"]
        assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert set(make_model().training_step(TrainBatch(ids, mask)).metrics) == {"loss_contrastive"}


def test_masking_excludes_special_and_pad_tokens_and_masks_15_percent(tokenizer):
    rows, length, vocab = 512, 40, tokenizer.vocab_size
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, length + 1, (rows,), generator=g)
    ids = torch.randint(1000, 30000, (rows, length), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids[mask == 0] = tokenizer.pad_token_id
    ids[:, 0] = tokenizer.cls_token_id
    ids[torch.arange(rows), lengths - 1] = tokenizer.sep_token_id
    specials = torch.tensor(tokenizer.all_special_ids)

    masked, labels = mask_tokens(ids, mask, specials, tokenizer.mask_token_id, vocab, 0.15, generator=g)
    selected = labels != -100
    candidates = (mask == 1) & ~torch.isin(ids, specials)
    assert not (selected & ~candidates).any()  # never [CLS], [SEP] or [PAD]
    assert torch.equal(labels[selected], ids[selected])
    assert torch.equal(masked[~selected], ids[~selected])  # nothing else is touched
    share = selected.sum().item() / candidates.sum().item()
    assert abs(share - 0.15) < 0.012
    n = selected.sum().item()
    to_mask = (masked == tokenizer.mask_token_id) & selected
    replaced = selected & ~to_mask & (masked != ids)
    assert abs(to_mask.sum().item() / n - 0.8) < 0.04
    assert abs(replaced.sum().item() / n - 0.1) < 0.03
    assert ((masked[replaced] >= 0) & (masked[replaced] < vocab)).all()
    assert (masked[replaced] < 1000).any()  # uniform over the whole vocabulary, not the sentence ids


def test_two_views_get_different_masks_and_specials_survive(make_model, tokenizer):
    model = make_model(mlm=True)
    ids, mask = _views(tokenizer)
    ids, mask = ids.repeat(8, 1, 1), mask.repeat(8, 1, 1)  # 32 sentences × 2 views
    flat_ids, flat_mask = ids.reshape(-1, T), mask.reshape(-1, T)
    masked, labels = model.mask_for_mlm(flat_ids, flat_mask, generator=torch.Generator().manual_seed(0))
    views = (labels != -100).view(-1, 2, T)
    assert not torch.equal(views[:, 0], views[:, 1])
    special = (flat_ids == tokenizer.cls_token_id) | (flat_ids == tokenizer.sep_token_id) | (flat_mask == 0)
    assert (labels[special] == -100).all() and torch.equal(masked[special], flat_ids[special])


def test_mlm_pass_reuses_the_prefix_sample_and_the_mask(make_model, tokenizer):
    model = make_model(mlm=True).train()
    ids, mask = _views(tokenizer)
    calls = []
    prefix_draws = []
    model.encoder.register_forward_pre_hook(lambda m, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    model.prompts.register_forward_hook(lambda m, args, out: prefix_draws.append(out))
    model(ids, mask)
    assert len(prefix_draws) == 1 and len(calls) == 2
    (cl_args, cl_kwargs), (mlm_args, mlm_kwargs) = calls
    assert cl_kwargs["prefix"] is prefix_draws[0] and mlm_kwargs["prefix"] is prefix_draws[0]
    assert torch.equal(cl_args[1], mlm_args[1])  # the same token mask
    assert not torch.equal(cl_args[0], mlm_args[0])  # the second pass sees masked ids


def test_mlm_loss_without_masked_positions_is_zero(make_model, tokenizer):
    model = make_model(mlm=True).train()
    ids, mask = _views(tokenizer)
    ids, mask = ids[:, 0], mask[:, 0]
    loss = model.mlm_loss(ids, mask, torch.full_like(ids, -100), model.prompts(B))
    assert loss.item() == 0.0
    loss.backward()


# ------------------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("mlm", [False, True])
def test_steps_decrease_loss_frozen_tensors_bit_identical(make_model, tokenizer, mlm):
    model = make_model(mlm=mlm).train()
    ids, mask = _views(tokenizer)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {n: p.detach().clone() for n, p in _trainable(model).items()}
    assert set(trainable) == PREFIX | MLP | (LM_HEAD if mlm else set())
    start = _seeded_loss(model, ids, mask)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # frozen ones included, as HF Trainer does
    for step in range(6):
        opt.zero_grad()
        model.training_step(TrainBatch(ids, mask), step=step).loss.backward()
        opt.step()
    assert _seeded_loss(model, ids, mask) < start - 0.1
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
        else:
            assert not torch.equal(p, trainable[n]), n


@pytest.mark.parametrize("mlm", [False, True])
def test_gradients_reach_only_trainable_tensors(make_model, tokenizer, mlm):
    model = make_model(mlm=mlm).train()
    ids, mask = _views(tokenizer)
    model(ids, mask).loss.backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n


def test_backbone_in_train_mode_makes_two_views_and_loss_is_contrastive(make_model, tokenizer):
    model = make_model().train()
    assert model.backbone.training and model.prompts.training
    ids, mask = _views(tokenizer)
    out = model(ids, mask)
    assert (out.z[:, 0] - out.z[:, 1]).abs().max() > 1e-4
    torch.testing.assert_close(out.loss, contrastive_loss(out.z[:, 0], out.z[:, 1], temperature=0.05), rtol=0, atol=0)
    assert out.mlm_loss is None


@pytest.mark.parametrize("mlm", [False, True])
def test_supervised_three_views(make_model, tokenizer, mlm):
    model = make_model(mlm=mlm, mlp_only_train=False).train()
    ids, mask = _views(tokenizer, n=3)
    out = model(ids, mask, step=10)
    assert out.z.shape == (B, 3, D) and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.prompts.embedding.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="input_ids"):
        model(ids[:, 0], mask[:, 0])


# ------------------------------------------------------------------------------------------------ evaluation
def test_embed_has_prompts_on_and_follows_the_pooler(make_model, tokenizer):
    ids, mask = _views(tokenizer)
    ids, mask = ids[:, 0], mask[:, 0]
    unsup, sup = make_model().eval(), make_model(mlp_only_train=False).eval()
    with torch.inference_mode():
        emb = unsup.embed(ids, mask)
        with_prompts = unsup.encoder(ids, mask, prefix=True).last_hidden_state[:, 0]
        without = unsup.encoder(ids, mask, prefix=False).last_hidden_state[:, 0]
        torch.testing.assert_close(emb, with_prompts, rtol=0, atol=0)
        torch.testing.assert_close(emb, unsup.embed(ids, mask), rtol=0, atol=0)  # dropout off
        assert (emb - without).abs().max() > 1e-4
        cls = sup.encoder(ids, mask, prefix=True).last_hidden_state[:, 0]
        torch.testing.assert_close(sup.embed(ids, mask), sup.mlp(cls), rtol=0, atol=0)
    assert emb.shape == (B, D)


def test_checkpoint_round_trip_gives_identical_embeddings(make_model, tokenizer, tmp_path):
    model = make_model(mlm=True, mlp_only_train=False).train()
    ids, mask = _views(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(ids, mask).loss.backward()
    opt.step()
    model.eval()
    folder = save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_checkpoint(folder)
    assert isinstance(loaded, DCPCSE) and not loaded.training and loaded.config == model.config
    with torch.inference_mode():
        torch.testing.assert_close(
            loaded.embed(ids[:, 0], mask[:, 0]), model.embed(ids[:, 0], mask[:, 0]), rtol=0, atol=0
        )
    for name, tensor in model.lm_head.state_dict().items():
        torch.testing.assert_close(loaded.lm_head.state_dict()[name], tensor, rtol=0, atol=0)


def test_mlm_loss_is_the_mean_cross_entropy_over_the_masked_positions(make_model, tokenizer):
    """The MLM term as sum / count (what grad_cache's chunks add up) equals the cross-entropy mean it replaced."""
    model = make_model(mlm=True).train()
    ids, mask = _views(tokenizer)
    ids, mask = ids.reshape(-1, T), mask.reshape(-1, T)
    masked, labels = model.mask_for_mlm(ids, mask, generator=torch.Generator().manual_seed(0))
    prefix = model.prompts(ids.shape[0])
    torch.manual_seed(1)
    loss = model.mlm_loss(masked, mask, labels, prefix)
    torch.manual_seed(1)
    states = model.encoder(masked, mask, prefix=prefix).last_hidden_state
    selected = labels != -100
    logits = model.lm_head(states[selected].unsqueeze(0)).squeeze(0)
    mean = torch.nn.functional.cross_entropy(logits.float(), labels[selected])
    assert selected.any()
    torch.testing.assert_close(loss, mean, rtol=1e-6, atol=1e-7)
