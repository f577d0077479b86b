"""Prefix K/V injection (models/prompts/) against the plain HF encoder and two independent references."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import BertConfig, BertModel, DynamicCache, RobertaConfig, RobertaModel

from cse.models.prompts.backbone import PromptedBackbone, end_token_prefix_rows
from cse.models.prompts.prefixes import PrefixEncoder, PrefixKeyValues
from tests.tolerance import assert_close_scaled

P, L, D, H = 4, 2, 32, 4


def _bert(attn: str = "sdpa") -> BertModel:
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=120,
        hidden_size=D,
        num_hidden_layers=L,
        num_attention_heads=H,
        intermediate_size=64,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return BertModel(cfg, add_pooling_layer=False).eval()


def _roberta(attn: str = "sdpa") -> RobertaModel:
    torch.manual_seed(0)
    cfg = RobertaConfig(
        vocab_size=120,
        hidden_size=D,
        num_hidden_layers=L,
        num_attention_heads=H,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        type_vocab_size=1,
        attn_implementation=attn,
    )
    return RobertaModel(cfg, add_pooling_layer=False).eval()


BUILDERS = {"bert": _bert, "roberta": _roberta}


def _batch(pad_id: int):
    """Three rows of length 7: one full, two right-padded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 120, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, 3:] = 0
    ids = ids.masked_fill(mask == 0, pad_id)
    ids[:, 0] = 0 if pad_id == 1 else 101 % 120
    return ids, mask


def _wrap(model, shift=True, dropout=0.0):
    plain = copy.deepcopy(model)
    torch.manual_seed(2)
    prompts = PrefixEncoder(P, L, D, H, dropout=dropout)
    return plain, PromptedBackbone(model, prompts, shift_positions=shift).eval()


def _shifted_positions(family: str, plain, ids: torch.Tensor) -> torch.Tensor:
    if family == "bert":
        return torch.arange(P, P + ids.shape[1]).expand(ids.shape[0], -1)
    emb = plain.embeddings
    return emb.create_position_ids_from_input_ids(ids, emb.padding_idx, P)


# ------------------------------------------------------------------------------------------ PrefixEncoder


def test_prefix_table_layout_is_k0_v0_k1_v1_head_major():
    enc = PrefixEncoder(P, L, D, H, dropout=0.0)
    kv = enc(2)
    table = enc.embedding.weight.detach()
    dh = D // H
    assert len(kv.layers) == L and kv.length == P and kv.batch_size == 2
    for layer in range(L):
        for which, tensor in enumerate(kv.layers[layer]):  # 0 = key, 1 = value
            assert tensor.shape == (2, H, P, dh)
            block = (2 * layer + which) * D
            for head in range(H):
                want = table[:, block + head * dh : block + (head + 1) * dh]
                torch.testing.assert_close(tensor[1, head], want, rtol=0, atol=0)


def test_prompted_encoder_runs_on_the_meta_device():
    # the dry run's shape-only pass at the real batch (benchmarks/dry_run.py) moves the model to meta
    _, wrapped = _wrap(_bert())
    ids, mask = _batch(pad_id=0)
    out = wrapped.to("meta")(ids.to("meta"), mask.to("meta")).last_hidden_state
    assert out.device.type == "meta" and out.shape == (*ids.shape, D)


def test_prefix_parameter_counts_and_init():
    plain = PrefixEncoder(16, 12, 768, 12)
    assert sum(p.numel() for p in plain.parameters()) == 16 * 2 * 12 * 768 == 294_912
    assert abs(plain.embedding.weight.std().item() - 0.02) < 1e-3
    assert abs(plain.embedding.weight.mean().item()) < 1e-3

    rep = PrefixEncoder(8, 12, 768, 12, projection=True, projection_hidden=512)
    assert sum(p.numel() for p in rep.parameters()) == 8 * 768 + (768 * 512 + 512) + (512 * 2 * 12 * 768 + 2 * 12 * 768)
    assert all(torch.count_nonzero(m.bias) == 0 for m in rep.transform if isinstance(m, torch.nn.Linear))
    kv = rep.eval()(3)
    assert kv.layers[11][1].shape == (3, 12, 8, 64)


