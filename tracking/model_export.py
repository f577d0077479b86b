"""The trained encoder as an MLflow model, registered in the model registry.

`log_encoder_model` logs a checkpoint in the active run with the flavour a user of MLflow expects:
- MLflow's native `sentence_transformers` flavour where a standard sentence-transformers pipeline computes our
  embedding exactly: a fully trained encoder (every backbone tensor is in the checkpoint: SimCSE, DiffCSE) read by a
  standard pooler (`cls_before_pooler` → Pooling CLS; `cls` → Pooling CLS + Dense with tanh from the trained MLP;
  `avg` → Pooling mean). The pipeline is built from sentence-transformers' own modules (Transformer, Pooling, Dense)
  and checked against the checkpoint's embeddings on the input example before it is logged; loading it needs
  neither this package nor `trust_remote_code`.
- else (deep prompts: D2CSE, DCPCSE; DiffAug's template and prefixes) the pyfunc `SentenceEmbeddingModel`, which
  loads the checkpoint through this package.
Either way the model has a signature (a column of strings → float32 vectors of the embedding size; param
`batch_size`) and an input example, states its pip requirements (inferring them would load the model again in a
subprocess), and becomes a version of the registered model `registered_model_name(method, backbone, preset)`.

`export_portable` writes a training job's portable exports beside it: the sentence-transformers folder, the PEFT
adapter (methods whose model exports one) and a model card in each, logged as the run's artifacts.

`set_best_alias` points the alias `best` of each registered model at the version with the best STS-B dev among
an experiment's runs (flows/seeds.py, flows/sweep.py, tasks/compare.py).
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow
import numpy as np
import pandas as pd
import torch
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.pyfunc import PythonModel
from mlflow.types.schema import ColSpec, DataType, ParamSchema, ParamSpec, Schema, TensorSpec

from cse.config.methods import get_method
from cse.config.training import TrainConfig
from cse.models.export.st_standard import (  # the standard pipeline: see there
    INPUT_EXAMPLE,
    standard_sentence_transformer,
)
from cse.storage.runs import RunDir
from cse.tracking.model_card import CardFacts, write_model_cards
from cse.tracking.stage_runs import active_run_id, log_run_results

if TYPE_CHECKING:
    from cse.models.export.peft_export import PeftExport

log = logging.getLogger(__name__)

BEST_ALIAS = "best"
SELECTION_METRIC = "best_stsb_dev"  # the STS-B dev score each training run selected its checkpoint on


class SentenceEmbeddingModel(PythonModel):
    """pyfunc: a list of sentences → an (n, d) float32 array."""

    def load_context(self, context) -> None:
        from cse.models.checkpoint import load_checkpoint
        from cse.models.loading import load_tokenizer

        ckpt = Path(context.artifacts["checkpoint"])
        self.encoder = load_checkpoint(ckpt, device="cpu")
        self.tokenizer = getattr(self.encoder, "tokenizer", None) or load_tokenizer(
            json.loads((ckpt / "cse_model.json").read_text())["backbone"]
        )

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> np.ndarray:
        """`model_input`: the signature's column of sentences (MLflow passes a DataFrame; a list also works). The
        hint stays `pd.DataFrame`: MLflow reads it (a list hint would change what it infers)."""
        rows: Any = model_input  # a DataFrame, a Series or a list
        if isinstance(rows, pd.DataFrame):
            rows = rows.iloc[:, 0]
        if isinstance(rows, pd.Series):
            rows = rows.tolist()
        sentences = [str(s) for s in rows]
        batch_size = int((params or {}).get("batch_size", 64))
        out = []
        with torch.inference_mode():
            for i in range(0, len(sentences), batch_size):
                enc = self.tokenizer(sentences[i : i + batch_size], padding=True, return_tensors="pt")
                out.append(
                    self.encoder.embed(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids"))
                    .float()
                    .numpy()
                )
        return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)


# What loading the model needs, pinned to the versions that logged it. Stated, not inferred: MLflow's inference
# loads the model again in a subprocess (seconds per training run) and finds the same packages.
REQUIREMENTS = ("torch", "transformers", "safetensors", "numpy", "mlflow")
ST_REQUIREMENTS = ("sentence-transformers", "torch", "transformers", "safetensors", "numpy", "mlflow")


def pip_requirements(names: tuple[str, ...] = REQUIREMENTS) -> list[str]:
    """Pinned pip requirements (`name==version`) of the installed distributions `names`, one per name."""
    return [f"{name}=={metadata.version(name)}" for name in names]


def embedding_signature(dim: int | None) -> ModelSignature:
    """A column of sentences → one float32 vector of `dim` per sentence (None: any size); param `batch_size`
    (default 64)."""
    return ModelSignature(
        inputs=Schema([ColSpec(DataType.string)]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, int(dim) if dim else -1))]),
        params=ParamSchema([ParamSpec("batch_size", DataType.long, 64)]),
    )


# ------------------------------------------------------------------------------------------------ registry names
_ILLEGAL = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME = 256  # the registry's name column


def backbone_label(backbone: str) -> str:
    """The backbone as a registered-model name part: a local folder → its last folder name, `packaged:<name>` →
    `<name>`, a hub id `org/name` → `org-name`; characters other than letters, digits, `.`, `_`, `-` become `-`."""
    text = backbone.strip().rstrip("/\\")
    if ":" in text and not text.startswith(("/", ".", "~")):
        text = text.split(":", 1)[1]
    path = Path(text).expanduser()
    if text.startswith(("/", "./", "../", "~")) or path.is_dir():
        text = path.name
    return _ILLEGAL.sub("-", text).strip("-.") or "backbone"


def registered_model_name(method: str, backbone: str, setting: str) -> str:
    """`cse-<method>-<backbone>-<setting>` (setting = the preset), legal in MLflow's registry (no `/` or `:`)."""
    parts = [_ILLEGAL.sub("-", p).strip("-") for p in (method, backbone_label(backbone), setting)]
    if not all(parts):
        raise ValueError(
            f"cannot name a registered model from method {method!r}, backbone {backbone!r}, "
            f"setting {setting!r}: a part is empty"
        )
    return "-".join(["cse", *parts])[:_MAX_NAME]


