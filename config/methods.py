"""The method registry: one entry per training method, read from the presets (config/presets.py), the only list of
methods in the project.

A method is one unit: a model module `models/methods/<name>.py` and its presets in config/presets.py (plus, for a
published method, its rows in config/published.py). A name of `PRESETS` is a method; its entry (`MethodSpec(name)`)
finds the model class in `models/methods/<name>.py` (`cse.models.checkpoint.model_class_of`, where checkpoints find it)
and reads every other per-method fact from it:

- the name as the paper writes it and a one-line summary (`title`, `summary`);
- the typed model config (`config_class`), whether it reads the corruption stage, its phases, whether it takes
  auxiliary NLI batches (`accepts_aux_nli`), hence its pipeline stages (`stages()`);
- `TrainConfig.method` (the accepted names) and the validation of `TrainConfig.model`;
- its paper and BibTeX (`paper`, `bibtex`, `cites`: the model card's citation), its published rows (`published`),
  its ablation variants (`ablations`, flows/ablate.py), whether its export includes a PEFT adapter
  (`exports_peft_adapter`: the model class defines `peft_plan`);
- the training flow `train-<name>` of flows/train.py and the experiment children's dispatch target
  (`deployment(preset)`), the comparison's rows (tasks/compare.py);
- the deployments: prefect.yaml's training entries are generated from this registry (`training_deployments_yaml`;
  `cse prefect-yaml` writes them) and tests/flows/test_deployments.py fails when the file differs.

Adding a method (docs/architecture.md has the recipe; tests/config/test_toy_method.py adds a toy one that way):
1. `models/methods/<name>.py`: a `MethodConfig` pydantic dataclass (its checks pydantic validators) and a `CSEModel`
   subclass with `method = "<name>"`, its `title`, `summary`, `config_class`, `paper`, `bibtex` (and `builds_on`,
   `peft_plan`, `ablations` where they apply);
2. its presets in config/presets.py (at least `default`), and a line per preset in `PRESET_DESCRIPTIONS`;
then `cse prefect-yaml` writes its deployments, and flows/train.py's `train_<name> = train_flow(REGISTRY["<name>"])`
line names its flow object where grep finds it (Prefect's entrypoints load it without that line too).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from cse.config import published
from cse.config.finite import check_finite_fields, refuse_booleans
from cse.config.limits import cut
from cse.config.presets import PRESET_DESCRIPTIONS, PRESETS
from cse.config.suggest import did_you_mean

if TYPE_CHECKING:
    from cse.models.method import CSEModel, MethodConfig


DEFAULT_METHOD = "d2cse"  # the method a job, a sweep or a seed study trains when none is named


@dataclass(frozen=True)
class MethodSpec:
    """One training method of the registry; every per-method fact is read from its model class or its presets.

    Args:
        name: the registry name (lowercase), a key of config/presets.py's `PRESETS`: `TrainConfig.method`, the
            `train-<name>` flow, MLflow experiment and registered-model names, the checkpoint's `method`; the model
            class is the `CSEModel` subclass with `method = "<name>"` in `cse.models.methods.<name>`.

    Examples:
        >>> from cse.config.methods import get_method
        >>> spec = get_method("dcpcse")
        >>> spec.deployment("sup")
        'train-dcpcse/sup'
        >>> spec.title, spec.exports_peft_adapter  # the model class defines peft_plan
        ('DCPCSE', True)
        >>> spec.stages(supervised=False)
        ('ingest:wiki1m', 'tokenize:wiki1m', 'train', 'evaluate')
        >>> spec.cites  # the model card cites DCPCSE's paper, then SimCSE's
        ('dcpcse', 'simcse')
        >>> spec.model_config("packaged:minilm", {"prefix_len": 8}).prefix_len
        8
    """

    name: str

    @property
    def presets(self) -> Mapping[str, Mapping[str, Any]]:
        """Preset name → the TrainConfig fields that differ from the defaults (config/presets.py)."""
        return PRESETS[self.name]

    @property
    def model(self) -> str:
        """The model class as `"module:Class"` (`cse.models.methods.<name>:<Class>`)."""
        return f"{self.model_class.__module__}:{self.model_class.__qualname__}"

    @cached_property
    def model_class(self) -> type[CSEModel]:
        """The `CSEModel` subclass with `method = name` in `cse.models.methods.<name>`, imported at the first use."""
        from cse.models.checkpoint import model_class_of

        return model_class_of(self.name)

    @property
    def title(self) -> str:
        """The name as the paper writes it (model cards, tables), from the model class."""
        return self.model_class.title

    @property
    def summary(self) -> str:
        """One line on what trains and how, from the model class: the flow's description, the model card's first
        sentence."""
        return self.model_class.summary

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
        """The prefect.yaml deployments this method needs: one per preset, named like it, in preset order (without
        `work_pool`, which prefect.yaml gives every deployment as `*local_pool`). The description is the preset's line
        of `PRESET_DESCRIPTIONS` (a generated one where it has none); a `smoke` preset is tagged `smoke`, a preset that
        also test-evaluates the transfer tasks `transfer`."""
        descriptions = PRESET_DESCRIPTIONS.get(self.name, {})
        return [
            {
                "name": preset,
                "entrypoint": self.entrypoint,
                "description": descriptions.get(preset)
                or f"{self.title}, preset {preset} (config/presets.py): {self.summary}.",
                "tags": ["train", self.name, *preset_tags(preset, fields)],
                "parameters": {"preset": preset},
            }
            for preset, fields in self.presets.items()
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


_ADAPTERS: dict[type, TypeAdapter] = {}


def _adapter(config_class: type) -> TypeAdapter:
    """The pydantic validator of a method config class (made once per class)."""
    if config_class not in _ADAPTERS:
        _ADAPTERS[config_class] = TypeAdapter(config_class)
    return _ADAPTERS[config_class]


def preset_tags(preset: str, fields: Mapping[str, Any]) -> list[str]:
    """The tags a training deployment has besides `train` and its method: `smoke` for the smoke preset, `transfer`
    for a preset that also test-evaluates the SentEval transfer tasks (or selects on them)."""
    transfer = fields.get("transfer_evaluation") or fields.get("selection") == "transfer"
    return [*(["smoke"] if preset == "smoke" else []), *(["transfer"] if transfer else [])]


class Registry(Mapping[str, MethodSpec]):
    """Method name → its `MethodSpec`, one per method of config/presets.py's `PRESETS`, in their order: a method added
    there (with its module `models/methods/<name>.py`) is in the registry, with nothing else to edit."""

    def __init__(self) -> None:
        self._specs: dict[str, MethodSpec] = {}

    def __getitem__(self, name: str) -> MethodSpec:
        if name not in PRESETS:
            raise KeyError(name)
        return self._specs.setdefault(name, MethodSpec(name))

    def __iter__(self) -> Iterator[str]:
        return iter(PRESETS)

    def __len__(self) -> int:
        return len(PRESETS)


REGISTRY = Registry()
METHODS: tuple[str, ...] = tuple(REGISTRY)  # the methods at import (a method added to PRESETS later is in REGISTRY)


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


def deployment_yaml(entry: Mapping[str, Any]) -> list[str]:
    """One training deployment (`MethodSpec.deployment_entries`) as the lines of a prefect.yaml `deployments:` entry
    (with `work_pool: *local_pool`); a description that YAML reads back unchanged is written plain, others quoted."""
    description = entry["description"]
    plain = not description.startswith(("'", '"', "[", "{", "&", "*", "!", "|", ">", "%", "@", "`", "#", "-", "?"))
    if plain:
        try:
            plain = yaml_scalar(description) == description
        except ValueError:
            plain = False
    return [
        f"  - name: {entry['name']}",
        f"    entrypoint: {entry['entrypoint']}",
        f"    description: {description if plain else json.dumps(description, ensure_ascii=False)}",
        f"    tags: [{', '.join(entry['tags'])}]",
        f"    parameters: {{preset: {entry['parameters']['preset']}}}",
        "    work_pool: *local_pool",
    ]


def yaml_scalar(text: str) -> Any:
    """What YAML reads `description: <text>` as (ValueError when it is no valid YAML)."""
    import yaml

    try:
        return yaml.safe_load(f"description: {text}")["description"]
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None


def training_deployments_yaml() -> str:
    """Every registry method's training deployments as the lines of prefect.yaml's `deployments:` list (a blank line
    after each entry): what `cse prefect-yaml` writes between the training block's first comment and the experiments'."""
    return "".join(
        "\n".join(deployment_yaml(entry)) + "\n\n" for spec in REGISTRY.values() for entry in spec.deployment_entries()
    )


def missing_deployments(spec: MethodSpec, deployments: list[dict[str, Any]]) -> str:
    """The prefect.yaml lines to add so that every preset of `spec` has its training deployment: YAML entries for the
    `deployments:` list ("" when none is missing; `cse prefect-yaml` writes them all).

    Args:
        spec: the registry entry.
        deployments: prefect.yaml's `deployments` (the parsed list).
    """
    have = {(d.get("entrypoint"), d.get("name")) for d in deployments}
    lines = []
    for entry in spec.deployment_entries():
        if (entry["entrypoint"], entry["name"]) not in have:
            lines += [*deployment_yaml(entry), ""]
    return "\n".join(lines)
