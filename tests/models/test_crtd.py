"""The objective D2CSE and DiffCSE share (models/methods/crtd.py): `check_objective`, `align_corruption` (shapes, the
`(B, 1, T)` broadcast, default RTD labels, errors) and `ConditionalRTDModel`'s forward / `training_step` through both
concrete subclasses on the tiny BERT (SimCSE loss, DiffCSE's RTD)."""

from __future__ import annotations

import pytest
import torch

import cse.models.methods.crtd as crtd
from cse.models.batching import TrainBatch
from cse.models.losses import contrastive_loss, rtd_accuracy
from cse.models.methods.crtd import ConditionalRTDModel, align_corruption, check_objective
from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig
from cse.models.methods.diffcse import DiffCSE, DiffCSEConfig
from tests.batches import corrupted_views

B, T, D = 4, 9, 32


# ------------------------------------------------------------------------------------------------ check_objective


@pytest.mark.parametrize("temperature, rtd_weight", [(0.05, 0.005), (1e-6, 0.0), (2.0, 10.0)])
def test_check_objective_accepts_positive_temperature_and_non_negative_weight(temperature, rtd_weight):
    assert check_objective(temperature, rtd_weight) is None


@pytest.mark.parametrize(
    "temperature, rtd_weight, message",
    [
        (0.0, 0.005, "temperature must be positive, got 0.0"),
        (-0.05, 0.005, "temperature must be positive, got -0.05"),
        (0.05, -1e-9, "rtd_weight must be >= 0, got -1e-09"),
    ],
)
def test_check_objective_refuses(temperature, rtd_weight, message):
    with pytest.raises(ValueError) as err:
        check_objective(temperature, rtd_weight)
    assert str(err.value) == message


# ------------------------------------------------------------------------------------------------ align_corruption


def _rows(n: int = 2):
    """(2, n, 5) ids whose second sentence has two pad positions (id 0, mask 0); every view differs."""
    ids = torch.tensor([[101, 11, 12, 13, 102], [101, 21, 102, 0, 0]]).unsqueeze(1).repeat(1, n, 1)
    ids[:, :, 1] += torch.arange(n) * 100  # views differ at position 1
    mask = (ids != 0).long()
    return ids, mask


def test_default_labels_mark_replaced_real_tokens_only():
    ids, mask = _rows()
    cor = ids.clone()
    cor[0, 0, 2] = 999  # a replaced real token
    cor[1, 1, 1] = 998  # another one, in the second view
    cor[1, :, 3:] = 777  # changed pad positions: never labelled replaced
    out_ids, labels = align_corruption(ids, mask, cor, None)
    assert torch.equal(out_ids, cor) and labels.dtype == torch.bool and labels.shape == (2, 2, 5)
    want = torch.zeros(2, 2, 5, dtype=torch.bool)
    want[0, 0, 2] = want[1, 1, 1] = True
    assert torch.equal(labels, want)


def test_shared_corruption_is_broadcast_to_every_view_and_labelled_against_each_view():
    ids, mask = _rows(n=3)
    shared = ids[:, :1].clone()  # the first view's ids, one corruption for all three views
    shared[0, 0, 3] = 999
    out_ids, labels = align_corruption(ids, mask, shared, None)
    assert out_ids.shape == (2, 3, 5)
    for v in range(3):
        assert torch.equal(out_ids[:, v], shared[:, 0])
    # view 0 differs only at the replaced token; views 1 and 2 also at position 1 (their own ids differ there)
    assert labels[:, 0].nonzero().tolist() == [[0, 3]]
    assert labels[:, 1].nonzero().tolist() == labels[:, 2].nonzero().tolist() == [[0, 1], [0, 3], [1, 1]]


def test_given_labels_are_kept_and_a_shared_row_is_broadcast():
    ids, mask = _rows()
    cor = ids.clone()
    cor[0, :, 2] = 999
    zeros = torch.zeros(2, 1, 5, dtype=torch.long)  # the caller's labels win over the derived ones
    _, labels = align_corruption(ids, mask, cor, zeros)
    assert labels.shape == (2, 2, 5) and not labels.any()
    per_view = torch.zeros(2, 2, 5, dtype=torch.long)
    per_view[1, 1, 4] = 1
    _, labels = align_corruption(ids, mask, cor[:, :1], per_view)  # (B, n, T) labels with a shared corruption
    assert torch.equal(labels, per_view)


