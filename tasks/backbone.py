"""The backbone's own score before training: the stage `evaluate-backbone` of every test-evaluated training job.

A training job's score means little alone: the packaged MiniLM scores 78.87 with `avg` pooling and less with `[CLS]`
before any training. So before the fit, the job scores its pretrained backbone on the STS test sets with the pooler
(and prompt template) its method evaluates with (`CSEModel.backbone_pooling`), and every table of the job shows that
row beside the trained model and the paper: the run's description and chart, the model card, `cse report`, `compare`
and the summary `cse run` prints.

The result is cached per backbone, pooler, STS data and evaluation precision: it is the `evaluations` dataset whose
key is `cse.storage.keys.backbone_evaluation_key` (`backbone-<hash>`; `cse report` lists it), built once under the
dataset's build lock, so the jobs of a sweep score their shared backbone once.
"""

from __future__ import annotations

import json
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from cse.config.methods import get_method
from cse.config.training import TrainConfig
from cse.models.loading import pick_device
from cse.storage.datasets import DatasetRef, read_dataset
from cse.storage.evaluations import load_sts_input, write_evaluation_row
from cse.storage.keys import backbone_evaluation_key
from cse.storage.layout import DataRoot
from cse.storage.settings import get_settings
from cse.tasks.log import embedding_progress, stage_logger

KIND = "evaluations"


class BackboneScore(BaseModel):
    """The backbone's STS test evaluation before training: its evaluation id (the `evaluations` dataset key), how it
    was read (pooler, template), every metric of the evaluator, and whether it was a cache hit."""

    evaluation_id: str
    backbone: str
    pooler: str
    template: str | None = None
    metrics: dict[str, float]
    cached: bool = False

    @property
    def label(self) -> str:
        """The evaluation row's label: `backbone packaged:minilm (cls_before_pooler)`."""
        return f"backbone {self.backbone} ({self.pooler})"

    def before(self) -> dict[str, Any]:
        """The mapping the MLflow pages, the card and the summaries take (`evaluation_id`, `pooler`, `template`,
        `label`, `metrics`)."""
        return {
            "evaluation_id": self.evaluation_id,
            "pooler": self.pooler,
            "template": self.template,
            "label": self.label,
            "metrics": dict(self.metrics),
        }


def backbone_pooling(cfg: TrainConfig) -> tuple[str, str | None]:
    """The pooler and template the job's backbone is scored with (its method's `backbone_pooling`)."""
    return get_method(cfg.method).model_class.backbone_pooling(cfg.model)


def _cached(root: DataRoot, key: str, cfg: TrainConfig, pooler: str, template: str | None) -> BackboneScore | None:
    from cse.evaluation.results import EvalResult  # lazy: scipy.stats

    manifest, _ = root.reuse(KIND, key, full=True)
    if manifest is None:
        return None
    row = read_dataset(root, KIND, key).to_pylist()[0]
    metrics = EvalResult.model_validate(json.loads(row["details"])).metrics()
    return BackboneScore(
        evaluation_id=key, backbone=cfg.backbone, pooler=pooler, template=template, metrics=metrics, cached=True
    )


def score_backbone(cfg: TrainConfig, sts: DatasetRef) -> BackboneScore:
    """The job's backbone scored on the STS test sets with its method's pooler, before any training: the cached
    evaluation when there is one, else evaluated now and written as the `evaluations` dataset of its key.

    Args:
        cfg: the job's training config (backbone, method and its model config, device, evaluation batch size and
            precision).
        sts: the job's STS dataset.
    """
    from cse.evaluation.evaluator import Evaluator  # lazy: scipy.stats, scikit-learn
    from cse.models.embedder import PooledEncoder
    from cse.tasks.corrupt import generator_identity  # (name or folder, config.json, a folder's files: any model)
    from cse.tasks.evaluate import evaluation_row

    root = DataRoot(get_settings().data_root)
    pooler, template = backbone_pooling(cfg)
    key = backbone_evaluation_key(
        generator_identity(cfg.backbone), pooler, template, sts.content_hash, cfg.eval_precision
    )
    with root.building(KIND, key):
        if (hit := _cached(root, key, cfg, pooler, template)) is not None:
            return hit
        sts_input = load_sts_input(sts.key, root)
        encoder = PooledEncoder.from_pretrained(cfg.backbone, pooler, template=template, device=pick_device(cfg.device))
        result = Evaluator(sts_input.table).run(
            encoder,
            mode="test",
            batch_size=cfg.eval_batch_size,
            precision=cfg.eval_precision,
            on_progress=embedding_progress("evaluate-backbone"),
        )
        score = BackboneScore(
            evaluation_id=key, backbone=cfg.backbone, pooler=pooler, template=template, metrics=result.metrics()
        )
        row = evaluation_row(
            result,
            evaluation_id=key,
            label=score.label,
            what={"model": cfg.backbone, "pooler": pooler, "checkpoint": None, "method": None},
            sts=sts_input,
            mlflow_run_id=None,
        )
        write_evaluation_row(root, row, params={"label": score.label, "backbone": cfg.backbone, "pooler": pooler})
    return score


@task(name="evaluate-backbone", retries=0, cache_policy=NO_CACHE)
def evaluate_backbone(cfg: TrainConfig, sts: DatasetRef) -> BackboneScore:
    """The backbone's own STS test score before training (`score_backbone`), said in the run's log."""
    score = score_backbone(cfg, sts)
    stage_logger().info(
        "backbone before training: %s with pooler %s, STS Avg. %.2f (evaluations/%s %s)",
        cfg.backbone,
        score.pooler,
        score.metrics.get("sts_avg", float("nan")),
        score.evaluation_id,
        "cache hit" if score.cached else "written",
    )
    return score
