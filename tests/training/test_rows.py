"""training/rows.py: the row order of an epoch and the corruption variant each view reads (synthetic rows, no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cse.storage.training_data import CorruptionRows, TokenRows
from cse.training.rows import TrainingRows, epoch_order


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
    return TrainingRows(
        tokens, CorruptionRows(variants=variants, corrupted=corrupted, labels=labels), supervised, pad_id=0
    )


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
    assert (
        _rows(False, variants=1).reuse_description(epochs=2)
        == "one corruption per sentence, shared by all views and epochs"
    )
    assert _rows(False, variants=3).reuse_description(epochs=2) == "3 variants cycled over 4 view-epochs"
    plain = TrainingRows(TokenRows(ids=np.arange(2), seqs={"text": [np.array([1, 2])] * 2}), None, False, pad_id=0)
    assert plain.reuse_description(epochs=2) == "no corruption (method does not read it)"
    assert plain.batch(np.arange(2), 0).corrupted_ids is None


# ------------------------------------------------------------ memory-mapped rows: the same batches as before


def _datasets(root, n: int = 40, variants: int = 3, columns=("text",), corrupt_from_other: bool = False):
    """A tokens and a corruption dataset in the stages' long form, rows shuffled and split over several parts."""
    import pyarrow as pa

    from cse.storage import schemas
    from cse.storage.datasets import write_dataset

    rng = np.random.default_rng(0)
    seqs = {
        (c, i): [101, *rng.integers(1000, 2000, rng.integers(1, 12)).tolist(), 102] for c in columns for i in range(n)
    }
    tok = [{"id": i, "column": c, "input_ids": s, "length": len(s)} for (c, i), s in seqs.items()]
    cor = []
    for (c, i), s in seqs.items():
        for v in range(variants):
            x = np.array(s)
            mask = rng.random(len(s)) < 0.3
            x[mask] = rng.integers(1000, 2000, mask.sum())
            original = [s[0] + 1, *s[1:]] if corrupt_from_other else s
            cor.append(
                {
                    "id": i,
                    "column": c,
                    "variant": v,
                    "input_ids": original,
                    "corrupted_ids": x.tolist(),
                    "labels": (x != np.array(s)).astype(np.int8).tolist(),
                    "n_masked": int(mask.sum()),
                    "n_replaced": int((x != np.array(s)).sum()),
                }
            )
    tok = [tok[j] for j in rng.permutation(len(tok))]
    cor = [cor[j] for j in rng.permutation(len(cor))]

    def parts(rows, schema):
        return [pa.Table.from_pylist(rows[k : k + 25], schema=schema) for k in range(0, len(rows), 25)]

    write_dataset(root, "tokens", "t", parts(tok, schemas.TOKENS), schemas.TOKENS)
    write_dataset(root, "corruption", "c", parts(cor, schemas.CORRUPTION), schemas.CORRUPTION)


def _materialised(root, columns, limit=None) -> tuple[TokenRows, CorruptionRows]:
    """The rows as the loaders built them before they were memory-mapped: every column and variant read from the
    Parquet parts into int64 numpy arrays."""
    import pyarrow.compute as pc

    from cse.storage.datasets import read_dataset

    def lists(col):
        return [np.asarray(x, dtype=np.int64) for x in col.to_pylist()]

    tokens = read_dataset(root, "tokens", "t")
    seqs, ids = {}, None
    for c in columns:
        part = tokens.filter(pc.equal(tokens.column("column"), c)).sort_by("id").slice(0, limit)
        ids = part.column("id").to_numpy()
        seqs[c] = lists(part.column("input_ids"))
    cor = read_dataset(root, "corruption", "c")
    variants = int(pc.max(cor.column("variant")).as_py()) + 1
    corrupted, labels = {}, {}
    for c in columns:
        for v in range(variants):
            of_cv = pc.and_(pc.equal(cor.column("column"), c), pc.equal(cor.column("variant"), v))
            part = cor.filter(of_cv).sort_by("id").slice(0, len(ids))
            corrupted[(c, v)], labels[(c, v)] = lists(part.column("corrupted_ids")), lists(part.column("labels"))
    return TokenRows(ids=ids, seqs=seqs), CorruptionRows(variants, corrupted, labels)


