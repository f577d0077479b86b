"""prefect.yaml (the file users read and edit) against the method registry (config/methods.py): no drift."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
import yaml
from prefect.flows import Flow, load_flow_from_entrypoint

from cse.config.methods import METHODS, REGISTRY, get_method, missing_deployments
from cse.config.training import resolve_train_config
from cse.storage.settings import REPO_ROOT

DEPLOYMENTS = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]
EXPERIMENTS = ("cse.flows.seeds:seeds", "cse.flows.sweep:sweep", "cse.flows.ablate:ablate_d2cse")
# Entrypoints name the installed package's modules (`cse.flows.train:train_d2cse`), not files of the checkout: a worker
# runs them wherever `cse` is installed, and Prefect imports them once as `cse.flows.<module>` (a file-path entrypoint
# is executed as a second, separately named copy of the module, with its folder put on the import path).
MODULE_ENTRYPOINT = re.compile(r"cse\.flows\.[a-z_]+:[a-z_0-9]+")


@functools.cache
def load_flow(entrypoint: str) -> Flow:
    """The flow object a module-style entrypoint `cse.flows.<module>:<name>` names, loaded the way Prefect's worker
    loads it (`load_flow_from_entrypoint`: the installed module is imported; no folder is left on the import path)."""
    assert MODULE_ENTRYPOINT.fullmatch(entrypoint), f"{entrypoint}: not a module entrypoint cse.flows.<module>:<flow>"
    flow = load_flow_from_entrypoint(entrypoint, use_placeholder_flow=False)
    assert isinstance(flow, Flow), f"{entrypoint} is not a Prefect flow"
    return flow


# `flow-name/deployment-name` → its prefect.yaml entry (flow names read from the loaded flows)
NAMES = {f"{load_flow(entry['entrypoint']).name}/{entry['name']}": entry for entry in DEPLOYMENTS}


def test_every_deployment_is_unique_and_loads_a_flow_accepting_its_parameters():
    assert len(NAMES) == len(DEPLOYMENTS), "two deployments share a flow and name"
    assert importlib.util.find_spec("deployment_params") is None, "flows/ was left on the import path"


def test_no_flow_module_shadows_the_standard_library():
    """A file-path entrypoint would make Prefect put its folder on the import path, and processes it spawns (Dask
    nannies, torchrun) inherit it: a `flows/tokenize.py` would replace the standard library's `tokenize` in all of
    them. The entrypoints are module paths (`MODULE_ENTRYPOINT`), so this guards a file-path entrypoint added by hand."""
    clashes = sorted(p.stem for p in (REPO_ROOT / "flows").glob("*.py") if p.stem in sys.stdlib_module_names)
    assert not clashes, f"flows/ modules named like standard-library modules: {clashes}"
    for name, entry in NAMES.items():
        flow = load_flow(entry["entrypoint"])
        accepted = set(inspect.signature(flow.fn).parameters)
        unknown = set(entry.get("parameters") or {}) - accepted
        assert not unknown, f"{name}: parameters {sorted(unknown)} are not parameters of {entry['entrypoint']}"


@pytest.mark.parametrize("method", METHODS)
def test_every_preset_has_its_deployment(method):
    spec = get_method(method)
    missing = missing_deployments(spec, DEPLOYMENTS)
    assert not missing, f"prefect.yaml lacks deployments of {method}; add under `deployments:`\n{missing}"
    for preset in spec.presets:
        name = spec.deployment(preset)
        assert name in NAMES, f"preset {method}/{preset} has no deployment {name} in prefect.yaml"
        entry = NAMES[name]
        assert entry["entrypoint"] == spec.entrypoint
        assert (entry.get("parameters") or {}).get("preset", "default") == preset, f"{name} trains another preset"


def test_every_training_deployment_names_a_registry_method_and_preset():
    for entry in (e for e in DEPLOYMENTS if e["entrypoint"].startswith("cse.flows.train:")):
        function = entry["entrypoint"].split(":")[1]
        specs = [s for s in REGISTRY.values() if s.flow_function == function]
        assert len(specs) == 1, f"{entry['entrypoint']} is no registry method's training flow"
        preset = (entry.get("parameters") or {}).get("preset", "default")
        assert preset in specs[0].presets, f"deployment {entry['name']} of {specs[0].name}: unknown preset {preset!r}"
        assert entry["name"] == preset, f"deployment {entry['name']} trains preset {preset}: name them alike"
        resolve_train_config(preset, (entry.get("parameters") or {}).get("overrides"), method=specs[0].name)


def test_every_dispatch_target_exists():
    """Experiment children run `train-<method>/default` with their preset as a parameter: for every method."""
    for spec in REGISTRY.values():
        assert spec.deployment("default") in NAMES
    for entry in DEPLOYMENTS:
        if entry["entrypoint"] not in EXPERIMENTS:
            continue
        params = entry.get("parameters") or {}
        method = params.get("method", "d2cse")
        get_method(method).preset(params.get("preset", "default"))
        assert get_method(method).deployment("default") in NAMES


def test_prefect_yaml_is_what_the_registry_generates():
    """The training entries of prefect.yaml are generated (`cse prefect-yaml`): one per preset of every registry
    method, in preset order, with the description of config/presets.py's PRESET_DESCRIPTIONS; the file is byte for
    byte what the command writes."""
    from cse.ops.deployments import generated_prefect_yaml

    text = (REPO_ROOT / "prefect.yaml").read_text()
    assert generated_prefect_yaml(text) == text, "prefect.yaml's training deployments differ: run `cse prefect-yaml`"
    training = [e for e in DEPLOYMENTS if e["entrypoint"].startswith("cse.flows.train:")]
    expected = [entry for spec in REGISTRY.values() for entry in spec.deployment_entries()]
    assert [{k: e[k] for k in expected[0]} for e in training] == expected


def test_the_generator_refuses_a_file_without_its_training_block():
    from cse.ops.deployments import generated_prefect_yaml

    with pytest.raises(ValueError, match="'# Training: one flow per method'.*put both back"):
        generated_prefect_yaml("deployments:\n  # Experiments over many training runs\n")


def test_the_flows_of_flows_train_are_the_registrys():
    """Every registry method's flow is `cse.flows.train:train_<method>` (written out in flows/train.py so grep finds
    it, or built from the registry entry), named as prefect.yaml's entrypoint reads it, and its TRAIN_FLOWS entry."""
    from cse.flows import train

    source = Path(train.__file__).read_text()
    written = re.findall(r'^(train_\w+) = train_flow\(REGISTRY\["(\w+)"\]\)$', source, re.MULTILINE)
    assert written and all(function == get_method(name).flow_function for function, name in written)
    assert list(train.TRAIN_FLOWS) == list(REGISTRY) == list(METHODS)
    for name, spec in REGISTRY.items():
        flow = load_flow(spec.entrypoint)
        assert flow is train.TRAIN_FLOWS[name] is getattr(train, spec.flow_function) and flow.name == spec.flow_name
        assert flow.__name__ == spec.flow_function
    with pytest.raises(AttributeError, match="has no attribute 'train_bert'"):
        train.train_bert  # noqa: B018  (a name that is no registry method's flow)


