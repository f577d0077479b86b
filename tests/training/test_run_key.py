"""A job's identity (cse.training.job.run_key): model and job fields added later leave older jobs' keys unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from cse.config.methods import REGISTRY
from cse.config.training import KEY_NEUTRAL_DEFAULTS, LAUNCH_FIELDS, TrainConfig, resolve_train_config
from cse.storage.datasets import DatasetRef
from cse.storage.hashing import stable_hash
from cse.training.job import run_key

# the table's three parts: the model's fields, the corruption's, and the job's own
KEY_NEUTRAL_MODEL_DEFAULTS = KEY_NEUTRAL_DEFAULTS["model"]
KEY_NEUTRAL_CORRUPT_DEFAULTS = KEY_NEUTRAL_DEFAULTS["corrupt"]
KEY_NEUTRAL_JOB_DEFAULTS = {k: v for k, v in KEY_NEUTRAL_DEFAULTS.items() if k not in ("model", "corrupt")}
TOKENS = DatasetRef(kind="tokens", key="t", content_hash="c" * 64, rows=1, path="/nowhere", cache_hit=True)


def _later_fields(config_class) -> set[str]:
    """The listed fields `config_class` gained later: those whose default is the listed one.

    A class that had a field of that name all along (D2CSE's `discriminator_learning_rate` at 7e-6) never holds the
    listed default (DiffCSE's None), so its keys keep the field.
    """
    return {
        f.name
        for f in dataclasses.fields(config_class)
        if f.name in KEY_NEUTRAL_MODEL_DEFAULTS and f.default == KEY_NEUTRAL_MODEL_DEFAULTS[f.name]
    }


def _key_without_new_fields(cfg) -> str:
    """The key as computed before the fields of KEY_NEUTRAL_MODEL_DEFAULTS, KEY_NEUTRAL_JOB_DEFAULTS and
    KEY_NEUTRAL_CORRUPT_DEFAULTS existed."""
    config = cfg.model_dump(exclude=set(LAUNCH_FIELDS) | set(KEY_NEUTRAL_JOB_DEFAULTS))
    if config["corrupt"] is not None:
        config["corrupt"] = {k: v for k, v in config["corrupt"].items() if k not in KEY_NEUTRAL_CORRUPT_DEFAULTS}
    later = _later_fields(REGISTRY[cfg.method].config_class)
    config["model"] = {k: v for k, v in config["model"].items() if k not in later}
    return stable_hash({"config": config, "tokens": TOKENS.content_hash, "corruption": None})


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_defaults_of_later_fields_keep_the_old_key(method):
    cfg = resolve_train_config("smoke", method=method)
    assert run_key(cfg, TOKENS, None) == _key_without_new_fields(cfg)


@pytest.mark.parametrize(
    "method,field,value",
    [
        ("simcse", "dropout", 0.0),
        ("dcpcse", "train_prompts", False),
        ("d2cse", "head_learning_rate", 1e-3),
        ("diffaug", "shared_prefix", True),
    ],
)
def test_a_later_field_off_its_default_is_a_new_job(method, field, value):
    base = resolve_train_config("smoke", method=method)
    changed = resolve_train_config("smoke", {"model": {field: value}}, method=method)
    assert run_key(changed, TOKENS, None) != run_key(base, TOKENS, None)


def test_a_grad_cache_chunk_size_is_a_new_job():
    base = resolve_train_config("smoke", method="simcse")
    cached = resolve_train_config("smoke", {"grad_cache": {"chunk_size": 32}}, method="simcse")
    assert run_key(cached, TOKENS, None) != run_key(base, TOKENS, None)
    defaults = TrainConfig().model_dump()
    assert {k: defaults[k] for k in KEY_NEUTRAL_JOB_DEFAULTS} == KEY_NEUTRAL_JOB_DEFAULTS


def test_the_listed_defaults_are_the_config_classes_defaults():
    seen = set()
    for spec in REGISTRY.values():
        later = _later_fields(spec.config_class)
        seen |= later
        for f in dataclasses.fields(spec.config_class):
            if f.name in KEY_NEUTRAL_MODEL_DEFAULTS and f.name not in later:  # a field of the same name, kept in keys
                assert (spec.name, f.name) == ("d2cse", "discriminator_learning_rate"), (spec.name, f.name)
                cfg = resolve_train_config("smoke", method=spec.name)
                assert run_key(cfg, TOKENS, None) != _key_without_new_fields(
                    resolve_train_config("smoke", {"model": {f.name: f.default * 2}}, method=spec.name)
                )
    assert seen == set(KEY_NEUTRAL_MODEL_DEFAULTS)  # every listed field exists on some method at its default