@pytest.mark.parametrize("supervised,limit", [(False, None), (True, 30)])
def test_memory_mapped_rows_give_the_batches_the_materialised_rows_gave(tmp_path, supervised, limit):
    from cse.storage.layout import DataRoot
    from cse.storage.training_data import ArrowLists, load_corruption_rows, load_token_rows

    root = DataRoot(tmp_path)
    columns = ("sent0", "sent1", "hard_neg") if supervised else ("text",)
    _datasets(root, columns=columns)
    tokens = load_token_rows(root, "t", columns, limit=limit)
    mapped = TrainingRows(tokens, load_corruption_rows(root, "c", tokens), supervised, pad_id=0)
    before = TrainingRows(*_materialised(root, columns, limit), supervised, pad_id=0)
    assert isinstance(tokens.seqs[columns[0]], ArrowLists) and not tokens.seqs[columns[0]][0].flags.owndata  # a view
    assert np.array_equal(mapped.tokens.ids, before.tokens.ids) and len(mapped) == (limit or 40)
    for epoch in range(3):
        order = epoch_order(len(mapped), seed=7, epoch=epoch)
        for start in range(0, len(order), 8):
            a, b = mapped.batch(order[start : start + 8], epoch), before.batch(order[start : start + 8], epoch)
            for name in ("input_ids", "attention_mask", "corrupted_ids", "rtd_labels"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (epoch, start, name)


def test_memory_mapped_loaders_keep_their_checks(tmp_path):
    from cse.storage.layout import DataRoot
    from cse.storage.training_data import load_corruption_rows, load_token_rows

    root = DataRoot(tmp_path / "a")
    _datasets(root, n=10, variants=2)
    tokens = load_token_rows(root, "t", ("text",))
    with pytest.raises(ValueError, match="tokens dataset t has no column 'sent0'"):
        load_token_rows(root, "t", ("sent0",))
    other = TokenRows(ids=np.arange(12), seqs=tokens.seqs)  # ids the corruption does not have
    with pytest.raises(ValueError, match="corruption dataset c lacks rows of column 'text', variant 0"):
        load_corruption_rows(root, "c", other)
    assert load_corruption_rows(root, "c", tokens).variants == 2

    bad = DataRoot(tmp_path / "b")
    _datasets(bad, n=10, variants=2, corrupt_from_other=True)
    with pytest.raises(ValueError, match="corruption dataset c was made from other token ids than the training tokens"):
        load_corruption_rows(bad, "c", load_token_rows(bad, "t", ("text",)))

    import pyarrow as pa

    from cse.storage import schemas
    from cse.storage.datasets import write_dataset

    uneven = DataRoot(tmp_path / "c")
    rows = [
        {"id": i, "column": c, "input_ids": [101, 102], "length": 2}
        for c, n in (("sent0", 3), ("sent1", 2))
        for i in range(n)
    ]
    write_dataset(uneven, "tokens", "t", [pa.Table.from_pylist(rows, schema=schemas.TOKENS)], schemas.TOKENS)
    with pytest.raises(ValueError, match="tokens dataset t: columns are not row-aligned"):
        load_token_rows(uneven, "t", ("sent0", "sent1"))


@pytest.mark.parametrize("supervised,pad_to", [(False, None), (False, 16), (True, None), (True, 16)])
def test_one_gather_batches_equal_the_row_by_row_padded_batches(tmp_path, supervised, pad_to):
    """Memory-mapped rows over several record batches, and in-memory rows: `batch` (one gather per record batch)
    gives the tensors, dtypes included, of padding every row in Python."""
    from benchmarks.unpadded import row_by_row_batch
    from cse.storage.layout import DataRoot
    from cse.storage.training_data import load_corruption_rows, load_token_rows

    root = DataRoot(tmp_path)
    columns = ("sent0", "sent1", "hard_neg") if supervised else ("text",)
    _datasets(root, n=60, columns=columns)
    tokens = load_token_rows(root, "t", columns)
    assert tokens.seqs[columns[0]]._column.num_chunks > 1  # rows spread over several record batches
    mapped = TrainingRows(tokens, load_corruption_rows(root, "c", tokens), supervised, pad_id=3, pad_to=pad_to)
    in_memory = TrainingRows(*_materialised(root, columns), supervised, pad_id=3, pad_to=pad_to)
    for rows in (mapped, in_memory):
        for epoch in range(2):
            order = epoch_order(len(rows), seed=3, epoch=epoch)
            for start in range(0, len(order), 16):
                got = rows.batch(order[start : start + 16], epoch)
                want = row_by_row_batch(rows, order[start : start + 16], epoch)
                for name, tensor in want.items():
                    assert getattr(got, name).dtype == tensor.dtype == torch.long, name
                    assert torch.equal(getattr(got, name), tensor), (epoch, start, name)


def test_a_row_longer_than_the_batch_length_is_refused(tmp_path):
    rows = _rows(supervised=False, variants=1)
    rows.pad_to = 2
    with pytest.raises(ValueError, match="a training row has 3 tokens, more than the batch length 2"):
        rows.batch(np.arange(2), 0)
