"""Deep prompts (models/prompts/) and the four methods on every supported encoder family, tiny random configs.

Each family gets: the plain pass equals the plain HF model; a prefix whose mask hides every slot gives the plain
model's outputs and gradients exactly (prefix gradients exactly zero); one layer's output and its prefix gradients
match attention over [prefix K/V; token K/V] written out by hand here (with the family's own position terms); the
`shift_positions` meaning of the family; position-0 conditioning and the [CLS] prompt; and one training step of
D2CSE, DCPCSE, SimCSE and DiffCSE (the README's "Encoder families" table names these tests).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import (
    BertConfig,
    BertModel,
    CamembertConfig,
    CamembertModel,
    DebertaConfig,
    DebertaModel,
    DebertaV2Config,
    DebertaV2Model,
    DistilBertConfig,
    DistilBertModel,
    ElectraConfig,
    ElectraModel,
    ModernBertConfig,
    ModernBertModel,
    MPNetConfig,
    MPNetModel,
    RobertaConfig,
    RobertaModel,
    XLMRobertaConfig,
    XLMRobertaModel,
)

from cse.models.batching import TrainBatch
from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig
from cse.models.methods.dcpcse import DCPCSE, DCPCSEConfig
from cse.models.methods.diffcse import DiffCSE, DiffCSEConfig
from cse.models.methods.simcse import SimCSE, SimCSEConfig
from cse.models.prompts.backbone import PromptedBackbone
from cse.models.prompts.families import encoder_family
from cse.models.prompts.prefixes import PrefixEncoder, PrefixKeyValues
from tests.tolerance import assert_close_scaled

P, D, H, V, T = 3, 32, 4, 100, 8
DH = D // H
CLS_ID = 2
SHAPE = dict(vocab_size=V, hidden_size=D, num_attention_heads=H, intermediate_size=64, max_position_embeddings=40)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread (several threads spin on a busy 2-core machine, ~10x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _bert(attn):
    return BertModel(BertConfig(num_hidden_layers=2, attn_implementation=attn, **SHAPE), add_pooling_layer=False)


def _roberta_like(model_class, config_class):
    def build(attn):
        config = config_class(num_hidden_layers=2, pad_token_id=1, type_vocab_size=1, attn_implementation=attn, **SHAPE)
        return model_class(config, add_pooling_layer=False)

    return build


def _electra(attn):  # embedding_size < hidden_size: the embeddings go through ELECTRA's projection
    return ElectraModel(ElectraConfig(num_hidden_layers=2, embedding_size=16, attn_implementation=attn, **SHAPE))


def _distilbert(attn):
    return DistilBertModel(
        DistilBertConfig(
            vocab_size=V,
            dim=D,
            n_layers=2,
            n_heads=H,
            hidden_dim=64,
            max_position_embeddings=40,
            attn_implementation=attn,
        )
    )


def _mpnet(attn):
    return MPNetModel(MPNetConfig(num_hidden_layers=2, **SHAPE), add_pooling_layer=False)


# the v3 layout: relative attention only, shared position keys, log buckets, no absolute positions
def _deberta_v3(attn):
    return DebertaV2Model(
        DebertaV2Config(
            num_hidden_layers=2,
            pad_token_id=0,
            relative_attention=True,
            position_biased_input=False,
            pos_att_type=["p2c", "c2p"],
            share_att_key=True,
            position_buckets=8,
            max_relative_positions=16,
            norm_rel_ebd="layer_norm",
            **SHAPE,
        )
    )


def _deberta_v2(attn):  # the v2 layout options: absolute positions too, own position projections, the conv layer
    return DebertaV2Model(
        DebertaV2Config(
            num_hidden_layers=2,
            pad_token_id=0,
            relative_attention=True,
            position_biased_input=True,
            pos_att_type=["p2c", "c2p"],
            share_att_key=False,
            max_relative_positions=16,
            conv_kernel_size=3,
            type_vocab_size=2,
            **SHAPE,
        )
    )


def _modernbert(attn):  # layers: global, sliding-window (half-window 2), global
    return ModernBertModel(
        ModernBertConfig(
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=3,
            num_attention_heads=H,
            intermediate_size=64,
            max_position_embeddings=40,
            global_attn_every_n_layers=2,
            local_attention=4,
            pad_token_id=0,
            bos_token_id=CLS_ID,
            eos_token_id=3,
            cls_token_id=CLS_ID,
            sep_token_id=3,
            attn_implementation=attn,
        )
    )


BUILDERS = {
    "bert": _bert,
    "roberta": _roberta_like(RobertaModel, RobertaConfig),
    "xlm-roberta": _roberta_like(XLMRobertaModel, XLMRobertaConfig),
    "electra": _electra,
    "distilbert": _distilbert,
    "mpnet": _mpnet,
    "deberta-v3": _deberta_v3,
    "deberta-v2": _deberta_v2,
    "modernbert": _modernbert,
}
FAMILIES = list(BUILDERS)
PAD = {"roberta": 1, "xlm-roberta": 1, "mpnet": 1}
# (family, attention implementation): the families on transformers' AttentionInterface run both sdpa and eager
VARIANTS = [
    (f, a) for f in FAMILIES for a in (("sdpa", "eager") if f in ("bert", "distilbert", "modernbert") else (None,))
]
VARIANT_IDS = [f if a is None else f"{f}-{a}" for f, a in VARIANTS]


def build(family: str, attn: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return BUILDERS[family](attn or "sdpa").eval()


def batch(family: str, rows: int = 3, length: int = T, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` rows of `length` ids starting with the CLS id: one full, the others right-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    for r in range(1, rows):
        mask[r, max(2, length - 2 * r - 1) :] = 0
    ids = ids.masked_fill(mask == 0, PAD.get(family, 0))
    ids[:, 0] = CLS_ID
    return ids, mask


def wrap(model, shift: bool = False) -> tuple[torch.nn.Module, PromptedBackbone]:
    plain = copy.deepcopy(model)
    torch.manual_seed(2)
    layers = model.config.num_hidden_layers
    return plain, PromptedBackbone(model, PrefixEncoder(P, layers, D, H, dropout=0.0), shift_positions=shift).eval()


def expected_positions(family: str, ids: torch.Tensor, offset: int) -> torch.Tensor:
    """The family's position numbering after `offset` prefix slots, written out independently of cse.models.prompts."""
    if family in PAD:  # padding-aware: pads keep padding_idx, real tokens count on from padding_idx + 1 + offset
        pad = PAD[family]
        real = ids.ne(pad).long()
        return (torch.cumsum(real, 1) + offset) * real + pad
    return torch.arange(offset, offset + ids.shape[1]).expand(ids.shape[0], -1)


