"""Parameters of the evaluation stage (flow `evaluate`; SimCSE's evaluation.py and SentEval)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from cse.config.stages import _Config
from cse.storage.secrets import redact

DEFAULT_EXPERIMENT = "evaluation"  # where an evaluation of anything but a training job's checkpoint is logged

Pooler = Literal["cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2", "mask"]
Task = Literal["sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr"]
TransferTask = Literal["mr", "cr", "subj", "mpqa", "sst2", "trec", "mrpc"]


class EvalConfig(_Config):
    """What to evaluate, on which data, and the protocol choices the papers leave open.

    Evaluate either a plain encoder (`model` + `pooler`) or a training run's checkpoint
    (`checkpoint`: a local folder with `cse_model.json`, `runs:/<mlflow run id>` or a bare run id,
    whose `checkpoint/` artifact folder is downloaded). With a checkpoint, `pooler` is optional and,
    when given, must equal the checkpoint's pooler; `model` is optional and, when it names another
    place than the recorded backbone (e.g. a local copy), the backbone is loaded from there and must
    have the recorded shape and weights (`cse.models.checkpoint` refuses it otherwise).

    Open protocol choices (docs/methods-overview.md), recorded here: retrieval reports both duplicate
    rules with `retrieval_match` as headline; alignment positives are gold >= 4 (338 STS-B test pairs;
    `alignment_inclusive=False` gives SimCSE paper's > 4, 231 pairs); uniformity uses all 2,758
    sentences unless `uniformity_dedup`.
    """

    model: str | None = Field(
        default=None, min_length=1, pattern=r"\S", description="HF model id, local folder or `packaged:minilm`"
    )
    pooler: Pooler | None = Field(default=None, description="required with `model`; a checkpoint brings its own")
    checkpoint: str | None = Field(
        default=None,
        min_length=1,
        pattern=r"\S",
        description="checkpoint folder, `runs:/<run id>` or a bare MLflow run id (never empty)",
    )
    first_layer: Literal[0, 1] = Field(
        default=0,
        description="hidden_states index used as 'first' by avg_first_last: 0 = embeddings (DiffCSE/DCPCSE code), 1 = first layer (SimCSE's current code)",
    )
    template: str | None = Field(
        default=None, description="prompt template with {sentence} (and [MASK] for pooler 'mask')"
    )
    mode: Literal["test", "dev", "transfer"] = Field(
        default="test",
        description="test: the seven STS tasks (+ extras); dev: STS-B/SICK-R dev; transfer: SentEval's "
        "seven classification tasks (evaluation/transfer.py)",
    )
    tasks: tuple[Task, ...] | None = Field(
        default=None, description="test-mode subset of the seven tasks; None = all (Avg. needs all)"
    )
    sts: str | None = Field(
        default=None,
        description="an `sts` dataset key in the data root or a SentEval folder; None = for a training job's "
        "checkpoint the `sts` dataset the job was evaluated on, else the shared mirror, else the newest ingested "
        "`sts` dataset",
    )
    transfer: str | None = Field(
        default=None,
        description="mode transfer: a `transfer` dataset key or a SentEval folder; None = the shared mirror, else "
        "the newest ingested `transfer` dataset",
    )
    transfer_tasks: tuple[TransferTask, ...] | None = Field(
        default=None,
        description="mode transfer: subset of MR, CR, SUBJ, MPQA, SST-2, TREC, MRPC; None = all (Avg. needs all)",
    )
    transfer_classifier: Literal["test", "fasttest"] = Field(
        default="test",
        description="SentEval classifier settings: test = the papers' (Adam, batch 64, tenacity 5, epoch "
        "size 4, 10 folds); fasttest = their dev mode (RMSprop, batch 128, tenacity 3, epoch size 2, 5 folds)",
    )
    transfer_limit: int | None = Field(
        default=None,
        ge=10,
        description="mode transfer: keep about this many evenly spaced examples per task split (smoke runs, tests)",
    )
    batch_size: int = Field(default=128, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["auto", "fp32", "tf32", "bf16"] = Field(
        default="fp32",
        description="fp32 as the reference evaluates; tf32 matmuls or bf16 (or auto: bf16 on GPU) only when asked, "
        "and recorded",
    )
    retrieval_match: Literal["index", "string"] = Field(
        default="string",
        description="headline duplicate rule of retrieval (both are logged): index = exact corpus position, string = deduplicated corpus",
    )
    retrieval_ks: tuple[int, ...] = (1, 3, 5, 10)
    alignment_threshold: float = Field(
        default=4.0,
        ge=0.0,
        le=5.0,
        description="positive pairs: gold >= threshold (> when alignment_inclusive is false)",
    )
    alignment_inclusive: bool = True
    uniformity_t: float = Field(default=2.0, gt=0.0)
    uniformity_dedup: bool = Field(default=False, description="uniformity over distinct sentences instead of all 2,758")
    extras: bool = Field(default=True, description="test mode: retrieval, alignment/uniformity, qualitative, plots")
    label: str | None = Field(
        default=None, description="row label in tables; default: model + pooler or the checkpoint"
    )
    experiment: str | None = Field(
        default=None,
        min_length=1,
        pattern=r"\S",
        description=f"MLflow experiment; None = the training run's experiment for a checkpoint of a training job (the "
        f"evaluation's run is nested under the job's run), else `{DEFAULT_EXPERIMENT}`",
    )
    progress: bool = True

    @field_validator("label", "experiment")
    @classmethod
    def _masked(cls, text: str | None) -> str | None:
        """Free text the user gives is stored (run names, tables, the `evaluations` dataset): credentials masked."""
        return None if text is None else redact(text)

    @model_validator(mode="after")
    def _what(self) -> EvalConfig:
        if self.model is None and self.checkpoint is None:
            raise ValueError("set `model` (with `pooler`) or `checkpoint`")
        if self.checkpoint is None and self.pooler is None:
            raise ValueError(f"`pooler` is required to evaluate model {self.model!r}")
        if self.mode == "transfer" and self.tasks is not None:
            raise ValueError("`tasks` names STS tasks; in transfer mode use `transfer_tasks`")
        if self.mode == "dev" and self.tasks is not None and any(t not in ("stsb", "sickr") for t in self.tasks):
            raise ValueError("dev mode scores only stsb and sickr")
        if any(k < 1 for k in self.retrieval_ks):
            raise ValueError("retrieval_ks must be positive")
        return self

    def display_label(self) -> str:
        if self.label:
            return self.label
        if self.checkpoint:
            return f"checkpoint {self.checkpoint}"
        return f"{self.model} ({self.pooler})"

    def evaluator_kwargs(self) -> dict:
        return dict(
            retrieval_match=self.retrieval_match,
            retrieval_ks=self.retrieval_ks,
            alignment_threshold=self.alignment_threshold,
            alignment_inclusive=self.alignment_inclusive,
            uniformity_t=self.uniformity_t,
            uniformity_dedup=self.uniformity_dedup,
        )
