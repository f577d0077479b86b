"""The method registry (config/methods.py) and the typed model config of TrainConfig."""

from __future__ import annotations

import dataclasses

import pytest

from cse.config.methods import METHODS, REGISTRY, build_model, get_method
from cse.config.presets import PRESETS
from cse.config.training import TrainConfig, resolve_train_config
from cse.models.checkpoint import CheckpointError, model_class_of
from cse.storage.hashing import stable_hash
from cse.storage.settings import REPO_ROOT


def test_the_registry_is_the_presets_methods():
    """A method is a name of PRESETS with its module models/methods/<name>.py: the registry lists nothing else."""
    assert METHODS == tuple(PRESETS) == tuple(REGISTRY) and len(REGISTRY) == len(PRESETS)
    modules = {p.stem for p in (REPO_ROOT / "models" / "methods").glob("*.py")}
    assert set(METHODS) <= modules
    for name, spec in REGISTRY.items():
        assert spec.presets is PRESETS[name] and "default" in spec.presets and "smoke" in spec.presets
        assert spec.title and spec.summary and name in spec.title.lower()
    with pytest.raises(KeyError):
        REGISTRY["bert"]


@pytest.mark.parametrize("method", METHODS)
def test_each_entry_lives_where_checkpoints_find_it(method):
    """A checkpoint names its method only; its class is found in models/methods/<method>.py (model_class_of)."""
    spec = get_method(method)
    assert spec.model.split(":")[0] == f"cse.models.methods.{method}"
    assert spec.model_class.method == method
    assert model_class_of(method) is spec.model_class


def test_model_class_of_refuses_what_is_no_method():
    with pytest.raises(CheckpointError, match="no module models/methods/bert.py"):
        model_class_of("bert")
    with pytest.raises(CheckpointError, match="not a method name"):
        model_class_of("../x")


def test_derived_facts():
    corrupting = {"d2cse": True, "diffcse": True, "simcse": False, "dcpcse": False, "diffaug": False}
    assert {m: get_method(m).uses_corruption for m in corrupting} == corrupting
    assert get_method("diffaug").phases == ("prefix", "joint") and get_method("d2cse").phases == ("main",)
    assert get_method("d2cse").stages(supervised=False) == (
        "ingest:wiki1m",
        "tokenize:wiki1m",
        "corrupt",
        "train",
        "evaluate",
    )
    assert get_method("diffaug").stages(supervised=False) == (
        "ingest:wiki1m",
        "tokenize:wiki1m",
        "ingest:nli",
        "tokenize:nli",
        "train",
        "evaluate",
    )
    assert get_method("simcse").stages(supervised=True) == ("ingest:nli", "tokenize:nli", "train", "evaluate")
    assert (get_method("dcpcse").flow_name, get_method("dcpcse").entrypoint) == (
        "train-dcpcse",
        "cse.flows.train:train_dcpcse",
    )


def test_the_model_classes_carry_papers_adapters_and_ablations():
    for spec in REGISTRY.values():
        assert spec.paper and spec.bibtex.startswith("@") and spec.title.lower() in spec.bibtex.lower()
        assert spec.cites[0] == spec.name and set(spec.cites) <= set(REGISTRY)
    assert get_method("d2cse").cites == ("d2cse", "dcpcse", "diffcse", "simcse")
    facts = {  # method: (PEFT adapter, auxiliary NLI batches, ablations)
        "d2cse": (True, False, True),
        "simcse": (False, False, False),
        "dcpcse": (True, False, False),
        "diffcse": (False, False, False),
        "diffaug": (True, True, False),
    }
    specs = {m: get_method(m) for m in facts}
    assert {m: (s.exports_peft_adapter, s.accepts_aux_nli, bool(s.ablations)) for m, s in specs.items()} == facts
    d2cse = get_method("d2cse")
    assert set(d2cse.ablations) == set(d2cse.published.ablation) == {"a", "b", "c", "d"}
    assert (
        d2cse.published.sts[("bert-base", "unsup")]["sts_avg"] == 79.02
        and not get_method("diffaug").published.parameters
    )


def test_the_model_field_is_the_methods_typed_config():
    cfg = resolve_train_config("smoke", {"model": {"prefix_len": "12"}}, method="d2cse")
    assert isinstance(cfg.model, get_method("d2cse").config_class)
    assert cfg.model.prefix_len == 12 and cfg.model.backbone == cfg.backbone == "packaged:minilm"
    dumped = cfg.model_dump()
    assert "backbone" not in dumped["model"] and dumped["model"]["prefix_len"] == 12
    again = TrainConfig.model_validate(dumped)
    assert again == cfg and stable_hash(again.model_dump()) == stable_hash(dumped)


@pytest.mark.parametrize(
    "model, message",
    [
        ({"prefix_len": "x"}, "valid integer"),
        ({"prefix_len": 0}, "prefix_len must be >= 1"),
        ({"nope": 1}, r"unknown D2CSEModelConfig keys \['nope'\]"),
        ({"backbone": "roberta-base"}, "top-level training field"),
    ],
)
def test_bad_model_fields_are_refused(model, message):
    with pytest.raises(ValueError, match=message):
        resolve_train_config("default", {"model": model})


def test_another_methods_fields_are_refused():
    with pytest.raises(ValueError, match="unknown SimCSEConfig keys"):
        resolve_train_config("default", {"model": {"prefix_len": 8}}, method="simcse")


def test_the_jobs_backbone_is_the_only_one():
    cfg = resolve_train_config("smoke", method="simcse")
    assert cfg.model.backbone == "packaged:minilm"
    swapped = TrainConfig.model_validate({**cfg.model_dump(), "backbone": "bert-base-uncased"})
    assert swapped.model.backbone == "bert-base-uncased"
    assert dataclasses.replace(cfg.model, temperature=0.1).temperature == 0.1


def test_build_model_from_a_dict(tiny_bert_dir):
    model = build_model("simcse", {"backbone": str(tiny_bert_dir), "temperature": 0.1})
    assert model.method == "simcse" and model.config.temperature == 0.1 and model.hidden_size == 32
