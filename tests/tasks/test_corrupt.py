"""The corruption stage: shards, caching, reruns after a crash, vocabulary check, the `corrupt` flow."""

from __future__ import annotations

import mlflow
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import cse.models.generator_cache as generator_cache
import cse.tasks.corrupt as corrupt_tasks
from cse.config.stages import CorruptConfig
from cse.flows.corrupt import corrupt
from cse.models.loading import VocabularyMismatchError, tokenizer_fingerprint, vocab_fingerprint
from cse.storage import schemas
from cse.storage.catalog import query
from cse.storage.datasets import read_dataset, write_dataset
from cse.storage.layout import DataRoot
from cse.storage.settings import get_settings
from cse.tasks.corrupt import corrupt_shard, plan_corruption, publish_corruption
from cse.tracking.store import configure_mlflow

SENTENCES = 300


@pytest.fixture(scope="module")
def wiki_ids(tokenizer, shared_data) -> list[list[int]]:
    lines = (shared_data / "wiki1m_head.txt").read_text(encoding="utf-8").splitlines()[:SENTENCES]
    return tokenizer(lines, truncation=True, max_length=32)["input_ids"]


def write_tokens(root: DataRoot, key: str, tokenizer, *parts: list[list[int]]) -> str:
    """A tokens dataset of the packaged MiniLM as the tokenisation stage writes it: a part of rows per `parts` (their
    ids), the rows numbered in order. Returns `key`."""
    tables, start = [], 0
    for ids in parts:
        table = {
            "id": np.arange(start, start + len(ids), dtype=np.int64),
            "column": ["text"] * len(ids),
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "length": pa.array([len(x) for x in ids], pa.int16()),
        }
        tables.append(pa.table(table))
        start += len(ids)
    params = {
        "tokenizer": "packaged:minilm",
        "max_length": 32,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "vocab_fingerprint": vocab_fingerprint(tokenizer),
    }
    write_dataset(root, "tokens", key, tables, schemas.TOKENS, params=params)
    return key


@pytest.fixture
def root() -> DataRoot:
    return DataRoot(get_settings().data_root)


@pytest.fixture
def tokens_key(root, tokenizer, wiki_ids) -> str:
    """A tokens dataset as the tokenisation stage writes it, in two parts of uneven size."""
    return write_tokens(root, "tokens-test", tokenizer, wiki_ids[:170], wiki_ids[170:])


@pytest.fixture
def config(tiny_generator_dir) -> CorruptConfig:
    return CorruptConfig(generator=str(tiny_generator_dir), shard_size=64, batch_size=16, device="cpu", variants=1)


def _compute_shards(tokens_key: str, config: CorruptConfig, order=None):
    plan = plan_corruption.fn(tokens_key, config)
    return plan, [corrupt_shard.fn(plan, i) for i in (order or range(plan.n_shards))]


def _data_runs():
    configure_mlflow()
    return mlflow.search_runs(experiment_names=["data"], output_format="list")


def test_shards_are_byte_identical_for_a_seed_whatever_the_schedule(root, tokens_key, config):
    plan = plan_corruption.fn(tokens_key, config)
    assert plan.n_shards == 5 and not plan.cached
    corrupt_shard.fn(plan, 3)  # alone, first
    alone = plan.shard_path(3).read_bytes()
    plan.shard_path(3).unlink()
    _compute_shards(tokens_key, config, order=[4, 0, 1, 2, 3])
    assert plan.shard_path(3).read_bytes() == alone

    other_plan, _ = _compute_shards(tokens_key, config.model_copy(update={"seed": 7}), order=[3])
    assert other_plan.key != plan.key
    a, b = (pq.read_table(p.shard_path(3)) for p in (plan, other_plan))
    assert a.column("input_ids").equals(b.column("input_ids"))
    assert not a.column("corrupted_ids").equals(b.column("corrupted_ids"))


def test_published_rows_follow_the_input_and_labels_mark_replacements(root, tokens_key, config, wiki_ids):
    plan, shards = _compute_shards(tokens_key, config)
    ref = publish_corruption.fn(plan, shards)
    assert ref.rows == SENTENCES and not ref.cache_hit
    assert not root.shards_dir("corruption", ref.key).exists()

    table = read_dataset(root, "corruption", ref.key)
    assert table.schema.equals(schemas.CORRUPTION)
    assert table.column("id").to_pylist() == list(range(SENTENCES))
    assert table.column("input_ids").to_pylist() == wiki_ids
    changed = 0
    for orig, cor, lab, n_rep, n_mask in zip(
        *(table.column(c).to_pylist() for c in ("input_ids", "corrupted_ids", "labels", "n_replaced", "n_masked"))
    ):
        assert lab == [int(a != b) for a, b in zip(orig, cor)]
        assert cor[0] == orig[0] == 101 and cor[-1] == orig[-1] == 102
        assert sum(lab) == n_rep <= n_mask
        changed += n_rep
    assert changed > 0

    stats = root.require("corruption", ref.key).stats
    assert abs(stats["masked_ratio"] - 0.3) < 0.03 and 0 < stats["replaced_ratio"] <= stats["masked_ratio"]
    assert [s["shard"] for s in stats["per_shard"]] == [0, 1, 2, 3, 4] and stats["shards_computed"] == 5
    assert stats["sentences_per_s"] > 0


