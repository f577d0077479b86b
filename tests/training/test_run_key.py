"""A job's identity (cse.training.job.run_key): model and job fields added later leave older jobs' keys unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from cse.config.methods import REGISTRY
from cse.config.training import (
    KEY_NEUTRAL_JOB_DEFAULTS,
    KEY_NEUTRAL_MODEL_DEFAULTS,
    LAUNCH_FIELDS,
    TrainConfig,
    resolve_train_config,
)
from cse.storage.datasets import DatasetRef
from cse.storage.hashing import stable_hash
from cse.training.job import run_key

TOKENS = DatasetRef(kind="tokens", key="t", content_hash="c" * 64, rows=1, path="/nowhere", cache_hit=True)


def _key_without_new_fields(cfg) -> str:
    """The key as computed before the fields of KEY_NEUTRAL_MODEL_DEFAULTS and KEY_NEUTRAL_JOB_DEFAULTS existed."""
    config = cfg.model_dump(exclude=set(LAUNCH_FIELDS) | set(KEY_NEUTRAL_JOB_DEFAULTS))
    config["model"] = {k: v for k, v in config["model"].items() if k not in KEY_NEUTRAL_MODEL_DEFAULTS}
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
        for f in dataclasses.fields(spec.config_class):
            if f.name in KEY_NEUTRAL_MODEL_DEFAULTS:
                assert f.default == KEY_NEUTRAL_MODEL_DEFAULTS[f.name], (spec.name, f.name)
                seen.add(f.name)
    assert seen == set(KEY_NEUTRAL_MODEL_DEFAULTS)  # every listed field exists on some method
