"""The method registry: one declarative entry per training method, the only list of methods in the project.

An entry names the method's model class (`models/<name>.py`, imported when first asked for), its presets
(config/presets.py) and a one-line summary. Everything else is derived from it:

- the model's typed config (`config_class`), its evaluation pooler, whether it reads the corruption stage, its phases;
- `TrainConfig.method` (the accepted names) and the validation of `TrainConfig.model`;
- the training flows `train-<name>` of flows/train.py and the experiment children's dispatch target
  (`deployment(preset)`), the comparison's rows (tasks/compare.py);
- the deployments: prefect.yaml stays the file users read and edit, and tests/flows/test_deployments.py fails when
  it and this registry disagree (every preset has its deployment, every deployment names an existing preset).

Adding a method: a module `models/<name>.py` with a `MethodConfig` dataclass and a `CSEModel` subclass whose
`method` is `<name>`, its presets in config/presets.py, one `MethodSpec` below, its deployments in prefect.yaml.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from config.finite import check_finite_fields
from config.presets import PRESETS

if TYPE_CHECKING:
    from models.method import CSEModel, MethodConfig


@dataclass(frozen=True)
class MethodSpec:
    """One training method. `model` is `"module:Class"`; the class is imported when a property needs it."""

    name: str
    title: str
    model: str
    summary: str

    @property
    def presets(self) -> Mapping[str, Mapping[str, Any]]:
        """Preset name → the TrainConfig fields that differ from the defaults (config/presets.py)."""
        return PRESETS[self.name]

    @cached_property
    def model_class(self) -> type[CSEModel]:
        module, _, cls = self.model.partition(":")
        return getattr(importlib.import_module(module), cls)

    @property
    def config_class(self) -> type[MethodConfig]:
        """The typed model config (a frozen dataclass of models/), the type of `TrainConfig.model` for this method."""
        return self.model_class.config_class

    @property
    def uses_corruption(self) -> bool:
        """Reads the corruption stage's replaced tokens (D2CSE, DiffCSE)."""
        return self.model_class.uses_corruption

    @property
    def exports_peft_adapter(self) -> bool:
        """The export stage also writes a PEFT prefix-tuning adapter (the prompt methods)."""
        return getattr(self.model_class, "exports_peft_adapter", False)

    @property
    def phases(self) -> tuple[str, ...]:
        return self.model_class.phases

    @property
    def trains_prefix_phase(self) -> bool:
        """Trains a prefix phase on NLI before the main one (DiffAug), so needs NLI tokens whatever its dataset."""
        return "prefix" in self.phases

    def stages(self, supervised: bool, aux_nli: bool = False) -> tuple[str, ...]:
        """The pipeline stages a job of this method runs, in order."""
        data = "nli" if supervised else "wiki1m"
        out = [f"ingest:{data}", f"tokenize:{data}"]
        if (self.trains_prefix_phase or aux_nli) and not supervised:
            out += ["ingest:nli", "tokenize:nli"]
        if self.uses_corruption:
            out.append("corrupt")
        return (*out, "train", "evaluate")

    @property
    def flow_name(self) -> str:
        return f"train-{self.name}"

    @property
    def flow_function(self) -> str:
        """The flow object's name in flows/train.py (prefect.yaml's entrypoint `flows/train.py:<flow_function>`)."""
        return f"train_{self.name}"

    @property
    def entrypoint(self) -> str:
        return f"flows/train.py:{self.flow_function}"

    def deployment(self, preset: str = "default") -> str:
        """The deployment that trains `preset` (`train-<name>/<preset>`); experiment children run `default`."""
        self.preset(preset)
        return f"{self.flow_name}/{preset}"

    def preset(self, name: str) -> Mapping[str, Any]:
        if name not in self.presets:
            raise ValueError(f"unknown {self.name} preset {name!r}; known: {sorted(self.presets)}")
        return self.presets[name]

    def model_config(self, backbone: str, fields: Mapping[str, Any] | None = None) -> MethodConfig:
        """The typed model config from its fields (unknown keys and wrong types refused, defaults filled in)."""
        fields = dict(fields or {})
        if "backbone" in fields:
            raise ValueError(f"{self.name}: `backbone` is a top-level training field, not a `model` field")
        known = {f.name for f in dataclasses.fields(self.config_class)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown {self.config_class.__name__} keys {unknown}; known: {sorted(known - {'backbone'})}")
        # types checked ("16" → 16, "x" refused) before the dataclass's own checks run
        config = _adapter(self.config_class).validate_python({"backbone": backbone, **fields})
        return check_finite_fields(config, f"model ({self.config_class.__name__})")  # inf / nan refused (config/finite.py)

    def build_model(self, config: MethodConfig, backbone=None, tokenizer=None, backbone_name: str | None = None) -> CSEModel:
        """The model from its typed config (`backbone_name` replaces the config's backbone name: the job's own)."""
        if backbone_name is not None:
            config = replace(config, backbone=backbone_name)
        return self.model_class(config, backbone=backbone, tokenizer=tokenizer)


@lru_cache(maxsize=None)
def _adapter(config_class: type) -> TypeAdapter:
    return TypeAdapter(config_class)


REGISTRY: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("d2cse", "D2CSE", "models.d2cse:D2CSE",
                   "deep prompts on a frozen PLM that is also the CRTD discriminator (optional [CLS] prompt)"),
        MethodSpec("simcse", "SimCSE", "models.simcse:SimCSE", "dropout views, full fine-tuning (unsup and sup)"),
        MethodSpec("dcpcse", "DCPCSE", "models.dcpcse:DCPCSE", "deep prompts on a frozen PLM (optional MLM auxiliary loss)"),
        MethodSpec("diffcse", "DiffCSE", "models.diffcse:DiffCSE",
                   "trainable encoder + trainable discriminator, fixed DistilBERT generator"),
        MethodSpec("diffaug", "DiffAug", "models.diffaug:DiffAug",
                   "two prefix modules: NLI prefix tuning, then joint contrastive tuning"),
    )
}
METHODS: tuple[str, ...] = tuple(REGISTRY)
if set(PRESETS) != set(REGISTRY):  # the presets' method keys are the registry's names
    raise RuntimeError(f"config/presets.py names methods {sorted(PRESETS)}, the registry {sorted(REGISTRY)}")


def get_method(name: str) -> MethodSpec:
    """The registry entry of `name` (a clear error naming the known methods otherwise)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known: {list(METHODS)}") from None


def build_model(method: str, model_config: dict[str, Any], backbone=None, tokenizer=None) -> CSEModel:
    """The model of `method` from a config dict with its `backbone` key (tests, benchmarks)."""
    spec = get_method(method)
    fields = dict(model_config)
    return spec.build_model(spec.model_config(fields.pop("backbone"), fields), backbone=backbone, tokenizer=tokenizer)


def model_class(method: str) -> type[CSEModel]:
    """The model class of `method` (`get_method(method).model_class`)."""
    return get_method(method).model_class
