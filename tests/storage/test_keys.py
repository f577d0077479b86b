"""Dataset keys and run keys (storage/keys.py): the compatibility contract.

The golden keys below were computed on the tree before the key derivation moved into storage/keys.py, from the
stages' own functions (tasks/ingest.py, tasks/transfer_data.py, tasks/tokenize.py, tasks/fit_generator.py,
tasks/corrupt.py, training/job.py). A key that changes makes every dataset or finished job built under it a cache
miss: if one of these fails, the change is breaking, not the test. Add a parameter the way the module docstring says
(it enters the key only off its default); bump a stage's schema version only to rebuild its datasets on purpose.
"""

from __future__ import annotations

import pytest

from cse.config.stages import CorruptConfig, GeneratorConfig
from cse.config.training import resolve_train_config
from cse.storage import keys
from cse.storage.datasets import DatasetRef
from cse.storage.hashing import stable_hash
from cse.storage.keys import (
    CORRUPTION_SETTINGS,
    corruption_key,
    generator_key,
    ingest_key,
    tokens_key,
    transfer_key,
    without_defaults,
)
from cse.training.job import run_key

H1, H2, H3 = "a" * 64, "b" * 64, "c" * 64
GEN = {"name": "distilbert-base-uncased", "config_sha256": "c"}
BACKBONE = {"name": "packaged:minilm", "config_sha256": "d" * 64}


def _generator(tokens_hash: str, fingerprint: str | None, backbone: dict, config: GeneratorConfig) -> str:
    """What the fit-generator stage passes (tasks/fit_generator.py)."""
    return generator_key(tokens_hash, fingerprint, backbone, config.model_dump(exclude={"device"}))


def _corruption(
    tokens_hash: str, fingerprint: str | None, config: CorruptConfig, generator: dict, precision: str
) -> str:
    """What the corrupt stage passes (tasks/corrupt.py)."""
    return corruption_key(
        tokens_hash, fingerprint, generator, precision, **config.model_dump(include=CORRUPTION_SETTINGS)
    )


def test_ingest_keys():
    assert ingest_key("wiki", H1) == "aae483615da07d12"
    assert ingest_key("nli", H2) == "fa8f5ec50bbf0e25"
    assert ingest_key("sts", H3) == "c46eddcb8448a8da"
    assert ingest_key("wiki1m", H1) != ingest_key("wiki", H1)  # the dataset's name is part of it


def test_transfer_and_tokens_keys():
    assert transfer_key(H1) == "6d63eb96caf9e3ed" and transfer_key(H2) == "3c9f92e53e0974c5"
    assert tokens_key(H1, "fp1", 32) == "681548c9a6ad1cc0"
    assert tokens_key(H2, "fp2", 128) == "47ccca66159af6cf"
    assert tokens_key(H1, "fp1", 128) == "f5bdc65bcb48d40f"


@pytest.mark.parametrize(
    "tokens_hash,fingerprint,backbone,config,key",
    [
        (H1, "fp1", BACKBONE, GeneratorConfig(), "772e3df431bb168d"),
        (H1, "fp1", BACKBONE, GeneratorConfig(seed=3, mask_ratio=0.2, max_steps=50), "4f33f177bb04205b"),
        (
            H1,
            "fp1",
            BACKBONE,
            GeneratorConfig(baseline_generator=None, device="cpu", bias_init="zeros"),
            "71fdf1046b89b279",
        ),
        (H2, None, {"name": "random-init:distilbert-tiny"}, GeneratorConfig(), "4f922fbe81730d9f"),
    ],
    ids=["default", "seed-mask-steps", "no-baseline", "other-tokens"],
)
def test_generator_keys(tokens_hash, fingerprint, backbone, config, key):
    assert _generator(tokens_hash, fingerprint, backbone, config) == key


@pytest.mark.parametrize(
    "tokens_hash,fingerprint,config,generator,precision,key",
    [
        (H1, "fp1", CorruptConfig().resolved(), GEN, "fp32", "c1e06db85040cd9a"),
        (H1, "fp1", CorruptConfig(variants=4, seed=42), GEN, "fp32", "c1e06db85040cd9a"),  # the same, spelled out
        (
            H1,
            "fp1",
            CorruptConfig(variants=8, seed=7, mask_ratio=0.15, shard_size=1000),
            GEN,
            "bf16",
            "a75900d66c97ae2a",
        ),
        (H1, "fp1", CorruptConfig(variants=2, seed=1, positions="all"), GEN, "bf16", "1ae1a73f70d856d9"),
        (
            H1,
            "fp1",
            CorruptConfig(variants=2, seed=0, mode="unigram", mask_ratio=0.15, shard_size=100),
            {"name": "unigram"},
            "fp32",
            "10e18cb02766142b",
        ),
        (
            H1,
            "fp1",
            CorruptConfig(variants=1, seed=5, mode="sample", generator_dropout=True, batch_size=8, device="cpu"),
            {"name": "generator:abc", "content_hash": H3},
            "fp32",
            "385fd3724f23ca9e",
        ),
        (H2, None, CorruptConfig(variants=4, seed=42), GEN, "fp32", "87cbc3edce306392"),
    ],
    ids=["default", "explicit-default", "v8-mask015", "all-positions", "unigram", "sample-dropout", "other-tokens"],
)
def test_corruption_keys(tokens_hash, fingerprint, config, generator, precision, key):
    assert _corruption(tokens_hash, fingerprint, config, generator, precision) == key