# ------------------------------------------------------------------------------------------------ logging
@dataclass(frozen=True)
class LoggedEncoder:
    """What `log_encoder_model` logged: the flavour (`sentence_transformers` or `python_function`) and why, the
    model's URI (`models:/<model id>`), and the registered name and version (None when registration failed)."""

    flavor: str
    reason: str
    model_uri: str
    registered_name: str | None = None
    version: str | None = None

    @property
    def registry_uri(self) -> str | None:
        """`models:/<name>/<version>`, or None when the model is not registered."""
        return f"models:/{self.registered_name}/{self.version}" if self.version is not None else None


def log_encoder_model(
    checkpoint_dir: str | Path,
    name: str = "model",
    registered_name: str | None = None,
    version_tags: dict[str, str] | None = None,
) -> LoggedEncoder:
    """Log the checkpoint as an MLflow model in the active run (the flavour: see the module docstring), and register
    it as a new version of `registered_name` (with `version_tags`) when given. A registry that refuses the version
    leaves the logged model in place: a warning and the run tag `cse.registry_error` say why."""
    from cse.models.checkpoint import read_checkpoint_meta

    meta = read_checkpoint_meta(checkpoint_dir)
    signature = embedding_signature(meta.get("embedding_dim"))
    with tempfile.TemporaryDirectory(prefix="cse-st-") as workdir:
        st, reason = standard_sentence_transformer(checkpoint_dir, workdir)
        if st is not None:
            info = mlflow.sentence_transformers.log_model(
                st,
                name=name,
                signature=signature,
                input_example=INPUT_EXAMPLE,
                pip_requirements=pip_requirements(ST_REQUIREMENTS),
            )
            flavor = "sentence_transformers"
        else:
            info = mlflow.pyfunc.log_model(
                name=name,
                python_model=SentenceEmbeddingModel(),
                artifacts={"checkpoint": str(checkpoint_dir)},
                signature=signature,
                input_example=INPUT_EXAMPLE,
                pip_requirements=pip_requirements(),
            )
            flavor = "python_function"
    log.info("logged the %s model as %s (%s)", meta.get("method"), flavor, reason)
    run_id = active_run_id()
    mlflow.set_tags({"cse.model_flavor": flavor, "cse.model_flavor_reason": reason[:5000]})
    if registered_name is None:
        return LoggedEncoder(flavor, reason, info.model_uri)
    tags = {"flavor": flavor, **(version_tags or {})}
    try:
        version = mlflow.register_model(info.model_uri, registered_name, tags=tags)
    except MlflowException as e:
        log.warning(
            "model of run %s logged (%s) but not registered as %s: %s",
            run_id,
            info.model_uri,
            registered_name,
            e,
        )
        mlflow.set_tag("cse.registry_error", str(e)[:5000])
        return LoggedEncoder(flavor, reason, info.model_uri, registered_name)
    mlflow.set_tags({"cse.registered_model": registered_name, "cse.model_version": str(version.version)})
    return LoggedEncoder(flavor, reason, info.model_uri, registered_name, str(version.version))


