"""What both modes of the evaluation stage share (STS: tasks/evaluate.py, SentEval transfer:
tasks/evaluate_transfer.py): the embedder a config names and the summary the stage returns."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from config.evaluation import EvalConfig
from models.checkpoint import load_checkpoint_folder, read_checkpoint_config
from models.embedder import PooledEncoder, SentenceEmbedder
from tracking.store import download_checkpoint

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
CHECKPOINT_ARTIFACT = "checkpoint"


class EvalSummary(BaseModel):
    """What the stage returns: where the result lives and its headline numbers."""

    evaluation_id: str
    mlflow_run_id: str | None
    mode: str
    label: str
    metrics: dict[str, float]
    table_row: str


def resolve_checkpoint(spec: str, download_to: Path) -> Path:
    """A checkpoint folder for `spec`: a local folder, `runs:/<id>[/path]` or a bare MLflow run id
    (its `checkpoint/` artifact folder is downloaded into `download_to`)."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return p
    if spec.startswith("runs:/"):
        rest = spec[len("runs:/") :].strip("/")
        run_id, _, sub = rest.partition("/")
        uri = f"runs:/{run_id}/{sub or CHECKPOINT_ARTIFACT}"
    elif _RUN_ID.match(spec):
        run_id, uri = spec, f"runs:/{spec}/{CHECKPOINT_ARTIFACT}"
    else:
        raise FileNotFoundError(
            f"checkpoint {spec!r} is neither a local folder nor an MLflow run id (runs:/<id> or 32 hex digits)"
        )
    return download_checkpoint(uri, download_to)


def build_embedder(config: EvalConfig, device, workdir: Path) -> tuple[SentenceEmbedder, dict[str, Any]]:
    """The embedder a config names, and what it is (model, pooler, checkpoint, method)."""
    if config.checkpoint is not None:
        folder = resolve_checkpoint(config.checkpoint, workdir)
        ck = read_checkpoint_config(folder)
        emb = load_checkpoint_folder(folder, device, expect_backbone=config.model, expect_pooler=config.pooler)
        return emb, {
            "model": ck["backbone"],
            "pooler": ck["pooler"],
            "checkpoint": config.checkpoint,
            "method": ck["method"],
        }
    emb = PooledEncoder.from_pretrained(
        config.model, config.pooler, first_layer=config.first_layer, template=config.template, device=device
    )
    return emb, {"model": config.model, "pooler": config.pooler, "checkpoint": None, "method": None}