# ------------------------------------------------------------------------------------------------ plain and hidden


@pytest.mark.parametrize("family,attn", VARIANTS, ids=VARIANT_IDS)
def test_plain_pass_is_the_plain_model_and_a_visible_prefix_changes_the_output(family, attn):
    plain, wrapped = wrap(build(family, attn))
    ids, mask = batch(family)
    ref = plain(input_ids=ids, attention_mask=mask).last_hidden_state
    prompted = wrapped(ids, mask, prefix=True).last_hidden_state  # first: nothing of it may stay behind
    assert_close_scaled(wrapped(ids, mask, prefix=False).last_hidden_state, ref, rtol=0)
    assert (prompted - ref)[mask.bool()].abs().max() > 1e-3


@pytest.mark.parametrize("family,attn", VARIANTS, ids=VARIANT_IDS)
def test_hidden_prefix_gives_the_plain_model_outputs_and_gradients(family, attn):
    plain, wrapped = wrap(build(family, attn))
    ids, mask = batch(family)
    weights = torch.randn(3, T, D, generator=torch.Generator().manual_seed(3))

    ref = plain(input_ids=ids, attention_mask=mask).last_hidden_state
    (ref * weights).sum().backward()
    hidden = wrapped.prefix_encoder(3).with_mask(torch.zeros(P))
    out = wrapped(ids, mask, prefix=hidden).last_hidden_state
    (out * weights).sum().backward()

    assert_close_scaled(out, ref, rtol=0)
    assert torch.count_nonzero(wrapped.prefix_encoder.embedding.weight.grad) == 0
    ours = dict(wrapped.backbone.named_parameters())
    # one scale for every tensor: a key bias's gradient is a cancellation (0 in exact arithmetic) of terms that size
    scale = max(float(p.grad.abs().max()) for p in plain.parameters() if p.grad is not None)
    compared = 0
    for name, p in plain.named_parameters():
        if p.grad is not None:
            assert_close_scaled(ours[name].grad, p.grad, terms=3 * T, scale=scale, msg=name)
            compared += 1
    assert compared > 10


