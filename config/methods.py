"""The method registry: one declarative entry per training method, the only list of methods in the project.

A method is one unit: a model module `models/methods/<name>.py`, one `MethodSpec` entry below and its presets in
config/presets.py (plus, for a published method, its rows in config/published.py). Everything per method is a field
of the entry or an attribute/method of the model class, read through the entry:

- the typed model config (`config_class`), whether it reads the corruption stage, its phases, whether it takes
  auxiliary NLI batches (`accepts_aux_nli`), hence its pipeline stages (`stages()`);
- `TrainConfig.method` (the accepted names) and the validation of `TrainConfig.model`;
- its paper and BibTeX (`paper`, `bibtex`, `cites`: the model card's citation), its published rows (`published`),
  its ablation variants (`ablations`, flows/ablate.py), whether its export includes a PEFT adapter
  (`exports_peft_adapter`: the model class defines `peft_plan`);
- the training flow `train-<name>` of flows/train.py and the experiment children's dispatch target
  (`deployment(preset)`), the comparison's rows (tasks/compare.py);
- the deployments: prefect.yaml stays the file users read and edit, and tests/flows/test_deployments.py fails when
  it and this registry disagree, printing the entries to add (`missing_deployments`).

Adding a method (docs/architecture.md has the recipe; tests/config/test_toy_method.py adds a toy one):
1. `models/methods/<name>.py`: a `MethodConfig` dataclass and a `CSEModel` subclass with `method = "<name>"`, its
   `config_class`, `paper`, `bibtex` (and `builds_on`, `peft_plan`, `ablations` where they apply);
2. its presets in config/presets.py (at least `default`);
3. one `MethodSpec` below;
4. its flow's line in flows/train.py (`train_<name> = train_flow(REGISTRY["<name>"])`, and its `TRAIN_FLOWS` entry);
5. the prefect.yaml entries the deployment test prints (`missing_deployments(spec, deployments)`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from cse.config import published
from cse.config.finite import check_finite_fields, refuse_booleans
from cse.config.limits import cut
from cse.config.presets import PRESETS
from cse.config.suggest import did_you_mean

if TYPE_CHECKING:
    from cse.models.method import CSEModel, MethodConfig


DEFAULT_METHOD = "d2cse"  # the method a job, a sweep or a seed study trains when none is named


@dataclass(frozen=True)
class MethodSpec:
    """One training method of the registry; every other per-method fact is read from its model class.

    Args:
        name: the registry name (lowercase): `TrainConfig.method`, the `train-<name>` flow, MLflow experiment and
            registered-model names, the checkpoint's `method`.
        title: the name as the paper writes it (model cards, tables).
        model: the model class as `"module:Class"` (`cse.models.methods.<name>:<Class>`), imported when a property needs it.
        summary: one line on what trains and how; the flow's description and the model card's first sentence.

    Examples:
        >>> from cse.config.methods import get_method
        >>> spec = get_method("dcpcse")
        >>> spec.deployment("sup")
        'train-dcpcse/sup'
        >>> spec.exports_peft_adapter  # the model class defines peft_plan
        True
        >>> spec.stages(supervised=False)
        ('ingest:wiki1m', 'tokenize:wiki1m', 'train', 'evaluate')
        >>> spec.cites  # the model card cites DCPCSE's paper, then SimCSE's
        ('dcpcse', 'simcse')
        >>> spec.model_config("packaged:minilm", {"prefix_len": 8}).prefix_len
        8
    """

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
        """The export stage also writes a PEFT prefix-tuning adapter: the model class defines `peft_plan` (the
        prompt methods)."""
        return self.model_class.exports_peft_adapter

    @property
    def phases(self) -> tuple[str, ...]:
        return self.model_class.phases

    @property
    def accepts_aux_nli(self) -> bool:
        """Takes NLI rows batched beside the main ones (`TrainConfig.aux_nli_batch_size`; DiffAug's semi w/ aux)."""
        return self.model_class.accepts_aux_nli

    @property
    def paper(self) -> str:
        """The method's paper in one line (authors, year, title, venue), from the model class."""
        return self.model_class.paper

    @property
    def bibtex(self) -> str:
        """The BibTeX entry of the method's paper, from the model class."""
        return self.model_class.bibtex

    @property
    def cites(self) -> tuple[str, ...]:
        """The methods whose papers a model card of this one cites: itself first, then those it builds on."""
        return (self.name, *(m for m in self.model_class.builds_on if m != self.name))

    @property
    def ablations(self) -> Mapping[str, Mapping[str, Any]]:
        """The paper's ablation variants (variant → model fields), from the model class; empty when it has none."""
        return self.model_class.ablations

    @property
    def published(self) -> published.PublishedRows:
        """The papers' numbers for this method (config/published.py), by table."""
        return published.rows_of(self.name)

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
        """The flow object's name in flows/train.py (prefect.yaml's entrypoint `cse.flows.train:<flow_function>`)."""
        return f"train_{self.name}"

    @property
    def entrypoint(self) -> str:
        return f"cse.flows.train:{self.flow_function}"

    def deployment(self, preset: str = "default") -> str:
        """The deployment that trains `preset` (`train-<name>/<preset>`); experiment children run `default`."""
        self.preset(preset)
        return f"{self.flow_name}/{preset}"

    def deployment_entries(self) -> list[dict[str, Any]]:
        """The prefect.yaml deployments this method needs: one per preset, named like it (without `work_pool`, which
        prefect.yaml gives every deployment as `*local_pool`)."""
        return [
            {
                "name": preset,
                "entrypoint": self.entrypoint,
                "description": f"{self.title}, preset {preset} (config/presets.py): {self.summary}.",
                "tags": ["train", self.name, *(["smoke"] if preset == "smoke" else [])],
                "parameters": {"preset": preset},
            }
            for preset in self.presets
        ]

    def preset(self, name: str) -> Mapping[str, Any]:
        if name not in self.presets:
            raise ValueError(
                f"unknown {self.name} preset {name!r}{did_you_mean([name], self.presets)}; known: {sorted(self.presets)}"
            )
        return self.presets[name]

    def model_config(self, backbone: str, fields: Mapping[str, Any] | None = None) -> MethodConfig:
        """The typed model config from its fields (unknown keys and wrong types refused, defaults filled in)."""
        fields = dict(fields or {})
        if "backbone" in fields:
            raise ValueError(f"{self.name}: `backbone` is a top-level training field, not a `model` field")
        known = {f.name for f in dataclasses.fields(self.config_class)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(
                f"unknown {self.config_class.__name__} keys {cut([cut(k, 60) for k in unknown[:10]])}"
                f"{f' and {len(unknown) - 10:,d} more' if len(unknown) > 10 else ''}{did_you_mean(unknown, known - {'backbone'})}; known: {sorted(known - {'backbone'})}"
            )
        # a boolean for a number refused, then types checked ("16" → 16, "x" refused) before the dataclass's own checks
        refuse_booleans(typing.get_type_hints(self.config_class), fields, f"model ({self.config_class.__name__})")
        config = _adapter(self.config_class).validate_python({"backbone": backbone, **fields})
        return check_finite_fields(
            config, f"model ({self.config_class.__name__})"
        )  # inf / nan refused (config/finite.py)

    def build_model(
        self, config: MethodConfig, backbone=None, tokenizer=None, backbone_name: str | None = None
    ) -> CSEModel:
        """The model from its typed config (`backbone_name` replaces the config's backbone name: the job's own)."""
        if backbone_name is not None:
            config = replace(config, backbone=backbone_name)
        return self.model_class(config, backbone=backbone, tokenizer=tokenizer)


@cache
def _adapter(config_class: type) -> TypeAdapter:
    return TypeAdapter(config_class)


REGISTRY: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec(
            "d2cse",
            "D2CSE",
            "cse.models.methods.d2cse:D2CSE",
            "deep prompts on a frozen PLM that is also the CRTD discriminator (optional [CLS] prompt)",
        ),
        MethodSpec(
            "simcse", "SimCSE", "cse.models.methods.simcse:SimCSE", "dropout views, full fine-tuning (unsup and sup)"
        ),
        MethodSpec(
            "dcpcse",
            "DCPCSE",
            "cse.models.methods.dcpcse:DCPCSE",
            "deep prompts on a frozen PLM (optional MLM auxiliary loss)",
        ),
        MethodSpec(
            "diffcse",
            "DiffCSE",
            "cse.models.methods.diffcse:DiffCSE",
            "trainable encoder + trainable discriminator, fixed DistilBERT generator",
        ),
        MethodSpec(
            "diffaug",
            "DiffAug",
            "cse.models.methods.diffaug:DiffAug",
            "two prefix modules: NLI prefix tuning, then joint contrastive tuning",
        ),
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
        raise ValueError(f"unknown method {name!r}{did_you_mean([name], METHODS)}; known: {list(METHODS)}") from None


def build_model(method: str, model_config: dict[str, Any], backbone=None, tokenizer=None) -> CSEModel:
    """The model of `method` from a config dict with its `backbone` key (tests, benchmarks)."""
    spec = get_method(method)
    fields = dict(model_config)
    return spec.build_model(spec.model_config(fields.pop("backbone"), fields), backbone=backbone, tokenizer=tokenizer)


def model_class(method: str) -> type[CSEModel]:
    """The model class of `method` (`get_method(method).model_class`)."""
    return get_method(method).model_class


def missing_deployments(spec: MethodSpec, deployments: list[dict[str, Any]]) -> str:
    """The prefect.yaml lines to add so that every preset of `spec` has its training deployment: YAML entries for the
    `deployments:` list ("" when none is missing).

    Args:
        spec: the registry entry.
        deployments: prefect.yaml's `deployments` (the parsed list).
    """
    have = {(d.get("entrypoint"), d.get("name")) for d in deployments}
    lines = []
    for entry in spec.deployment_entries():
        if (entry["entrypoint"], entry["name"]) in have:
            continue
        lines += [
            f"  - name: {entry['name']}",
            f"    entrypoint: {entry['entrypoint']}",
            f"    description: {json.dumps(entry['description'], ensure_ascii=False)}",
            f"    tags: [{', '.join(entry['tags'])}]",
            f"    parameters: {{preset: {entry['parameters']['preset']}}}",
            "    work_pool: *local_pool",
            "",
        ]
    return "\n".join(lines)