TOKENS = DatasetRef(kind="tokens", key="t", content_hash=H1, rows=1, path="/nowhere", cache_hit=True)
CORRUPTION = DatasetRef(kind="corruption", key="c", content_hash=H2, rows=1, path="/nowhere", cache_hit=True)
NLI = DatasetRef(kind="tokens", key="n", content_hash=H3, rows=1, path="/nowhere", cache_hit=True)


@pytest.mark.parametrize(
    "method,overrides,corruption,nli,key",
    [
        ("simcse", {}, None, None, "396b15dcbad8cd53"),
        ("d2cse", {"learning_rate": 0.02}, CORRUPTION, None, "687359baf56621b4"),  # the smoke preset's former rate
        ("dcpcse", {"nproc_per_node": 2}, None, None, "20629753bd318dc7"),  # launch fields stay out of the key
        ("diffaug", {}, None, NLI, "52977bb09104b740"),
        (
            "simcse",
            {"model": {"dropout": 0.0}},
            None,
            None,
            "f13ebf853b761837",
        ),  # a model field added later, off default
    ],
)
def test_run_keys(method, overrides, corruption, nli, key):
    assert run_key(resolve_train_config("smoke", overrides, method=method), TOKENS, corruption, nli) == key


# ------------------------------------------------------------------------------------------------ the rule
def test_a_parameter_added_later_enters_the_key_only_off_its_default(monkeypatch):
    config = GeneratorConfig().model_dump(exclude={"device"})
    before = generator_key(H1, "fp1", BACKBONE, config)
    monkeypatch.setitem(keys.GENERATOR_ADDED_LATER, "new_knob", 0.5)  # a field added to GeneratorConfig, default 0.5
    assert generator_key(H1, "fp1", BACKBONE, {**config, "new_knob": 0.5}) == before
    assert generator_key(H1, "fp1", BACKBONE, {**config, "new_knob": 0.7}) != before
    assert without_defaults({"a": 1, "b": None, "c": "x"}, {"b": None, "c": "y"}) == {"a": 1, "c": "x"}
    # a section: its listed fields at their defaults left out, the section itself once nothing of it is left
    sections = {"model": {"dropout": None}, "grad_cache": {"chunk_size": None}}
    assert without_defaults({"model": {"dropout": None, "lr": 1}, "grad_cache": {"chunk_size": None}}, sections) == {
        "model": {"lr": 1}
    }
    assert without_defaults({"model": None, "grad_cache": {"chunk_size": 8}}, sections) == {
        "model": None,
        "grad_cache": {"chunk_size": 8},
    }


def test_positions_hard_and_nli_tokens_were_added_later():
    """`positions` and `hard` (corruption) and `nli_tokens` (runs) at their defaults give the keys of the formulas
    without them; `corrupt.hard` at its default leaves a job's run key as it was."""
    cfg = CorruptConfig(variants=4, seed=42)
    old = stable_hash(
        {
            "stage": "corruption",
            "input": H1,
            "generator": GEN,
            "tokenizer": "fp1",
            "mask_ratio": 0.3,
            "mode": "argmax",
            "variants": 4,
            "seed": 42,
            "shard_size": 50_000,
            "generator_dropout": True,
            "precision": "fp32",
            "v": 1,
        }
    )
    assert _corruption(H1, "fp1", cfg, GEN, "fp32") == old
    assert _corruption(H1, "fp1", cfg.model_copy(update={"positions": "all"}), GEN, "fp32") != old
    assert _corruption(H1, "fp1", cfg.model_copy(update={"hard": True}), GEN, "fp32") != old  # `hard` too
    with pytest.raises(ValueError, match="mode 'unigram' has none"):
        CorruptConfig(mode="unigram", hard=True)
    d2cse = resolve_train_config("smoke", {"learning_rate": 0.02}, method="d2cse")  # the job keyed before `hard`
    hard = resolve_train_config("smoke", {"learning_rate": 0.02, "corrupt": {"hard": True}}, method="d2cse")
    assert run_key(d2cse, TOKENS, CORRUPTION) == "687359baf56621b4" != run_key(hard, TOKENS, CORRUPTION)
    config = {"any": "config"}
    assert keys.run_key(config, H1, None) == stable_hash({"config": config, "tokens": H1, "corruption": None})
    assert keys.run_key(config, H1, None, H3) != keys.run_key(config, H1, None)


def test_every_setting_of_the_keyed_configs_is_decided():
    """A new field of CorruptConfig or GeneratorConfig must be placed: in the key (CORRUPTION_SETTINGS; for the
    generator, listed with its default in GENERATOR_ADDED_LATER) or deliberately out of it."""
    out_of_corruption_key = {"generator", "bf16", "batch_size", "device"}  # identity / precision instead; no effect
    assert set(CorruptConfig.model_fields) == CORRUPTION_SETTINGS | out_of_corruption_key
    first_generator_fields = {
        "backbone",
        "baseline_generator",
        "batch_size",
        "bias_init",
        "chunk_batches",
        "device",
        "epochs",
        "eval_every",
        "heldout_fraction",
        "lr",
        "mask_ratio",
        "max_heldout",
        "max_steps",
        "reuse",
        "seed",
        "split_seed",
        "warmup_ratio",
        "weight_decay",
    }
    fields = GeneratorConfig.model_fields
    assert set(fields) == first_generator_fields | set(keys.GENERATOR_ADDED_LATER)
    assert all(fields[k].default == v for k, v in keys.GENERATOR_ADDED_LATER.items())