# ------------------------------------------------------------------------------------------------ hand references


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x.view(x.shape[0], x.shape[1], H, DH).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], D)


def _softmax_attend(scores, visible, v):
    return _merge(scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v)


def _rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE of `(B, H, T, Dh)` at `positions`, the rotate-half convention, written out here."""
    freqs = positions.float()[:, None] * (1.0 / theta ** (torch.arange(0, DH, 2).float() / DH))[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    rotated = torch.cat([-x[..., DH // 2 :], x[..., : DH // 2]], -1)
    return x * cos + rotated * sin


def manual_attention(family, backbone, attn, x, kp, vp, token_mask, slot_visible, offset):
    """Layer-1 self-attention output over [prefix K/V; token K/V] (what the hooked module returns)."""
    b, t, _ = x.shape
    keys = torch.cat(
        [slot_visible[:, None, None, :].expand(b, 1, t, P), token_mask.bool()[:, None, None, :].expand(b, 1, t, t)], -1
    )
    if family in ("bert", "roberta", "xlm-roberta", "electra", "distilbert"):
        q_, k_, v_ = (
            (attn.query, attn.key, attn.value) if family != "distilbert" else (attn.q_lin, attn.k_lin, attn.v_lin)
        )
        q, k, v = _heads(q_(x)), torch.cat([kp, _heads(k_(x))], 2), torch.cat([vp, _heads(v_(x))], 2)
        out = _softmax_attend(q @ k.transpose(-1, -2) / math.sqrt(DH), keys, v)
        return attn.out_lin(out) if family == "distilbert" else out
    if family == "mpnet":  # relative position bias (the encoder's own buckets) on token keys, 0 on prefix slots
        q, k, v = _heads(attn.q(x)), torch.cat([kp, _heads(attn.k(x))], 2), torch.cat([vp, _heads(attn.v(x))], 2)
        bias = backbone.encoder.compute_position_bias(x)
        bias = torch.cat([torch.zeros(b, H, t, P), bias], -1)
        return attn.o(_softmax_attend(q @ k.transpose(-1, -2) / math.sqrt(DH) + bias, keys, v))
    if family.startswith("deberta"):  # token keys: c2c + c2p + p2c; prefix slots: c2c only; scale sqrt(Dh · 3)
        q3 = attn.transpose_for_scores(attn.query_proj(x), H)
        k3 = attn.transpose_for_scores(attn.key_proj(x), H)
        scale = math.sqrt(DH * 3)
        rel = attn.disentangled_attention_bias(
            q3, k3, backbone.encoder.get_rel_pos(x), backbone.encoder.get_rel_embedding(), 3
        )
        token_scores = (q3 @ k3.transpose(-1, -2) / scale + rel).view(b, H, t, t)
        q = _heads(attn.query_proj(x))
        scores = torch.cat([q @ kp.transpose(-1, -2) / scale, token_scores], -1)
        padded_rows = ~token_mask.bool()[:, None, :, None]  # DeBERTa's own rule for them; not compared, kept finite
        return _softmax_attend(scores, keys | padded_rows, torch.cat([vp, _heads(attn.value_proj(x))], 2))
    if family == "modernbert":  # layer 1 is a sliding-window layer: |i - j| <= 2 among tokens, prefix always visible
        assert backbone.config.layer_types[1] == "sliding_attention"
        q, k, v = (_heads(y) for y in attn.Wqkv(x).view(b, t, 3, D).unbind(2))
        theta = backbone.config.rope_parameters["sliding_attention"]["rope_theta"]
        positions = torch.arange(offset, offset + t)
        q, k = _rotary(q, positions, theta), _rotary(k, positions, theta)
        near = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).abs() <= backbone.config.sliding_window
        keys = torch.cat([keys[..., :P], keys[..., P:] & near], -1)
        out = _softmax_attend(q @ torch.cat([kp, k], 2).transpose(-1, -2) / math.sqrt(DH), keys, torch.cat([vp, v], 2))
        return attn.Wo(out)
    raise AssertionError(family)


@pytest.mark.parametrize("family,attn", VARIANTS, ids=VARIANT_IDS)
def test_one_layer_matches_hand_computed_attention_and_prefix_gradients(family, attn):
    """Layer 1, prefix slot 1 hidden from row 0, positions shifted: output and d(out·w)/d(k_p, v_p) by hand."""
    _, wrapped = wrap(build(family, attn), shift=True)
    ids, mask = batch(family)
    layers = wrapped.backbone.config.num_hidden_layers
    g = torch.Generator().manual_seed(4)
    kv = tuple(
        (torch.randn(3, H, P, DH, generator=g).requires_grad_(), torch.randn(3, H, P, DH, generator=g).requires_grad_())
        for _ in range(layers)
    )
    slots = torch.ones(3, P, dtype=torch.bool)
    slots[0, 1] = False
    module = wrapped.attention_modules()[1]
    seen = {}

    def hook(m, args, kwargs, out):
        seen["x"] = args[0] if args else kwargs["hidden_states"]
        seen["out"] = out[0]

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        wrapped(ids, mask, prefix=PrefixKeyValues(kv, slots.long()))
    finally:
        handle.remove()
    kp, vp = kv[1]
    ref = manual_attention(
        family, wrapped.backbone, module, seen["x"].detach(), kp, vp, mask, slots, P if family == "modernbert" else 0
    )
    real = mask.bool()  # padded rows: only DeBERTa's are defined by hand (its own rule); compare the real tokens
    assert_close_scaled(seen["out"][real], ref[real], rtol=0)
    weights = torch.randn(ref.shape, generator=g) * real[..., None]
    ours = torch.autograd.grad((seen["out"] * weights).sum(), (kp, vp))
    theirs = torch.autograd.grad((ref * weights).sum(), (kp, vp))
    for a, b in zip(ours, theirs):
        assert a.abs().sum() > 0
        assert_close_scaled(a, b, terms=3 * T, rtol=1e-5)
    assert torch.count_nonzero(ours[0][0, :, 1]) == 0 and torch.count_nonzero(ours[1][0, :, 1]) == 0  # the hidden slot


# ------------------------------------------------------------------------------------------------ positions


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("deberta-v3", "modernbert")])
def test_shift_moves_absolute_positions_by_p(family):
    plain, wrapped = wrap(build(family), shift=True)
    ids, mask = batch(family)
    hidden = wrapped.prefix_encoder(3).with_mask(torch.zeros(P))
    ref = plain(input_ids=ids, attention_mask=mask, position_ids=expected_positions(family, ids, P)).last_hidden_state
    assert_close_scaled(wrapped(ids, mask, prefix=hidden).last_hidden_state, ref, rtol=0)
    unshifted = plain(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (ref - unshifted).abs().max() > 1e-3  # the shift is real


def test_deberta_v3_has_no_position_to_shift():
    _, shifted = wrap(build("deberta-v3"), shift=True)
    unshifted = PromptedBackbone(shifted.backbone, shifted.prefix_encoder, shift_positions=False).eval()
    ids, mask = batch("deberta-v3")
    kv = shifted.prefix_encoder(3)
    assert shifted.position_kind == "none"
    torch.testing.assert_close(
        shifted(ids, mask, prefix=kv).last_hidden_state,
        unshifted(ids, mask, prefix=kv).last_hidden_state,
        rtol=0,
        atol=0,
    )


def test_modernbert_shift_moves_rotary_positions_of_the_tokens():
    plain, shifted = wrap(build("modernbert"), shift=True)
    unshifted = PromptedBackbone(shifted.backbone, shifted.prefix_encoder, shift_positions=False).eval()
    ids, mask = batch("modernbert")
    g = torch.Generator().manual_seed(8)
    kv = PrefixKeyValues(
        tuple((torch.randn(3, H, P, DH, generator=g), torch.randn(3, H, P, DH, generator=g)) for _ in range(3))
    )
    hidden = kv.with_mask(torch.zeros(P))
    at_p = plain(input_ids=ids, attention_mask=mask, position_ids=torch.arange(P, P + T)[None]).last_hidden_state
    assert_close_scaled(shifted(ids, mask, prefix=hidden).last_hidden_state, at_p, rtol=0)
    # token↔token attention is rotation-invariant; only what the (unrotated) prefix keys contribute moves
    assert_close_scaled(at_p, plain(input_ids=ids, attention_mask=mask).last_hidden_state, rtol=0)
    moved = shifted(ids, mask, prefix=kv).last_hidden_state - unshifted(ids, mask, prefix=kv).last_hidden_state
    assert moved[mask.bool()].abs().max() > 1e-3  # numerical noise is ~1e-6


# ------------------------------------------------------------------------------------------------ conditioning


@pytest.mark.parametrize("family", FAMILIES)
def test_position0_output_and_cls_embedding(family):
    _, wrapped = wrap(build(family))
    ids, mask = batch(family)
    first = wrapped.attention_modules()[0]
    seen = []
    handle = first.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True
    )
    vec = torch.randn(3, D)
    try:
        base = wrapped(ids, mask, prefix=True).last_hidden_state
        wrapped(ids, mask, prefix=True, position0_output=vec)
    finally:
        handle.remove()
    plain_in, cond_in = seen
    if family == "modernbert":  # layer 0's attention norm is the identity: its input is the embedding output
        assert isinstance(wrapped.backbone.layers[0].attn_norm, torch.nn.Identity)
    torch.testing.assert_close(cond_in[:, 0], vec, rtol=0, atol=0)
    torch.testing.assert_close(cond_in[:, 1:], plain_in[:, 1:], rtol=0, atol=0)
    own_row = wrapped.backbone.get_input_embeddings().weight[CLS_ID]
    torch.testing.assert_close(
        wrapped(ids, mask, prefix=True, cls_embedding=own_row).last_hidden_state, base, rtol=0, atol=1e-6
    )
    other = wrapped(ids, mask, prefix=True, cls_embedding=torch.randn(own_row.shape)).last_hidden_state
    assert (other - base).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------ the four methods


def _train_batch(family: str, n: int = 2) -> TrainBatch:
    ids, mask = batch(family, rows=4, seed=5)
    ids, mask = ids[:, None].repeat(1, n, 1), mask[:, None].repeat(1, n, 1)
    g = torch.Generator().manual_seed(6)
    pick = (mask == 1) & (torch.rand(ids.shape, generator=g) < 0.4)
    pick[..., 0] = False
    corrupted = torch.where(pick, torch.randint(5, V, ids.shape, generator=g), ids)
    return TrainBatch(ids, mask, corrupted, ((corrupted != ids) & mask.bool()).long())


def _build_method(method: str, backbone):
    torch.manual_seed(0)
    if method == "d2cse":
        return D2CSE(
            D2CSEModelConfig(backbone="tiny", prefix_len=P, cls_prompt=True), backbone=backbone, cls_token_id=CLS_ID
        )
    if method == "dcpcse":
        return DCPCSE(DCPCSEConfig(backbone="tiny", prefix_len=P), backbone=backbone)
    if method == "simcse":
        return SimCSE(SimCSEConfig(backbone="tiny"), backbone=backbone)
    return DiffCSE(DiffCSEConfig(backbone="tiny"), backbone=backbone)


METHODS = ["d2cse", "dcpcse", "simcse", "diffcse"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", FAMILIES)
def test_method_trains_on_family(family, method):
    backbone = build(family)
    reference = copy.deepcopy(backbone)
    model = _build_method(method, backbone).train()
    step = model.training_step(_train_batch(family))
    assert torch.isfinite(step.loss)
    step.loss.backward()

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.grad is not None for p in trainable.values()), [n for n, p in trainable.items() if p.grad is None]
    prompted = method in ("d2cse", "dcpcse")
    backbone_params = list(model.backbone.parameters())
    if prompted:  # frozen PLM, gradients in the prompts ([CLS] prompt too for D2CSE)
        assert all(not p.requires_grad and p.grad is None for p in backbone_params)
        assert model.prompts.embedding.weight.grad.abs().sum() > 0
        if method == "d2cse":
            assert model.cls_prompt.grad.abs().sum() > 0
    else:  # the whole encoder trains; DiffCSE's discriminator is conditioned and trains too
        assert sum(float(p.grad.abs().sum()) for p in backbone_params if p.grad is not None) > 0
        if method == "diffcse":
            assert sum(float(p.grad.abs().sum()) for p in model.discriminator.parameters() if p.grad is not None) > 0

    model.eval()
    ids, mask = batch(family, rows=4, seed=7)
    with torch.no_grad():
        emb = model.embed(ids, mask)
        plain_cls = reference.eval()(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
    assert emb.shape == (4, D) and torch.isfinite(emb).all()
    if prompted:
        assert (emb - plain_cls).abs().max() > 1e-3  # the prompts are in the evaluation embedding
    else:
        assert_close_scaled(emb, plain_cls, rtol=0)


# ------------------------------------------------------------------------------------------------ refusals and fallbacks


def test_families_are_named():
    names = {f: encoder_family(build(f)).name for f in FAMILIES}
    assert names["deberta-v3"] == names["deberta-v2"] == "DeBERTa-v2/v3"
    assert names["distilbert"] == "DistilBERT" and names["modernbert"] == "ModernBERT" and names["mpnet"] == "MPNet"


def test_unsupported_architecture_is_refused_by_name():
    torch.manual_seed(0)
    v1 = DebertaModel(DebertaConfig(num_hidden_layers=2, **SHAPE))
    with pytest.raises(TypeError, match=r"DebertaModel \(model_type 'deberta'\) is not an encoder family"):
        PromptedBackbone(v1, None)


def test_bert_layout_model_type_runs_as_bert_like():
    torch.manual_seed(0)
    config = CamembertConfig(num_hidden_layers=2, pad_token_id=1, type_vocab_size=1, **SHAPE)
    model = CamembertModel(config, add_pooling_layer=False).eval()
    plain, wrapped = wrap(model)
    assert wrapped.family.name == "BERT-like (camembert)" and wrapped.position_kind == "padding"
    ids, mask = batch("roberta")
    hidden = wrapped.prefix_encoder(3).with_mask(torch.zeros(P))
    torch.testing.assert_close(
        wrapped(ids, mask, prefix=hidden).last_hidden_state,
        plain(input_ids=ids, attention_mask=mask).last_hidden_state,
        rtol=0,
        atol=1e-6,
    )


def test_other_attention_implementations_are_refused():
    model = build("modernbert")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="ModernBERT: prefix injection supports the 'sdpa' and 'eager'"):
        PromptedBackbone(model, None)


def test_deberta_head_size_other_than_hidden_over_heads_is_refused():
    torch.manual_seed(0)
    model = DebertaV2Model(
        DebertaV2Config(
            num_hidden_layers=2, attention_head_size=16, relative_attention=True, pos_att_type=["c2p"], **SHAPE
        )
    )
    with pytest.raises(TypeError, match="DeBERTa-v2/v3: attention head size 16"):
        PromptedBackbone(model, None)


def test_gradient_checkpointing_is_refused_where_the_prefix_is_call_scoped():
    _, wrapped = wrap(build("deberta-v3"))
    wrapped.backbone.activation_checkpointing_enable()
    ids, mask = batch("deberta-v3")
    with pytest.raises(ValueError, match="DeBERTa-v2/v3: .*gradient checkpointing"):
        wrapped.train()(ids, mask, prefix=True)


def test_token_types_on_a_family_without_them():
    _, wrapped = wrap(build("distilbert"))
    ids, mask = batch("distilbert")
    zeros = torch.zeros_like(ids)
    torch.testing.assert_close(
        wrapped(ids, mask, zeros).last_hidden_state, wrapped(ids, mask).last_hidden_state, rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="DistilBERT has no token types"):
        wrapped(ids, mask, torch.ones_like(ids))


def test_prefix_sample_must_have_one_entry_per_layer():
    _, wrapped = wrap(build("mpnet"))
    ids, mask = batch("mpnet")
    short = PrefixKeyValues(wrapped.prefix_encoder(3).layers[:1])
    with pytest.raises(ValueError, match="prefix sample has 1 layers, the MPNet backbone 2"):
        wrapped(ids, mask, prefix=short)


def test_swapped_attention_keeps_the_state_dict_and_copies():
    model = build("mpnet")
    names = set(model.state_dict())
    _, wrapped = wrap(model)
    assert set(wrapped.backbone.state_dict()) == names
    twin = copy.deepcopy(wrapped)  # a copy attends to its own prefix, not the original's
    ids, mask = batch("mpnet")
    kv = wrapped.prefix_encoder(3)
    torch.testing.assert_close(
        twin(ids, mask, prefix=kv).last_hidden_state, wrapped(ids, mask, prefix=kv).last_hidden_state, rtol=0, atol=0
    )