def test_prefix_dropout_is_per_row_in_train_mode_only():
    enc = PrefixEncoder(P, L, D, H, dropout=0.1)
    enc.train()
    k = enc(64).layers[0][0]
    assert not torch.equal(k[0], k[1])
    assert (k == 0).float().mean().item() == pytest.approx(0.1, abs=0.03)
    enc.eval()
    k = enc(3).layers[0][0]
    assert torch.equal(k[0], k[2])


# ------------------------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_without_prefix_equals_plain_model(family, attn):
    plain, wrapped = _wrap(BUILDERS[family](attn))
    ids, mask = _batch(plain.config.pad_token_id)
    ref = plain(input_ids=ids, attention_mask=mask).last_hidden_state
    assert_close_scaled(wrapped(ids, mask, prefix=False).last_hidden_state, ref, rtol=0)
    full = torch.ones_like(mask)
    torch.testing.assert_close(
        wrapped(ids, None, prefix=False).last_hidden_state,
        plain(input_ids=ids, attention_mask=full).last_hidden_state,
        rtol=0,
        atol=1e-6,
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_masked_out_prefix_equals_plain_model(family, attn):
    plain, wrapped = _wrap(BUILDERS[family](attn), shift=False)
    ids, mask = _batch(plain.config.pad_token_id)
    hidden = wrapped.prefix_encoder(3).with_mask(torch.zeros(P))
    ref = plain(input_ids=ids, attention_mask=mask).last_hidden_state
    assert_close_scaled(wrapped(ids, mask, prefix=hidden).last_hidden_state, ref, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_masked_out_prefix_with_shift_equals_plain_model_at_shifted_positions(family, attn):
    plain, wrapped = _wrap(BUILDERS[family](attn), shift=True)
    ids, mask = _batch(plain.config.pad_token_id)
    hidden = wrapped.prefix_encoder(3).with_mask(torch.zeros(3, P))
    pos = _shifted_positions(family, plain, ids)
    ref = plain(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    assert_close_scaled(wrapped(ids, mask, prefix=hidden).last_hidden_state, ref, rtol=0)
    unshifted = plain(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (ref - unshifted).abs().max() > 1e-3  # the shift is real


def test_roberta_shift_matches_hf_padding_aware_positions():
    plain, wrapped = _wrap(_roberta())
    ids, _ = _batch(1)
    pos = wrapped.position_ids(ids, P)
    assert pos[0].tolist() == list(range(1 + 1 + P, 1 + 1 + P + 7))  # padding_idx + 1 + P …
    assert pos[2, 3:].tolist() == [1] * 4  # pads keep padding_idx
    bert_pos = _wrap(_bert())[1].position_ids(ids, P)
    assert bert_pos[2].tolist() == list(range(P, P + 7))


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_visible_prefix_changes_outputs_and_only_its_masked_part_matters(family):
    plain, wrapped = _wrap(BUILDERS[family]())
    ids, mask = _batch(plain.config.pad_token_id)
    kv = wrapped.prefix_encoder(3)
    visible = wrapped(ids, mask, prefix=kv).last_hidden_state
    hidden = wrapped(ids, mask, prefix=kv.with_mask(torch.zeros(P))).last_hidden_state
    assert (visible - hidden).abs().max() > 1e-3
    # hiding the last two slots == running with a 2-slot prefix at the same (shift P) positions
    half = kv.with_mask(torch.tensor([1, 1, 0, 0]))
    short = PrefixKeyValues(tuple((k[:, :, :2], v[:, :, :2]) for k, v in kv.layers))
    pos = _shifted_positions(family, plain, ids)
    cache = DynamicCache(config=plain.config)
    for i, (k, v) in enumerate(short.layers):
        cache.update(k, v, i)
    ext = torch.cat([torch.ones(3, 2, dtype=torch.long), mask], 1)
    ref = plain(input_ids=ids, attention_mask=ext, past_key_values=cache, position_ids=pos).last_hidden_state
    assert_close_scaled(wrapped(ids, mask, prefix=half).last_hidden_state, ref, rtol=0)


# ------------------------------------------------------------------------------------------ references


def test_one_layer_matches_manual_attention_with_concatenated_kv():
    plain, wrapped = _wrap(_bert("eager"))
    ids, mask = _batch(0)
    kv = wrapped.prefix_encoder(3)
    attn = wrapped.backbone.encoder.layer[1].attention.self
    seen = {}
    h1 = attn.register_forward_hook(
        lambda m, args, kwargs, out: seen.update(x=kwargs.get("hidden_states", args[0] if args else None), out=out[0]),
        with_kwargs=True,
    )
    try:
        wrapped(ids, mask, prefix=kv)
    finally:
        h1.remove()
    x = seen["x"]
    b, t, _ = x.shape
    dh = D // H

    def heads(y):
        return y.view(b, t, H, dh).transpose(1, 2)

    q, k, v = heads(attn.query(x)), heads(attn.key(x)), heads(attn.value(x))
    k = torch.cat([kv.layers[1][0], k], 2)
    v = torch.cat([kv.layers[1][1], v], 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dh)
    visible = torch.cat([torch.ones(b, P, dtype=torch.bool), mask.bool()], 1)[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    manual = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, D)
    assert_close_scaled(seen["out"], manual, rtol=0)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_outputs_and_prefix_gradients_match_dynamic_cache_reference(family):
    plain, wrapped = _wrap(BUILDERS[family]())
    ids, mask = _batch(plain.config.pad_token_id)
    weights = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(3))
    table = wrapped.prefix_encoder.embedding.weight

    out = wrapped(ids, mask, prefix=True).last_hidden_state
    (out * weights).sum().backward()
    grad = table.grad.clone()
    table.grad = None

    kv = wrapped.prefix_encoder(3)
    cache = DynamicCache(config=plain.config)
    for i, (k, v) in enumerate(kv.layers):
        cache.update(k, v, i)
    ext = torch.cat([torch.ones(3, P, dtype=torch.long), mask], 1)
    pos = _shifted_positions(family, plain, ids)
    ref = plain(input_ids=ids, attention_mask=ext, past_key_values=cache, position_ids=pos).last_hidden_state
    (ref * weights).sum().backward()

    assert_close_scaled(out, ref, rtol=0)
    assert grad.abs().sum() > 0
    assert_close_scaled(grad, table.grad, terms=3 * 7, rtol=1e-5)


# ------------------------------------------------------------------------------------------ behaviour


def test_sequential_passes_do_not_leak_prefixes_or_hooks():
    plain, wrapped = _wrap(_bert())
    ids, mask = _batch(0)
    kv_a, kv_b = wrapped.prefix_encoder(3), PrefixEncoder(P, L, D, H, dropout=0.0)(3)
    alone_b = wrapped(ids, mask, prefix=kv_b).last_hidden_state
    h = torch.randn(3, D)
    wrapped(ids, mask, prefix=kv_a, position0_output=h)
    torch.testing.assert_close(wrapped(ids, mask, prefix=kv_b).last_hidden_state, alone_b, rtol=0, atol=0)
    torch.testing.assert_close(
        wrapped(ids, mask, prefix=False).last_hidden_state,
        plain(input_ids=ids, attention_mask=mask).last_hidden_state,
        rtol=0,
        atol=1e-6,
    )


def test_position0_output_replaces_embedding_output_after_layernorm():
    plain, wrapped = _wrap(_bert())
    ids, mask = _batch(0)
    seen = []
    # what the first layer's attention reads: the embedding output (after LayerNorm) with position 0 replaced
    hook = wrapped.attention_modules()[0].register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs.get("hidden_states", args[0] if args else None)), with_kwargs=True
    )
    try:
        wrapped(ids, mask, prefix=True)
        vec = torch.randn(3, D)
        wrapped(ids, mask, prefix=True, position0_output=vec)
    finally:
        hook.remove()
    before, after = seen
    torch.testing.assert_close(after[:, 0], vec, rtol=0, atol=0)
    torch.testing.assert_close(after[:, 1:], before[:, 1:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="position-0 vectors"):
        wrapped(ids, mask, prefix=True, position0_output=torch.randn(2, D))


def test_cls_embedding_replaces_only_the_position0_word_embedding():
    plain, wrapped = _wrap(_bert())
    ids, mask = _batch(0)
    base = wrapped(ids, mask, prefix=True).last_hidden_state
    own_row = wrapped.backbone.embeddings.word_embeddings.weight[ids[0, 0]]
    torch.testing.assert_close(
        wrapped(ids, mask, prefix=True, cls_embedding=own_row).last_hidden_state, base, rtol=0, atol=1e-6
    )
    other = wrapped(ids, mask, prefix=True, cls_embedding=torch.randn(D)).last_hidden_state
    assert (other - base).abs().max() > 1e-3


def test_hidden_states_on_request_and_prefix_length_limit():
    _, wrapped = _wrap(_bert())
    ids, mask = _batch(0)
    out = wrapped(ids, mask, prefix=True, output_hidden_states=True)
    assert len(out.hidden_states) == L + 1
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)
    too_long = torch.full((1, 64 - P + 1), 7)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        wrapped(too_long, prefix=True)


def test_prefix_shape_must_fit_backbone():
    with pytest.raises(ValueError, match="does not fit"):
        PromptedBackbone(_bert(), PrefixEncoder(P, L + 1, D, H))


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_sep_init_rows_are_the_backbones_own_end_token_keys_and_values(family):
    """`prefix_init` "sep": every row is the end token's key and value at each layer, in the table's layout
    (`[k_0 | v_0 | k_1 | v_1]`, as test_prefix_table_layout reads it), computed in eval mode; the mode is restored."""
    model = (_bert() if family == "bert" else _roberta()).train()
    ids = [0, 2] if family == "roberta" else [101 % 120, 102 % 120]
    rows = end_token_prefix_rows(model, ids, P)
    assert rows.shape == (P, 2 * L * D) and model.training
    assert torch.equal(rows, rows[:1].expand(P, -1))
    model.eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        want = []
        for layer, h in zip(model.encoder.layer, hidden):
            want += [layer.attention.self.key(h)[0, -1], layer.attention.self.value(h)[0, -1]]
    assert torch.equal(rows[0], torch.cat(want))
    table = PrefixEncoder(P, L, D, H, dropout=0.0)
    with torch.no_grad():
        table.embedding.weight.copy_(rows)
    key0, value1 = table(1).layers[0][0], table(1).layers[1][1]
    assert torch.equal(key0[0, :, 0].reshape(-1), want[0]) and torch.equal(value1[0, :, 2].reshape(-1), want[3])


def test_sep_init_in_a_method_and_its_refusals(tiny_bert_dir):
    from transformers import DistilBertConfig, DistilBertModel

    from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig

    torch.manual_seed(0)
    normal = D2CSE(D2CSEModelConfig(backbone=str(tiny_bert_dir), prefix_len=3))
    torch.manual_seed(0)
    sep = D2CSE(D2CSEModelConfig(backbone=str(tiny_bert_dir), prefix_len=3, prefix_init="sep"))
    ids = sep.tokenizer("")["input_ids"]
    assert ids[-1] == sep.tokenizer.sep_token_id
    assert torch.equal(sep.prompts.embedding.weight, end_token_prefix_rows(sep.backbone, ids, 3))
    # the init draws no random numbers: every other trainable part is the normal build's
    others = {k: v for k, v in normal.state_dict().items() if "prefix_encoder" not in k}
    assert all(torch.equal(v, sep.state_dict()[k]) for k, v in others.items())
    with pytest.raises(ValueError, match="not with prefix_projection"):
        D2CSEModelConfig(backbone=str(tiny_bert_dir), prefix_init="sep", prefix_projection=True)
    distil = DistilBertModel(DistilBertConfig(vocab_size=120, dim=32, n_layers=1, n_heads=4, hidden_dim=64))
    with pytest.raises(TypeError, match="key/value projections"):
        end_token_prefix_rows(distil, [101 % 120, 102 % 120], 2)
