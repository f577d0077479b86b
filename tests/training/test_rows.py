"""training/rows.py: the row order of an epoch and the corruption variant each view reads (synthetic rows, no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from storage.training_data import CorruptionRows, TokenRows
from training.rows import TrainingRows, epoch_order


def _rows(supervised: bool, variants: int, n: int = 4) -> TrainingRows:
    """Rows whose corrupted ids spell (column, variant): column c, variant v → every token is 100·c + 10·v + 1."""
    columns = ("sent0", "sent1", "hard_neg") if supervised else ("text",)
    seqs = {c: [np.array([1, 5 + i, 2]) for i in range(n)] for c in columns}
    corrupted, labels = {}, {}
    for ci, c in enumerate(columns):
        for v in range(variants):
            corrupted[(c, v)] = [np.full(3, 100 * ci + 10 * v + 1) for _ in range(n)]
            labels[(c, v)] = [np.ones(3, dtype=np.int8) for _ in range(n)]
    tokens = TokenRows(ids=np.arange(n), seqs=seqs)
    return TrainingRows(tokens, CorruptionRows(variants=variants, corrupted=corrupted, labels=labels), supervised, pad_id=0)


def _variant_read(batch, view: int) -> int:
    """The variant the batch's `view` carries (the tens digit of its corrupted ids)."""
    return int(batch.corrupted_ids[0, view, 0]) % 100 // 10


def test_epoch_order_is_a_permutation_fixed_by_seed_and_epoch():
    order = epoch_order(20, seed=5, epoch=2)
    assert sorted(order.tolist()) == list(range(20))
    assert np.array_equal(order, epoch_order(20, seed=5, epoch=2))
    assert not np.array_equal(order, epoch_order(20, seed=5, epoch=3))
    assert not np.array_equal(order, epoch_order(20, seed=6, epoch=2))


@pytest.mark.parametrize("variants", [1, 3, 4])
def test_unsupervised_views_read_variant_epoch_times_two_plus_view(variants):
    rows = _rows(supervised=False, variants=variants)
    assert rows.n_views == 2
    for epoch in range(3):
        batch = rows.batch(np.arange(2), epoch)
        assert torch.equal(batch.input_ids[:, 0], batch.input_ids[:, 1])  # one sentence, two views
        for view in range(2):
            expected = (epoch * 2 + view) % variants
            assert rows.variant(epoch, view) == expected
            assert _variant_read(batch, view) == expected


def test_supervised_views_read_their_own_column_one_variant_per_epoch():
    rows = _rows(supervised=True, variants=2)
    assert rows.view_columns == ("sent0", "sent1", "hard_neg")
    for epoch in range(3):
        batch = rows.batch(np.arange(3), epoch)
        assert batch.input_ids.shape[:2] == (3, 3)
        for view in range(3):
            assert rows.variant(epoch, view) == epoch % 2
            assert int(batch.corrupted_ids[0, view, 0]) == 100 * view + 10 * (epoch % 2) + 1


def test_reuse_description_follows_the_variants_available():
    assert _rows(False, variants=4).reuse_description(epochs=2) == "fresh corruption for every view of every epoch"
    assert _rows(False, variants=1).reuse_description(epochs=2) == "one corruption per sentence, shared by all views and epochs"
    assert _rows(False, variants=3).reuse_description(epochs=2) == "3 variants cycled over 4 view-epochs"
    plain = TrainingRows(TokenRows(ids=np.arange(2), seqs={"text": [np.array([1, 2])] * 2}), None, False, pad_id=0)
    assert plain.reuse_description(epochs=2) == "no corruption (method does not read it)"
    assert plain.batch(np.arange(2), 0).corrupted_ids is None
