"""The fit-generator stage on a toy corpus with a tiny frozen BERT, and the corruption stage using its output
(by dataset key, by folder) or no generator at all (mode unigram)."""

from __future__ import annotations

import json

import mlflow
import numpy as np
import pytest
import torch
from transformers import AutoModelForMaskedLM

import cse.models.generator_cache as generator_cache
import cse.tasks.fit_generator as fit_tasks
from cse.config.stages import CorruptConfig, GeneratorConfig
from cse.storage.catalog import query
from cse.storage.datasets import read_dataset
from cse.storage.generators import HELDOUT_FILE
from cse.storage.keys import CORRUPTION_SETTINGS, corruption_key
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest
from cse.storage.settings import get_settings
from cse.tasks.corrupt import corrupt_shard, plan_corruption, publish_corruption
from cse.tasks.fit_generator import fit_generator
from cse.tracking.store import configure_mlflow
from tests.tasks.test_corrupt import write_tokens

# Two sentence types of 10 word pieces: type k puts token BASE + 20 k + i at position i. Position and the unmasked
# neighbours (the type) determine every token; the most frequent token covers 1/20 of them.
BASE, SENTENCES, LENGTH = 2000, 240, 10


@pytest.fixture
def root() -> DataRoot:
    return DataRoot(get_settings().data_root)


@pytest.fixture
def toy_tokens(root, tokenizer) -> str:
    ids = [[101, *(BASE + 20 * (s % 2) + i for i in range(LENGTH)), 102] for s in range(SENTENCES)]
    return write_tokens(root, "toy-tokens", tokenizer, ids)


@pytest.fixture
def gen_config(tiny_bert_dir) -> GeneratorConfig:
    return GeneratorConfig(
        backbone=str(tiny_bert_dir),
        heldout_fraction=0.2,
        batch_size=16,
        epochs=3,
        reuse=4,
        chunk_batches=4,
        lr=1e-2,
        warmup_ratio=0.0,
        eval_every=50,
        device="cpu",
    )


def _runs():
    configure_mlflow()
    return mlflow.search_runs(experiment_names=["data"], output_format="list")


def test_fitted_head_learns_the_pattern_publishes_a_masked_lm_and_is_reused(root, toy_tokens, gen_config, monkeypatch):
    ref = fit_generator.fn(toy_tokens, gen_config)
    assert ref.kind == "generator" and not ref.cache_hit
    m = root.require("generator", ref.key)
    acc = m.stats["heldout_top1"]
    assert set(acc) == {"fitted", "unigram_argmax", "unigram_sample", "random_init"}
    assert acc["unigram_argmax"] < 0.1 and acc["fitted"] > acc["unigram_argmax"] + 0.3, acc
    assert m.stats["heldout_sentences"] == 48 and m.stats["train_rows"] == 192
    assert m.stats["steps"] == 3 * 4 * 12 and m.stats["history"][0]["step"] == 0

    heldout = json.loads((root.dataset_dir("generator", ref.key) / HELDOUT_FILE).read_text())
    assert len(heldout["ids"]) == 48 and heldout["split_seed"] == 0 and heldout["tokens_key"] == toy_tokens
    model = AutoModelForMaskedLM.from_pretrained(ref.path)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert {"config.json", "model.safetensors", "tokenizer.json", HELDOUT_FILE} <= set(m.files)

    run = _runs()[0]
    assert run.info.run_name == "fit-generator" and run.info.status == "FINISHED"
    assert run.data.metrics["heldout_top1_fitted"] == pytest.approx(acc["fitted"])
    assert run.data.tags["generator"] == f"generator:{ref.key}"
    table = mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/generator_accuracy.md")
    assert "fitted generator" in table and "random-init generator" in table
    assert query(root, "SELECT kind FROM manifests WHERE kind = 'generator'").shape[0] == 1

    def refuse(*args, **kwargs):
        raise AssertionError("a cache hit must not fit again")

    monkeypatch.setattr(fit_tasks, "_fit", refuse)
    again = fit_generator.fn(toy_tokens, gen_config)
    assert again.cache_hit and again.key == ref.key and again.content_hash == ref.content_hash
    assert sorted(r.data.metrics["cache_hit"] for r in _runs()) == [0.0, 1.0]

    with pytest.raises(AssertionError, match="must not fit"):  # another config is another generator
        fit_generator.fn(toy_tokens, gen_config.model_copy(update={"max_steps": 5}))


def test_a_damaged_generator_is_quarantined_and_refitted(root, toy_tokens, gen_config):
    small = gen_config.model_copy(update={"max_steps": 4, "baseline_generator": None})
    ref = fit_generator.fn(toy_tokens, small)
    weights = root.dataset_dir("generator", ref.key) / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:-100])
    again = fit_generator.fn(toy_tokens, small)
    assert not again.cache_hit and again.key == ref.key
    assert list((root.root / "quarantine" / "generator").iterdir())
    assert weights.stat().st_size == size and again.content_hash == ref.content_hash  # the same fit, byte for byte