# ------------------------------------------------------------------------------------------------ the `best` alias
def set_best_alias(run_ids: list[str], metric: str = SELECTION_METRIC, alias: str = BEST_ALIAS) -> dict[str, str]:
    """Point `alias` of every registered model that holds a version of one of `run_ids` at its version with the
    highest `metric` (the runs' STS-B dev selection score). Runs without the metric or without a registered version
    are skipped. Returns {registered model name: version}; {} when none qualifies."""
    from cse.tracking.store import configure_mlflow

    configure_mlflow()
    client = mlflow.MlflowClient()
    best: dict[str, tuple[float, str]] = {}
    for run_id in dict.fromkeys(r for r in run_ids if r):
        score = client.get_run(run_id).data.metrics.get(metric)
        if score is None:
            continue
        for mv in client.search_model_versions(f"run_id = '{run_id}'"):
            if mv.name not in best or score > best[mv.name][0]:
                best[mv.name] = (score, str(mv.version))
    for model_name, (score, version) in best.items():
        client.set_registered_model_alias(model_name, alias, version)
        log.info("alias %s of %s → version %s (%s %.2f)", alias, model_name, version, metric, score)
    return {n: v for n, (_, v) in best.items()}


def export_portable(
    cfg: TrainConfig,
    run_id: str,
    run_dir: RunDir,
    test_metrics: dict[str, float],
    facts: dict[str, Any],
    logger: logging.Logger | logging.LoggerAdapter,
) -> None:
    """The job's best checkpoint as a portable sentence-transformers folder and (`export_adapter`) a PEFT adapter,
    each with its model card, logged on run `run_id` (folders `sentence-transformers`, `peft-adapter`); what each
    export is, is said in `logger`.

    Args:
        cfg: the job's training config.
        run_id: the job's MLflow run.
        run_dir: the job's folder (its best checkpoint, the export folders).
        test_metrics: the evaluation stages' metrics (empty without test evaluation).
        facts: the keyword arguments of `CardFacts.from_training` but the exports (data, run, registry version,
            checkpoint, steps, scores).
        logger: the stage's log.
    """
    from cse.models.export.st_export import export_portable_sentence_transformer  # lazy: sentence-transformers

    st_export = export_portable_sentence_transformer(run_dir.best, run_dir.export)
    logger.info("sentence-transformers export: %s (%s)", st_export.kind, st_export.reason)
    adapter = export_adapter(cfg.method, run_dir, logger)
    card = CardFacts.from_training(cfg, test_metrics, adapter=adapter, st_export=st_export, **facts)
    cards = write_model_cards(card, run_dir.export, *([adapter.folder] if adapter is not None else []))
    log_run_results(run_id, folders=dict(zip(("sentence-transformers", "peft-adapter"), [c.parent for c in cards])))


def export_adapter(method: str, run_dir: RunDir, logger: logging.Logger | logging.LoggerAdapter) -> PeftExport | None:
    """The best checkpoint as a PEFT prefix-tuning adapter (`cse.models.export.peft_export`), or None.

    Only methods whose model exports one have one (`MethodSpec.exports_peft_adapter`). A backbone PEFT cannot prefix
    (e.g. DistilBERT: no past key/values) or a feature it cannot hold exactly is refused by the export with its
    reason, which is logged: the sentence-transformers export and the MLflow model stand either way."""
    from cse.models.export.peft_export import PeftExportError, export_peft_adapter  # lazy: peft

    if not get_method(method).exports_peft_adapter:
        return None
    try:
        return export_peft_adapter(run_dir.best, run_dir.peft_adapter)
    except PeftExportError as e:
        logger.warning("no PEFT adapter for %s: %s", run_dir.path, e)
        return None
