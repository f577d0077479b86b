"""The model card of an export: one Hugging Face README.md, rendered once from typed facts and written into every
export folder of the job.

`CardFacts` gathers what one training job knows (its `TrainConfig`, the test metrics of `evaluation.Evaluator`,
the content hashes of its input datasets, the MLflow run and registered model version, the git commit, the
trainable parameters of its checkpoint, an optional PEFT adapter export). `render_card(facts)` builds huggingface_hub's
`ModelCard` from `card_data(facts)` (a `ModelCardData`: library, tags, base model, datasets and the model-index, one
`EvalResult` per STS task) and the Jinja template `model_card_template.md` (package data beside this module);
`write_model_cards(facts, export, adapter)` writes that one card into the sentence-transformers export and the PEFT
adapter folder (atomically; the adapter's copy says `library_name: peft`). Neither export writes a card of its own.
Rendering is pure: the published row a job reproduces (config/published.py) is looked up when the facts are gathered,
and every metric or fact that is missing renders as "—".

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
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cse.config import published
from cse.config.methods import REGISTRY, MethodSpec
from cse.storage.atomic import atomic_file
from cse.storage.readers import SEVEN_TASKS, TASK_TITLES
from cse.storage.secrets import redact

if TYPE_CHECKING:
    from huggingface_hub import ModelCard, ModelCardData

    from cse.config.stages import NliSource, WikiSource
    from cse.config.training import TrainConfig
    from cse.storage.datasets import DatasetRef
    from cse.storage.runs import RunDir

CARD_FILE = "README.md"
TEMPLATE = Path(__file__).with_name("model_card_template.md")  # package data (pyproject.toml)
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
    `pooling`: how the embedding is read from the encoder's output; `prefix_len`, `probe_sentences`,
    `trained_shift_positions`: from the folder's `cse_peft.json` (the prefix slots, the export's verification, whether
    the prompts were trained with shifted positions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    folder: str
    exact: bool | None = None
    limitations: list[str] = Field(default_factory=list)
    base_model: str | None = None
    pooling: dict[str, Any] | None = None
    max_abs_diff: float | None = None
    prefix_len: int | None = None
    probe_sentences: int | None = None
    trained_shift_positions: bool | None = None

    @field_validator("folder", "base_model", mode="before")
    @classmethod
    def _text(cls, v: Any) -> str | None:
        return None if v is None else str(v)

    @field_validator("limitations", mode="before")
    @classmethod
    def _lines(cls, v: Any) -> list[str]:
        return [str(x) for x in v or []]

    @field_validator("max_abs_diff", mode="before")
    @classmethod
    def _finite(cls, v: Any) -> float | None:
        return _number(v)

    @classmethod
    def of(cls, export: Any) -> AdapterInfo | None:
        """An `AdapterInfo` from a `PeftExport`-like object (attributes `folder`, `exact`, `limitations`, optionally
        `base_model`, `pooling`, `max_abs_diff`), a mapping of those fields, an `AdapterInfo`, or None (no adapter).
        What the object does not hold is read from the folder's `cse_peft.json` when there is one."""
        if export is None or isinstance(export, AdapterInfo):
            return export
        if isinstance(export, Mapping):
            fields = dict(export)
        elif hasattr(export, "folder"):
            fields = {k: getattr(export, k) for k in cls.model_fields if hasattr(export, k)}
            if (spec := Path(str(export.folder)) / "cse_peft.json").is_file():
                fields = {**json.loads(spec.read_text(encoding="utf-8")), **fields}
        else:
            raise TypeError(
                f"adapter: expected a PeftExport, a mapping with `folder`, or None; got {type(export).__name__}"
            )
        if "folder" not in fields:
            raise ValueError(f"adapter: the mapping lacks `folder` (got keys {sorted(export)})")
        return cls._of_fields(fields)

    @classmethod
    def _of_fields(cls, fields: Mapping[str, Any]) -> AdapterInfo:
        """The adapter of `fields` (holding `folder`); keys that are no field of this class are left out."""
        return cls(**{k: v for k, v in fields.items() if k in cls.model_fields})

    @classmethod
    def from_folder(cls, folder: str | Path) -> AdapterInfo:
        """The adapter an export wrote into `folder`, from its `cse_peft.json` (models/export/peft_loader.py)."""
        from cse.models.export.peft_loader import read_spec

        return cls._of_fields({**read_spec(folder), "folder": str(folder)})


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
        return None if export is None else cls.model_validate(export, from_attributes=True)


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
        from cse.storage.settings import get_settings

        return cls(
            **_job_facts(cfg, test_metrics),
            **_data_facts(cfg, tokens, corruption, nli_tokens),
            **_checkpoint_facts(checkpoint, trainable_parameters),
            git_commit=git_commit,
            run_id=run_id,
            registered_name=registered_name,
            version=None if version is None else str(version),
            logged_model_uri=logged_model_uri,
            steps=steps,
            best_stsb_dev=best_stsb_dev,
            adapter=AdapterInfo.of(adapter),
            st_export=STExportInfo.of(st_export),
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


class _JobFacts(TypedDict):
    """The facts `from_training` takes from the job's configuration: method, preset, setting, its test metrics."""

    method: str
    method_title: str
    summary: str
    preset: str
    backbone: str
    setting: str
    uses_corruption: bool
    dataset: str
    metrics: dict[str, float]
    config: dict[str, Any]
    reference: PublishedReference | None


class _DataFacts(TypedDict):
    """The facts `from_training` takes from the job's input datasets: their hashes and where their rows came from."""

    tokens_hash: str | None
    corruption_hash: str | None
    nli_tokens_hash: str | None
    data_origin: list[DataOrigin]
    datasets: list[str]


class _CheckpointFacts(TypedDict):
    """The facts `from_training` takes from the best checkpoint: the evaluation pooler and the trainable parameters."""

    pooler: str | None
    trainable_parameters: int | None


def _job_facts(cfg: TrainConfig, test_metrics: Mapping[str, float] | None) -> _JobFacts:
    """The method (its registry entry's title and summary), preset, backbone, setting and data of `cfg`, its full
    dump, the finite test metrics and the published row the job reproduces."""
    spec = REGISTRY.get(cfg.method)
    setting = published.setting_of(cfg.method, cfg.preset, cfg.supervised)
    return _JobFacts(
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
        reference=PublishedReference.lookup(cfg.method, cfg.backbone, setting),
    )


def _data_facts(cfg: TrainConfig, tokens: Any, corruption: Any, nli_tokens: Any) -> _DataFacts:
    """The content hashes of the input datasets (`DatasetRef`s or hashes) and the origin of each training dataset:
    the training tokens' (NLI when supervised, else Wiki1M) and, when the job reads NLI too, the NLI tokens'."""
    sources: dict[str, WikiSource | NliSource] = (
        {"nli": cfg.ingest.nli} if cfg.supervised else {"wiki1m": cfg.ingest.wiki}
    )
    if cfg.needs_nli:  # DiffAug's prefix phase or auxiliary batches
        sources["nli"] = cfg.ingest.nli
    refs: dict[str, Any] = {"nli": nli_tokens}
    refs["nli" if cfg.supervised else "wiki1m"] = tokens  # the training tokens; NLI tokens of a prefix phase else
    origins = _data_origins(sources, refs)
    return _DataFacts(
        tokens_hash=_hash(tokens),
        corruption_hash=_hash(corruption),
        nli_tokens_hash=_hash(nli_tokens),
        data_origin=origins,
        datasets=_hub_datasets(origins),
    )


def _checkpoint_facts(checkpoint: str | Path | None, trainable_parameters: int | None) -> _CheckpointFacts:
    """The evaluation pooler recorded in the best checkpoint (None without one), and `trainable_parameters`, else the
    count the checkpoint records."""
    pooler = None
    if checkpoint is not None:
        from cse.models.checkpoint import read_checkpoint_meta

        meta = read_checkpoint_meta(Path(checkpoint))
        pooler = meta.get("pooler")
        if trainable_parameters is None and isinstance(meta.get("trainable_parameters"), int):
            trainable_parameters = meta["trainable_parameters"]
    return _CheckpointFacts(pooler=pooler, trainable_parameters=trainable_parameters)


def _backbone_scores(backbone: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not backbone or not backbone.get("metrics"):
        return None
    metrics = {k: float(v) for k, v in backbone["metrics"].items() if _number(v) is not None}
    return {"pooler": backbone.get("pooler"), "evaluation_id": backbone.get("evaluation_id"), "metrics": metrics}


# ------------------------------------------------------------------------------------------------ rendering


def render_card(facts: CardFacts) -> ModelCard:
    """The export's one card, rendered once: `ModelCardData` (library, tags, base model, datasets and the model-index
    of the STS results as `EvalResult`s) and the Markdown of `model_card_template.md` (package data). No absolute local
    path and no credential (a source URL's password: `cse push` uploads the card) appear anywhere in it."""
    from huggingface_hub import ModelCard

    card = ModelCard.from_template(card_data(facts), template_path=str(TEMPLATE), **_context(facts))
    text = re.sub(r"\n{3,}", "\n\n", redact(_portable(str(card)))).rstrip("\n") + "\n"
    return ModelCard(text)


def card_data(facts: CardFacts) -> ModelCardData:
    """The front matter: the hub's metadata, with one `EvalResult` per STS task the job scored (Spearman × 100)."""
    from huggingface_hub import EvalResult, ModelCardData

    tags = ["sentence-transformers", "sentence-similarity", "feature-extraction", facts.method, "contrastive-learning"]
    results = [
        EvalResult(
            task_type="sentence-similarity",
            task_name="Semantic Textual Similarity",
            dataset_type=f"senteval-{t}",
            dataset_name=f"{TASK_TITLES[t]} (SentEval, test)",
            dataset_split="test",
            metric_type="spearman",
            metric_value=round(facts.metrics[t], 2),
            metric_name="Spearman x100",
        )
        for t in SEVEN_TASKS
        if _number(facts.metrics.get(t)) is not None
    ]
    return ModelCardData(
        library_name="sentence-transformers",
        pipeline_tag="sentence-similarity",
        tags=[*tags, "peft"] if facts.adapter is not None else tags,
        base_model=_hub_model_id(facts.backbone),
        datasets=list(facts.datasets) or None,
        model_name=(facts.registered_name or f"{facts.method_title} ({facts.backbone}, {facts.preset})")
        if results
        else None,  # the model-index's name: no results, no model-index
        eval_results=results or None,
    )


def model_card(facts: CardFacts, library: Library = "sentence-transformers") -> str:
    """The card (README.md text) of the export described by `facts`, for a folder of kind `library`: the
    sentence-transformers export, or the PEFT adapter folder (the same card, front matter `library_name: peft`)."""
    return _for_library(render_card(facts), library)


def _for_library(card: ModelCard, library: Library) -> str:
    """The card's text for a folder of kind `library`: the PEFT adapter's copy says `library_name: peft`."""
    if library == "sentence-transformers":
        return str(card)
    from huggingface_hub import ModelCard

    copy = ModelCard(str(card))
    tags = copy.data["tags"]
    copy.data["library_name"] = library
    copy.data["tags"] = [*tags, *(["peft"] if "peft" not in tags else [])]
    return str(copy)


def write_model_cards(facts: CardFacts, *folders: str | Path) -> list[Path]:
    """Render `facts`' card once and write it as `README.md` into each export folder (atomically; an earlier card is
    replaced): the sentence-transformers export and the PEFT adapter folder (`adapter_config.json` and no
    `modules.json`) get the same card, the adapter's front matter saying `library_name: peft`."""
    paths = [Path(f) for f in folders]
    for folder in paths:
        if not folder.is_dir():
            raise FileNotFoundError(f"no export folder at {folder}: export the model before writing its card")
    card = render_card(facts)
    for folder in paths:
        adapter = (folder / "adapter_config.json").is_file() and not (folder / "modules.json").is_file()
        with atomic_file(folder / CARD_FILE) as tmp:
            tmp.write_text(_for_library(card, "peft" if adapter else "sentence-transformers"), encoding="utf-8")
    return [folder / CARD_FILE for folder in paths]


def write_model_card(folder: str | Path, facts: CardFacts) -> Path:
    """`write_model_cards` for one folder."""
    return write_model_cards(facts, folder)[0]


_ORIGINS = {
    "path": "local file",
    "mirror": "local mirror (`CSE_SOURCE_MIRROR`)",
    "url": "downloaded",
    "hf": "Hugging Face datasets",
    "configured": "configured; the ingested dataset was not found, so this is not verified",
}


def _context(facts: CardFacts) -> dict[str, Any]:
    """The template's values, ready to print: the facts' fields, and what the card shows of them formatted."""
    ref, config = facts.reference, facts.config
    ks = sorted(
        {int(m.group(1)) for k in (*facts.metrics, *(ref.retrieval if ref else {})) if (m := _RETRIEVAL.match(k))}
    )
    params = ref.parameters if ref else {}
    spec = REGISTRY.get(facts.method)
    uses_corruption = facts.corruption_hash is not None or facts.uses_corruption
    return {
        **dict(facts),
        "missing": MISSING,
        "count": _count,
        "origin_names": _ORIGINS,
        "reference_key": " / ".join(f"`{k}`" for k in ref.key) if ref else None,
        "sts": _table(facts, "sts", STS_COLUMNS, [TASK_TITLES[c] for c in STS_COLUMNS], 2),
        "retrieval": ks and _table(facts, "retrieval", [f"retrieval_r{k}" for k in ks], [f"R@{k}" for k in ks], 2),
        "align_uniform": _table(facts, "align_uniform", ALIGN_COLUMNS, ALIGN_COLUMNS, 4),
        "backbone_pooler": str(facts.backbone_scores.get("pooler")) if facts.backbone_scores else None,
        "best_stsb_dev": _fmt(facts.best_stsb_dev, 2) if facts.best_stsb_dev is not None else None,
        "trainable_parameters": _count(facts.trainable_parameters),
        "published_parameters": {**params, "count": _count(_number(params.get("trainable_parameters")))}
        if params
        else None,
        "uses_corruption": uses_corruption,
        "corrupt": (config.get("corrupt") or {}) if uses_corruption else {},
        "rows_used": next((o.rows for o in facts.data_origin if o.dataset == facts.dataset), None),
        "adapter": _adapter_context(facts),
        "no_prompts": spec.title if spec is not None and not spec.exports_peft_adapter else None,
        "model_uri": facts.model_uri,
        "tracking_uri": _tracking_uri_text(facts.tracking_uri),
        "config_json": json.dumps(config, indent=2, sort_keys=True, default=str) if config else None,
        "citations": [{"title": s.title, "bibtex": s.bibtex} for s in citations(facts.method) if s.bibtex],
    }


def _table(facts: CardFacts, table: str, columns: Sequence[str], titles: Sequence[str], digits: int) -> dict[str, Any]:
    """One results table: this model, the backbone before training (and, for STS, the gain over it), the published
    row of `table` (or the BERT-base reference) and the difference."""
    scores, ref = facts.backbone_scores or {}, facts.reference
    base, row = scores.get("metrics") or {}, getattr(ref, table, {})

    def cells(values: Mapping[str, Any]) -> list[str]:
        return [_fmt(values.get(c), digits) for c in columns]

    def gain_over(other: Mapping[str, Any]) -> list[str]:
        return [_diff(facts.metrics.get(c), other.get(c), digits) for c in columns]

    rows = [("this model", cells(facts.metrics))]
    if any(_number(base.get(c)) is not None for c in columns):
        rows.append((f"backbone before training (`{facts.backbone}`, {scores.get('pooler')})", cells(base)))
        if table == "sts":
            rows.append(("gain over the backbone", gain_over(base)))
    if row and ref is not None:  # a row only with a reference
        label = "published" if ref.stands_in_for is None else "reference: BERT-base"
        rows += [(f"{label} ({row.get('source', '?')})", cells(row)), ("difference", gain_over(row))]
    return {"titles": list(titles), "rows": rows}


def _adapter_context(facts: CardFacts) -> dict[str, Any] | None:
    """The PEFT adapter: its fields, its folder named from the job folder (the card reads the same in both export
    folders) and where its base is: bundled in the folder, the packaged MiniLM (its pip package gives the folder, no
    download), a hub id, or a local folder named by a placeholder (a card names no absolute local path)."""
    a = facts.adapter
    if a is None:
        return None
    base = Path(a.base_model) if a.base_model is not None else None
    bundled_base = base.name if base is not None and base.parent == Path(a.folder) else None  # bundled in the folder
    return {
        **a.model_dump(),
        "where": portable_path(a.folder),
        "path": f"<the job folder>/{Path(a.folder).name}",
        "bundled_base": bundled_base,
        "packaged_minilm": facts.backbone == PACKAGED_MINILM,
        "hub_base": _hub_model_id(facts.backbone),
        "base_name": Path(a.base_model or facts.backbone).name,
        "pooling": json.dumps(a.pooling, sort_keys=True) if a.pooling is not None else None,
        "max_abs_diff": f"{a.max_abs_diff:.2g}" if a.max_abs_diff is not None else None,
    }


def _tracking_uri_text(uri: str | None) -> str:
    """The tracking URI as the card's MLflow snippet names it: a server's URL (credentials masked); the checkout's
    SQLite store relative to the checkout (`sqlite:///.cse/mlflow.db`, run from the checkout's folder); any other
    SQLite store under `<CSE_HOME>` or by its file name as a placeholder (a card names no absolute local path)."""
    from cse.storage.settings import REPO_ROOT, get_settings

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


def citations(method: str) -> list[MethodSpec]:
    """The registry entries whose papers a card of `method` cites: the method's own first, then those it builds on
    (`MethodSpec.cites`); none for a method the registry does not know."""
    spec = REGISTRY.get(method)
    return [] if spec is None else [REGISTRY[name] for name in spec.cites if name in REGISTRY]


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
    from cse.storage.layout import DataRoot
    from cse.storage.settings import get_settings
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
    from cse.storage.settings import get_settings

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