def _corrupt(tokens_key: str, config: CorruptConfig):
    plan = plan_corruption.fn(tokens_key, config)
    return plan, publish_corruption.fn(plan, [corrupt_shard.fn(plan, i) for i in range(plan.n_shards)])


def test_corruption_takes_the_generator_by_key_or_folder_and_unigram_needs_none(
    root, toy_tokens, gen_config, monkeypatch
):
    ref = fit_generator.fn(toy_tokens, gen_config.model_copy(update={"max_steps": 4, "baseline_generator": None}))
    by_key = CorruptConfig(generator=f"generator:{ref.key}", variants=1, shard_size=100, batch_size=32, device="cpu")
    plan, corrupted = _corrupt(toy_tokens, by_key)
    assert plan.generator == {"name": f"generator:{ref.key}", "content_hash": ref.content_hash}
    assert corrupted.rows == SENTENCES and not corrupted.cache_hit
    by_path = plan_corruption.fn(toy_tokens, by_key.model_copy(update={"generator": ref.path}))
    assert by_path.key == plan.key and by_path.cached
    with pytest.raises(FileNotFoundError, match="run the fit-generator stage"):
        plan_corruption.fn(toy_tokens, by_key.model_copy(update={"generator": "generator:nope"}))

    def refuse(*args, **kwargs):
        raise AssertionError("mode unigram loads no generator")

    monkeypatch.setattr(generator_cache, "load_masked_lm", refuse)
    unigram = by_key.model_copy(update={"mode": "unigram", "generator": "distilbert-base-uncased"})
    uplan, uref = _corrupt(toy_tokens, unigram)
    assert uplan.generator == {"name": "unigram"} and uref.key not in (plan.key,)
    counts = np.array(uplan.unigram_counts)
    assert counts[101] == counts[102] == 0 and counts[BASE] == SENTENCES // 2 and counts.sum() == SENTENCES * LENGTH
    table = read_dataset(root, "corruption", uref.key)
    corrupted_ids = np.concatenate(table.column("corrupted_ids").to_numpy(zero_copy_only=False))
    labels = np.concatenate(table.column("labels").to_numpy(zero_copy_only=False)).astype(bool)
    replaced = corrupted_ids[labels]
    assert len(replaced) > 100 and np.isin(replaced, np.flatnonzero(counts)).all()  # corpus tokens only
    assert _corrupt(toy_tokens, unigram.model_copy(update={"seed": 1}))[1].key != uref.key
    again = plan_corruption.fn(toy_tokens, unigram.model_copy(update={"generator": "another-name"}))
    assert again.key == uref.key and again.cached  # the generator name does not matter to unigram


def test_keys_of_the_generator_modes_are_unchanged():
    """A corruption key made before mode unigram existed stays the same (datasets already built stay cache hits)."""
    tokens = Manifest(
        kind="tokens", key="t", rows=1, content_hash="abc", files=[], params={"tokenizer_fingerprint": "f"}
    )
    key = corruption_key(
        tokens.content_hash,
        tokens.params.get("tokenizer_fingerprint"),
        {"name": "distilbert-base-uncased", "config_sha256": "c"},
        "fp32",
        **CorruptConfig(variants=4, seed=42).model_dump(include=CORRUPTION_SETTINGS),
    )
    assert key == "fbc1433b9a5de335"


def test_full_fine_tuning_unfreezes_the_backbone_and_keeps_the_default_key(root, toy_tokens, gen_config, tiny_bert_dir):
    """`backbone_lr`: the whole masked LM learns (the encoder's weights move, the decoder stays tied) and it learns the
    pattern; at its default (None) the field leaves every earlier generator key as it was."""
    from cse.storage.keys import generator_key

    tuned = gen_config.model_copy(update={"backbone_lr": 1e-3, "reuse": 1, "epochs": 4, "baseline_generator": None})
    ref = fit_generator.fn(toy_tokens, tuned)
    m = root.require("generator", ref.key)
    acc = m.stats["heldout_top1"]
    assert acc["fitted"] > acc["unigram_argmax"] + 0.2, acc  # (measured: 0.31 against 0.015 after 48 steps)
    assert m.stats["steps"] == 4 * 12 and m.params["config"]["backbone_lr"] == 1e-3
    model = AutoModelForMaskedLM.from_pretrained(ref.path)
    start = AutoModelForMaskedLM.from_pretrained(tiny_bert_dir)
    moved = model.base_model.encoder.layer[0].attention.self.query.weight
    assert not torch.equal(moved, start.base_model.encoder.layer[0].attention.self.query.weight)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight

    with pytest.raises(ValueError, match="reuse must be 1"):
        gen_config.model_copy(update={"backbone_lr": 1e-3}).model_validate(
            gen_config.model_dump() | {"backbone_lr": 1e-3, "reuse": 4}
        )
    identity = {"name": "b", "config_hash": "c"}
    plain = gen_config.model_dump(exclude={"device"})
    assert generator_key("t", "f", identity, plain) == generator_key("t", "f", identity, plain | {"backbone_lr": None})
    assert generator_key("t", "f", identity, plain) != generator_key("t", "f", identity, plain | {"backbone_lr": 1e-3})