def test_an_unknown_preset_or_method_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown d2cse preset 'nope'.*'smoke'"):
        get_method("d2cse").deployment("nope")
    with pytest.raises(ValueError, match="unknown method 'bert'.*'d2cse'"):
        get_method("bert")


def test_each_corrupt_deployment_writes_the_corruption_its_presets_jobs_read():
    """Issue 24: `corrupt/<preset>` run on its own writes the very dataset (same key settings, same tokens) that
    every corrupting method's `<preset>` job reads, so the job finds it instead of corrupting again."""
    from cse.config.stages import CorruptConfig, TokenizeConfig
    from cse.storage.keys import CORRUPTION_SETTINGS

    entries = [e for e in DEPLOYMENTS if e["entrypoint"] == "cse.flows.corrupt:corrupt"]
    assert {e["name"] for e in entries} >= {"default", "smoke"}
    for entry in entries:
        params = entry.get("parameters") or {}
        stage = CorruptConfig.model_validate(params.get("config", {})).resolved()
        tokenize = TokenizeConfig.model_validate(params.get("tokenize_config", {}))
        jobs = [
            resolve_train_config(entry["name"], method=name)
            for name, spec in REGISTRY.items()
            if spec.model_class.uses_corruption and entry["name"] in spec.presets
        ]
        assert jobs, f"corrupt/{entry['name']} is named after no preset of a method that reads corruption"
        for cfg in jobs:
            where = f"corrupt/{entry['name']} vs train-{cfg.method}/{entry['name']}"
            keyed = sorted(CORRUPTION_SETTINGS | {"generator"})
            assert stage.model_dump(include=set(keyed)) == cfg.corrupt.model_dump(include=set(keyed)), where
            assert (tokenize.tokenizer, tokenize.max_length) == (cfg.backbone, cfg.max_length), where
            assert params.get("dataset", "wiki1m") == cfg.dataset, where
