"""Heads (models/heads.py) and losses (models/losses.py) on hand-computed cases (SimCSE, DiffCSE)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cse.models.heads import ProjectionMLP, RTDHead, SimCSEPoolerMLP
from cse.models.losses import contrastive_loss, rtd_accuracy, rtd_loss


def _count(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_projection_mlp_structure_and_bert_base_count():
    mlp = ProjectionMLP(768)
    lin1, bn1, relu, lin2, bn2 = mlp.net
    assert (lin1.in_features, lin1.out_features, lin1.bias) == (768, 1536, None)
    assert bn1.num_features == 1536 and bn1.affine
    x = torch.randn(3, 1536)
    assert torch.equal(relu(x), x.clamp(min=0))
    assert (lin2.in_features, lin2.out_features, lin2.bias) == (1536, 768, None)
    assert bn2.num_features == 768 and not bn2.affine
    # 768·1536 + 2·1536 (BN weight, bias) + 1536·768 + 0 (BN without affine)
    assert _count(mlp) == 768 * 1536 + 2 * 1536 + 1536 * 768 == 2_362_368
    assert abs(lin1.weight.std().item() - 0.02) < 1e-3


def test_projection_mlp_normalises_over_all_rows_in_train_mode():
    torch.manual_seed(0)
    mlp = ProjectionMLP(8, init_std=1.0).train()  # large weights: BatchNorm eps is negligible
    out = mlp(torch.randn(16, 8) * 3 + 1)
    torch.testing.assert_close(out.mean(0), torch.zeros(8), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.var(0, unbiased=False), torch.ones(8), rtol=0, atol=1e-3)
    assert mlp.net[4].running_mean.abs().sum() > 0  # statistics are tracked (saved in checkpoints)


def test_simcse_mlp_and_rtd_head_counts():
    mlp = SimCSEPoolerMLP(768)
    assert _count(mlp) == 590_592
    assert torch.count_nonzero(mlp.dense.bias) == 0
    assert mlp(torch.randn(4, 768) * 100).abs().max() <= 1.0
    head = RTDHead(768)
    assert _count(head) == 1_538
    assert head(torch.randn(2, 5, 768)).shape == (2, 5, 2)


# ------------------------------------------------------------------------------------------ contrastive


def _ce(logits_row: list[float], target: int) -> float:
    return -logits_row[target] + math.log(sum(math.exp(v) for v in logits_row))


def test_unsupervised_contrastive_loss_hand_computed():
    z1 = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z2 = torch.tensor([[3.0, 0.0], [1.0, 1.0]])
    c = 1 / math.sqrt(2)
    # cos(z1_0, ·) = [1, c]; cos(z1_1, ·) = [0, c]; τ = 0.5 doubles them
    want = (_ce([2.0, 2 * c], 0) + _ce([0.0, 2 * c], 1)) / 2
    assert contrastive_loss(z1, z2, temperature=0.5).item() == pytest.approx(want, rel=1e-6)
    # default τ = 0.05
    want = (_ce([20.0, 20 * c], 0) + _ce([0.0, 20 * c], 1)) / 2
    assert contrastive_loss(z1, z2).item() == pytest.approx(want, rel=1e-5)


def test_supervised_loss_uses_every_hard_negative_and_weights_only_the_own_one():
    z1 = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    z2 = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    z3 = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    c = 1 / math.sqrt(2)
    # rows: [cos(z1_i, z2_0), cos(z1_i, z2_1), cos(z1_i, z3_0), cos(z1_i, z3_1)]
    rows = [[1.0, 0.0, c, -1.0], [0.0, 1.0, c, 0.0]]
    want = (_ce(rows[0], 0) + _ce(rows[1], 1)) / 2
    assert contrastive_loss(z1, z2, z3, temperature=1.0).item() == pytest.approx(want, rel=1e-6)
    w = 0.7  # added to the logit (i, B+i) only
    rows_w = [[1.0, 0.0, c + w, -1.0], [0.0, 1.0, c, 0.0 + w]]
    want_w = (_ce(rows_w[0], 0) + _ce(rows_w[1], 1)) / 2
    assert contrastive_loss(z1, z2, z3, temperature=1.0, hard_negative_weight=w).item() == pytest.approx(
        want_w, rel=1e-6
    )


def test_contrastive_loss_is_scale_invariant_and_differentiable():
    torch.manual_seed(0)
    z1, z2 = torch.randn(5, 8, requires_grad=True), torch.randn(5, 8)
    loss = contrastive_loss(z1, z2)
    assert loss.item() == pytest.approx(contrastive_loss(z1 * 7, z2 * 0.1).item(), rel=1e-5)
    loss.backward()
    assert z1.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------ RTD


def test_rtd_loss_mean_over_all_positions_including_padding():
    # two rows padded to the longer one, as the reference's collator pads a batch
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [3.0, 3.0]], [[1.0, 0.0], [0.0, 0.0], [0.0, 2.0]]])  # (2, 3, 2)
    labels = torch.tensor([[0, 1, 1], [0, 0, 1]])  # the pad's label is forced to 0
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ce = [_ce([2.0, 0.0], 0), _ce([0.0, 1.0], 1), _ce([3.0, 3.0], 0)]
    ce += [_ce([1.0, 0.0], 0), _ce([0.0, 0.0], 0), _ce([0.0, 2.0], 1)]
    assert rtd_loss(logits, labels, mask).item() == pytest.approx(sum(ce) / 6, rel=1e-6)
    assert rtd_loss(logits, labels, mask, mean_over_padding=False).item() == pytest.approx(
        (sum(ce) - ce[2]) / 5, rel=1e-6
    )


def test_rtd_loss_does_not_count_columns_past_the_longest_row():
    """A batch padded beyond its longest row (training/rows.py pads to max_length) has the reference's loss: the
    mean runs over rows × the longest row, whatever the extra columns hold."""
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(3, 5, 2, generator=g), torch.randint(0, 2, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    wide = torch.cat([logits, torch.randn(3, 4, 2, generator=g) * 10], 1)
    wide_labels = torch.cat([labels, torch.ones(3, 4, dtype=torch.long)], 1)
    wide_mask = torch.cat([mask, torch.zeros(3, 4, dtype=torch.long)], 1)
    for over_padding in (True, False):
        want = rtd_loss(logits[:, :4], labels[:, :4], mask[:, :4], mean_over_padding=over_padding)
        got = rtd_loss(wide, wide_labels, wide_mask, mean_over_padding=over_padding)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_rtd_loss_of_uniform_logits_is_log2():
    logits = torch.zeros(4, 6, 2)
    labels = torch.randint(0, 2, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.long)
    assert rtd_loss(logits, labels, mask).item() == pytest.approx(math.log(2), rel=1e-6)


def test_rtd_accuracy_counts_non_pad_positions_only():
    logits = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]])  # predictions 0, 1, 0, 1
    labels = torch.tensor([[0, 0, 0, 1]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert rtd_accuracy(logits, labels, mask).item() == pytest.approx(2 / 3)