def test_only_the_missing_shard_is_recomputed(prefect_harness, root, tokens_key, config):
    plan, _ = _compute_shards(tokens_key, config)  # a run that died before publishing
    mtimes = {i: plan.shard_path(i).stat().st_mtime_ns for i in range(plan.n_shards)}
    plan.shard_path(2).unlink()

    ref = corrupt(tokens_key, config)
    assert ref.key == plan.key and not ref.cache_hit
    m = root.require("corruption", ref.key)
    assert [s["computed"] for s in m.stats["per_shard"]] == [False, False, True, False, False]
    parts = m.paths(root.dataset_dir("corruption", ref.key))
    assert [p.stat().st_mtime_ns == mtimes[i] for i, p in enumerate(parts)] == [True, True, False, True, True]

    runs = _data_runs()
    assert len(runs) == 1 and runs[0].info.run_name == "corrupt" and runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["shards_computed"] == 1 and runs[0].data.metrics["cache_hit"] == 0
    assert runs[0].data.tags["content_hash"] == m.content_hash and runs[0].data.tags["input_hash"] == plan.tokens_hash


def test_rerun_is_a_cache_hit_without_loading_the_generator(prefect_harness, root, tokens_key, config, monkeypatch):
    first = corrupt(tokens_key, config)
    assert not first.cache_hit

    def refuse(*args, **kwargs):
        raise AssertionError("the generator must not be loaded or run on a cache hit")

    monkeypatch.setattr(generator_cache, "load_masked_lm", refuse)
    monkeypatch.setattr(corrupt_tasks, "_corrupt_table", refuse)
    second = corrupt(tokens_key, config)
    assert second.cache_hit and second.key == first.key and second.content_hash == first.content_hash

    runs = _data_runs()
    assert sorted(r.data.metrics["cache_hit"] for r in runs) == [0.0, 1.0]
    assert all(r.info.status == "FINISHED" and abs(r.data.metrics["masked_ratio"] - 0.3) < 0.03 for r in runs)
    stats = query(root, "SELECT * FROM corruption_stats")
    assert stats.dataset_key.tolist() == [first.key]


def test_a_generator_with_another_vocabulary_is_refused(prefect_harness, tmp_path, tokens_key, config):
    from transformers import BertTokenizerFast, DistilBertConfig, DistilBertForMaskedLM

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    foreign = tmp_path / "foreign_generator"
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(foreign)
    torch.manual_seed(0)
    cfg = DistilBertConfig(vocab_size=len(vocab), dim=16, n_layers=1, n_heads=2, hidden_dim=32)
    DistilBertForMaskedLM(cfg).save_pretrained(foreign)

    bad = config.model_copy(update={"generator": str(foreign)})
    with pytest.raises(VocabularyMismatchError, match="does not share"):
        corrupt(tokens_key, bad)
    assert [r.info.status for r in _data_runs()] == ["FAILED"]
    assert not DataRoot(get_settings().data_root).list("corruption")


def test_variants_are_independent_corruptions(root, tokens_key, config):
    plan, shards = _compute_shards(tokens_key, config.model_copy(update={"variants": 3}))
    ref = publish_corruption.fn(plan, shards)
    table = read_dataset(root, "corruption", ref.key)
    assert ref.rows == 3 * SENTENCES
    assert table.column("variant").to_pylist() == [0, 1, 2] * SENTENCES
    assert table.column("id").to_pylist() == [i for i in range(SENTENCES) for _ in range(3)]

    originals, corrupted = table.column("input_ids").to_pylist(), table.column("corrupted_ids").to_pylist()
    long_rows = distinct = 0
    for i in range(SENTENCES):
        rows = range(3 * i, 3 * i + 3)
        assert all(originals[r] == originals[3 * i] for r in rows)
        if len(originals[3 * i]) >= 12:
            long_rows += 1
            distinct += len({tuple(corrupted[r]) for r in rows}) == 3
    assert long_rows > 100 and distinct / long_rows > 0.95