@pytest.mark.parametrize(
    "case, message",
    [
        ("ids_2d", r"input_ids must be \(B, 2\|3, T\), got \(2, 5\)"),
        ("four_views", r"input_ids must be \(B, 2\|3, T\), got \(2, 4, 5\)"),
        ("mask_shape", r"attention_mask \(2, 2, 4\) != input_ids \(2, 2, 5\)"),
        ("no_corruption", "corrupted_ids are required"),
        ("corrupted_2d", r"corrupted_ids must be \(B, 2\|1, T\) = \(2, 2\|1, 5\), got \(2, 5\)"),
        ("corrupted_batch", r"got \(1, 2, 5\)"),
        ("corrupted_views", r"got \(2, 3, 5\)"),
        ("corrupted_length", r"got \(2, 2, 4\)"),
        ("labels_views", r"rtd_labels must be \(B, 2\|1, T\), got \(2, 3, 5\)"),
        ("labels_length", r"rtd_labels must be \(B, 2\|1, T\), got \(2, 2, 4\)"),
    ],
)
def test_align_corruption_errors(case, message):
    ids, mask = _rows()
    cor, labels = ids.clone(), None
    if case == "ids_2d":
        ids, mask = ids[:, 0], mask[:, 0]
    elif case == "four_views":
        ids, mask = ids[:, :1].repeat(1, 4, 1), mask[:, :1].repeat(1, 4, 1)
    elif case == "mask_shape":
        mask = mask[:, :, :4]
    elif case == "no_corruption":
        cor = None
    elif case == "corrupted_2d":
        cor = cor[:, 0]
    elif case == "corrupted_batch":
        cor = cor[:1]
    elif case == "corrupted_views":
        cor = torch.cat([cor, cor[:, :1]], dim=1)
    elif case == "corrupted_length":
        cor = cor[:, :, :4]
    elif case == "labels_views":
        labels = torch.zeros(2, 3, 5, dtype=torch.long)
    elif case == "labels_length":
        labels = torch.zeros(2, 2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        align_corruption(ids, mask, cor, labels)


def test_three_views_accept_three_or_one_corruption_but_not_two():
    ids, mask = _rows(n=3)
    assert align_corruption(ids, mask, ids.clone(), None)[0].shape == (2, 3, 5)
    assert align_corruption(ids, mask, ids[:, :1].clone(), None)[0].shape == (2, 3, 5)
    with pytest.raises(ValueError, match=r"\(B, 3\|1, T\)"):
        align_corruption(ids, mask, ids[:, :2].clone(), None)


# ------------------------------------------------------------------------------------------------ the model skeleton


@pytest.fixture(params=["diffcse", "d2cse"])
def make_model(request, tiny_bert_dir):
    def make(**overrides) -> ConditionalRTDModel:
        torch.manual_seed(0)
        if request.param == "d2cse":
            return D2CSE(D2CSEModelConfig(backbone=str(tiny_bert_dir), prefix_len=3, **overrides))
        return DiffCSE(DiffCSEConfig(backbone=str(tiny_bert_dir), **overrides))

    return make


def _views(tokenizer, n: int = 2):
    return corrupted_views(tokenizer, n=n, seed=0, length=T)


class _Spy:
    """Records the arguments `ConditionalRTDModel.forward` hands to `rtd_loss` and to the subclass's two hooks."""

    def __init__(self, model, monkeypatch):
        self.rtd, self.encoded, self.discriminated = [], [], []
        real_rtd = crtd.rtd_loss

        def rtd(logits, labels, mask, mean_over_padding=True):
            self.rtd.append((logits.detach(), labels, mask, mean_over_padding))
            return real_rtd(logits, labels, mask, mean_over_padding=mean_over_padding)

        encode, discriminate = model.encode_rows, model.discriminate_rows

        def encode_rows(ids, mask, types):
            self.encoded.append((ids, mask, types))
            return encode(ids, mask, types)

        def discriminate_rows(cor, mask, h, types, context):
            self.discriminated.append((cor, mask, h, types))
            return discriminate(cor, mask, h, types, context)

        monkeypatch.setattr(crtd, "rtd_loss", rtd)
        monkeypatch.setattr(model, "encode_rows", encode_rows)
        monkeypatch.setattr(model, "discriminate_rows", discriminate_rows)


def test_class_contract_is_shared_by_both_methods(make_model):
    model = make_model()
    assert model.uses_corruption and model.evaluation_pooler == "cls_before_pooler"
    assert model.not_for_inference == ("discriminator.", "rtd_head.")


def test_rows_are_flattened_view_major_within_each_sentence(make_model, tokenizer, monkeypatch):
    model = make_model().train()
    ids, mask, cor, lab = _views(tokenizer)
    types = torch.arange(B * 2 * T).reshape(B, 2, T) % 2
    spy = _Spy(model, monkeypatch)
    out = model(ids, mask, cor, lab, token_type_ids=types)
    ((e_ids, e_mask, e_types),) = spy.encoded
    ((d_cor, d_mask, d_h, d_types),) = spy.discriminated
    for got, want in ((e_ids, ids), (e_mask, mask), (e_types, types), (d_cor, cor), (d_mask, mask), (d_types, types)):
        assert got.shape == (B * 2, T) and torch.equal(got, want.reshape(B * 2, T))
    assert torch.equal(e_ids[1], ids[0, 1]) and torch.equal(e_ids[2], ids[1, 0])  # row b·n + v = sentence b, view v
    assert d_h.shape == (B * 2, D) and d_h.requires_grad  # h conditions the discriminator, not detached
    assert torch.equal(out.h, d_h.view(B, 2, D))


def test_default_labels_are_corrupted_ne_original_on_real_tokens(make_model, tokenizer, monkeypatch):
    model = make_model().train()
    ids, mask, cor, lab = _views(tokenizer)
    cor = cor.masked_fill(mask == 0, 2000)  # replacements at pad positions are not labelled
    assert (mask == 0).any() and ((cor != ids) & (mask == 0)).any()
    spy = _Spy(model, monkeypatch)
    model(ids, mask, cor)
    ((_, labels, r_mask, over_padding),) = spy.rtd
    assert torch.equal(labels.long(), lab.reshape(B * 2, T))  # tests/batches.py's labels: replaced real tokens
    assert torch.equal(r_mask, mask.reshape(B * 2, T)) and over_padding is True
    model(ids, mask, cor, torch.zeros_like(lab))  # given labels are used as they are
    assert not spy.rtd[-1][1].any()


def test_loss_is_contrastive_plus_weighted_rtd(make_model, tokenizer, monkeypatch):
    ids, mask, cor, lab = _views(tokenizer)
    model = make_model(rtd_weight=0.3, temperature=0.1).train()
    spy = _Spy(model, monkeypatch)
    out = model(ids, mask, cor, lab)
    z = out.h.detach()
    torch.testing.assert_close(
        out.contrastive_loss.detach(), contrastive_loss(z[:, 0], z[:, 1], temperature=0.1), rtol=0, atol=0
    )
    assert out.loss.item() == pytest.approx(out.contrastive_loss.item() + 0.3 * out.rtd_loss.item(), rel=1e-6)
    logits, labels, r_mask, _ = spy.rtd[-1]
    assert logits.shape == (B * 2, T, 2)
    torch.testing.assert_close(out.rtd_accuracy, rtd_accuracy(logits, labels, r_mask), rtol=0, atol=0)
    assert not out.rtd_accuracy.requires_grad and out.rtd_loss.item() > 0


def test_zero_rtd_weight_gives_the_pure_contrastive_loss(make_model, tokenizer):
    ids, mask, cor, lab = _views(tokenizer)
    weighted_model, model = make_model(rtd_weight=0.3).train(), make_model(rtd_weight=0.0).train()
    torch.manual_seed(3)
    weighted = weighted_model(ids, mask, cor, lab)
    torch.manual_seed(3)
    out = model(ids, mask, cor, lab)
    torch.testing.assert_close(out.loss, out.contrastive_loss, rtol=0, atol=0)
    # λ scales the RTD term only: same weights, same dropout → the same contrastive and RTD terms as with λ = 0.3
    torch.testing.assert_close(out.contrastive_loss, weighted.contrastive_loss, rtol=0, atol=0)
    torch.testing.assert_close(out.rtd_loss, weighted.rtd_loss, rtol=0, atol=0)
    assert out.rtd_loss.item() > 0
    out.loss.backward()
    assert not model.rtd_head.classifier.weight.grad.any()  # nothing of the RTD loss reaches the RTD head
    assert model.projection.net[0].weight.grad.abs().sum() > 0


def test_supervised_rows_use_hard_negatives_with_the_configured_weight(make_model, tokenizer):
    ids, mask, cor, lab = _views(tokenizer, n=3)
    out = make_model(hard_negative_weight=1.0).train()(ids, mask, cor, lab)
    z = out.h.detach()
    assert z.shape == (B, 3, D)
    want = contrastive_loss(z[:, 0], z[:, 1], z[:, 2], temperature=0.05, hard_negative_weight=1.0)
    torch.testing.assert_close(out.contrastive_loss.detach(), want, rtol=0, atol=0)
    unweighted = contrastive_loss(z[:, 0], z[:, 1], z[:, 2], temperature=0.05)
    assert out.contrastive_loss.item() != pytest.approx(unweighted.item())


def test_shared_corruption_reaches_the_discriminator_once_per_view(make_model, tokenizer, monkeypatch):
    model = make_model().train()
    ids, mask, cor, _ = _views(tokenizer, n=3)
    spy = _Spy(model, monkeypatch)
    model(ids, mask, cor[:, :1])  # (B, 1, T): one corruption shared by anchor, entailment, contradiction
    ((d_cor, _, _, _),) = spy.discriminated
    rows = d_cor.view(B, 3, T)
    for v in range(3):
        assert torch.equal(rows[:, v], cor[:, 0])


def test_training_step_is_the_forward_with_detached_metrics(make_model, tokenizer):
    model = make_model().train()
    ids, mask, cor, lab = _views(tokenizer)
    torch.manual_seed(7)
    step = model.training_step(TrainBatch(ids, mask, cor), step=3)  # no labels in the batch: derived
    torch.manual_seed(7)
    out = model(ids, mask, cor, lab)
    torch.testing.assert_close(step.loss, out.loss, rtol=0, atol=0)
    assert step.loss.requires_grad
    assert set(step.metrics) == {"loss_contrastive", "loss_rtd", "rtd_accuracy"}
    assert all(not v.requires_grad and v.dim() == 0 for v in step.metrics.values())
    torch.testing.assert_close(step.metrics["loss_contrastive"], out.contrastive_loss.detach(), rtol=0, atol=0)
    torch.testing.assert_close(step.metrics["loss_rtd"], out.rtd_loss.detach(), rtol=0, atol=0)
    torch.testing.assert_close(step.metrics["rtd_accuracy"], out.rtd_accuracy, rtol=0, atol=0)


def test_forward_refuses_bad_shapes_before_encoding(make_model, tokenizer, monkeypatch):
    model = make_model()
    ids, mask, cor, _ = _views(tokenizer)
    spy = _Spy(model, monkeypatch)
    with pytest.raises(ValueError, match="input_ids"):
        model(ids[:, 0], mask[:, 0], cor[:, 0])
    with pytest.raises(ValueError, match="corrupted_ids are required"):
        model(ids, mask, None)
    with pytest.raises(ValueError, match="rtd_labels"):
        model(ids, mask, cor, torch.zeros(B, 2, T - 1, dtype=torch.long))
    assert spy.encoded == [] and spy.rtd == []


# ------------------------------------------------------------------------------------------------ rtd_grad_share


def test_grad_share_is_the_weighted_rtd_norm_over_the_contrastive_norm_per_group(make_model, tokenizer):
    """`rtd_grad_share` on (B, T) rows: λ‖∇L_RTD‖ / ‖∇L_CL‖ per group the contrastive loss reaches, ‖λ∇L_RTD‖ for the
    discriminator's copy and the RTD head, equal to the same figures computed by hand from one training forward
    with the rows as two views (the same dropout draws: the same seed)."""
    ids, mask, cor, lab = _views(tokenizer)
    model = make_model(rtd_weight=0.3).eval()
    torch.manual_seed(5)
    shares = model.rtd_grad_share(ids[:, 0], mask[:, 0], cor[:, 0], lab[:, 0])
    expected = {
        "diffcse": {"share_mlp", "share_encoder", "norm_discriminator", "norm_rtd_head"},
        "d2cse": {"share_prompts", "share_mlp", "norm_rtd_head"},
    }[model.method]
    assert set(shares) == expected and all(v > 0 for v in shares.values())
    torch.manual_seed(5)
    model.train()
    out = model(ids[:, :1].expand(-1, 2, -1), mask[:, :1].expand(-1, 2, -1), cor[:, :1], lab[:, :1])
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    g_cl = torch.autograd.grad(out.contrastive_loss, [p for _, p in named], retain_graph=True, allow_unused=True)
    g_rtd = torch.autograd.grad(out.rtd_loss, [p for _, p in named], allow_unused=True)

    def norm(grads, group):
        return (
            sum(
                float(g.pow(2).sum())
                for (n, _), g in zip(named, grads)
                if g is not None and crtd.grad_group(n) == group
            )
            ** 0.5
        )

    for key, value in shares.items():
        kind, group = key.split("_", 1)
        want = 0.3 * norm(g_rtd, group) / (norm(g_cl, group) if kind == "share" else 1.0)
        assert value == pytest.approx(want, rel=1e-4), key


def test_grad_share_leaves_the_training_as_it_was(make_model, tokenizer):
    """No random draw consumed, no buffer (BatchNorm's running statistics) moved, no `.grad` written, the mode
    restored: a training step after the share equals one without it, bit for bit."""
    ids, mask, cor, lab = _views(tokenizer)
    model = make_model().train()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    torch.manual_seed(3)
    model.rtd_grad_share(ids[:, 0], mask[:, 0], cor[:, 0], lab[:, 0])
    assert model.training and all(p.grad is None for p in model.parameters())
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    after_share = model(ids, mask, cor, lab).loss
    for n, b in model.named_buffers():
        b.copy_(buffers[n])
    torch.manual_seed(3)
    assert torch.equal(after_share, model(ids, mask, cor, lab).loss)
    model.eval().rtd_grad_share(ids[:, 0], mask[:, 0], cor[:, 0], lab[:, 0])
    assert not model.training


def test_grad_share_is_zero_at_zero_weight_and_needs_two_rows(make_model, tokenizer):
    ids, mask, cor, lab = _views(tokenizer)
    model = make_model(rtd_weight=0.0)
    assert all(v == 0.0 for v in model.rtd_grad_share(ids[:, 0], mask[:, 0], cor[:, 0]).values())
    with pytest.raises(ValueError, match="B >= 2"):
        model.rtd_grad_share(ids[:1, 0], mask[:1, 0], cor[:1, 0])


def test_grad_share_issues_no_collective_call_in_a_distributed_job(make_model, tokenizer, monkeypatch):
    """Rank 0 runs it alone at an evaluation: inside a (faked) world of 2 its losses stay this process's."""
    import cse.models.distributed as distributed

    def refuse(*args, **kwargs):
        raise AssertionError("a collective call")

    monkeypatch.setattr(distributed, "world", lambda: 2)
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast"):
        monkeypatch.setattr(distributed.dist, name, refuse)
    ids, mask, cor, lab = _views(tokenizer)
    assert distributed.is_distributed()
    assert make_model().rtd_grad_share(ids[:, 0], mask[:, 0], cor[:, 0], lab[:, 0])
