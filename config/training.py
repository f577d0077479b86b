"""Training configuration: one typed model per training job; presets per method in config/presets.py.

`model` is the method's typed model config: the frozen pydantic dataclass of `models/` that the method registry
(config/methods.py) names for `method` (`D2CSEModelConfig`, `SimCSEConfig`, ...), the single typed source of those
fields. It is given as a dict (presets, overrides, deployment parameters), validated and completed with the
method's defaults, and dumped as a dict again (so hashes and MLflow params name every field). `backbone` is a
top-level field only; the model config's own `backbone` is always the job's. The job-level defaults are the D2CSE paper's unsupervised BERT-base setting (Lee, 2023, Table 7):
bert-base-uncased, Wiki1M, batch 144, lr 0.021, masking 0.3, λ 0.005, 2 epochs, prompt length 16,
no [CLS] prompt, generator distilbert-base-uncased. Optimisation follows the HF Trainer defaults
all references use (SimCSE, princeton-nlp/SimCSE): AdamW (β 0.9/0.999, ε 1e-8, no weight decay), linear decay
to 0 without warm-up, gradient clipping at 1.0, STS-B dev every 125 steps, best checkpoint kept.

Distributed training (`nproc_per_node` × `nnodes` > 1): the `train` task launches torchrun
(training/distributed.py); `batch_size` stays the global batch, split over the ranks, and a step computes
what one process computes on the whole batch (models/distributed.py). These launch fields are left out of the
job's identity (`LAUNCH_FIELDS`), so a job resumes on another number of GPUs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_serializer, model_validator

from cse.config import published
from cse.config.limits import check_parameter
from cse.config.methods import DEFAULT_METHOD, REGISTRY, get_method
from cse.config.presets import deep_merge
from cse.config.stages import CorruptConfig, IngestConfig, TokenizeConfig, _Config
from cse.models.method import MethodConfig

# How a job runs, not what it computes (how many processes; the speed switches, whose results equal the plain step's
# within float tolerance): excluded from the run key (training.job.run_key).
LAUNCH_FIELDS = frozenset({"nproc_per_node", "nnodes", "speed"})
# Fields added after jobs had been keyed, with their defaults, where they sit in the job's config: a field at its
# default is left out of the job's identity (cse.training.job.run_key; `cse.storage.keys.without_defaults`), so the
# jobs that finished before it existed keep their run keys and stay cache hits. The rule for every new field that
# changes nothing at its default: add it here, a model field under "model", a corruption field under "corrupt".
KEY_NEUTRAL_DEFAULTS: dict[str, Any] = {
    "grad_cache": {"chunk_size": None},  # a section added whole: left out while all of it is at its defaults
    "model": {
        "dropout": None,
        "train_prompts": True,
        "prefix_init": "normal",
        "shared_prefix": False,
        "head_learning_rate": None,
        "discriminator_learning_rate": None,  # DiffCSE's (D2CSE's has a number: 7e-6, kept in its keys)
    },
    "corrupt": {"hard": False},
}
DEFAULT_BACKBONE = "bert-base-uncased"


def required_variants(epochs: int, supervised: bool) -> int:
    """Corruption variants for a fresh corruption of every view of every epoch (the reference's on-the-fly
    generation, voidism/DiffCSE): each column is read by 2 views unsupervised (the sentence twice) and by 1
    supervised (anchor, entailment and contradiction are columns). See training/rows.py."""
    return epochs * (1 if supervised else 2)


class PrefixPhaseConfig(_Config):
    """DiffAug stage 1 (Wang & Lu, 2022): prefix-only tuning on NLI for a fixed number of steps, cycling the data."""

    steps: int = Field(default=2000, ge=1)
    learning_rate: float = Field(default=1e-3, gt=0)
    batch_size: int = Field(default=128, ge=2)
    schedule_over_joint_steps: bool = Field(
        default=True,
        description="reference quirk: its linear decay is computed over the stage-2 step count, so it never reaches 0",
    )


class GradCacheConfig(_Config):
    """Exact gradient caching (Gao et al., 2021; models/grad_cache.py): the paper's batch in the memory of a chunk."""

    chunk_size: int | None = Field(
        default=None,
        ge=1,
        description="rows (sentences × views) of each rank's batch encoded at a time; the loss still sees the whole "
        "batch and the gradients are those of the whole batch. None = off (every pass on the whole batch)",
    )


class SpeedConfig(_Config):
    """How fast a job runs, not what it computes (docs/gpu.md; left out of the run key, `LAUNCH_FIELDS`).

    Each switch leaves the losses and gradients equal to the plain step's within float tolerance (the tests prove it
    on CPU, tests/training/test_speed.py). None keeps the loop's default, which an environment variable may set
    (`CSE_COMPILE`, `CSE_FUSED_ADAMW`, ...; training/loop.py).
    """

    compile: bool | None = Field(
        default=None,
        description="torch.compile of the whole training step as one graph (CUDA graphs on a GPU); None: on a GPU for a "
        "run of at least 3,000 steps (where the compilation repays itself), else off (CSE_COMPILE=0|1 overrides)",
    )
    compile_mode: str = Field(
        default="",
        description="torch.compile mode; empty: reduce-overhead (CUDA graphs) on a GPU, default elsewhere",
    )
    fused_adamw: bool | None = Field(default=None, description="AdamW's fused kernels; None: wherever torch has them")
    cast_frozen_weights: bool = Field(
        default=True, description="bf16/fp16 copies of the frozen Linear weights made once, not at every use (exact)"
    )
    pad_to_max_length: bool = Field(
        default=True, description="every batch padded to max_length (one shape for every step; exact)"
    )
    unpadded_fill: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="unpadded passes (models/prompts/packing.py): every training encoder pass, and a discriminator "
        "pass whose RTD mean reads real tokens only (rtd_mean_over_padding=False), runs over its real tokens packed "
        "into a fixed budget of ceil(fill x rows x length) token slots (one shape: compiled graphs and CUDA graphs "
        "stay); a batch with more real tokens is an error. Losses and gradients equal the padded step's within float "
        "tolerance with dropout off; with dropout on, its masks are drawn over the packed shape (the same "
        "distribution, other draws). None (default): padded passes",
    )
    async_state: bool = Field(default=True, description="resume states written on a background thread")
    state_interval_s: float | None = Field(
        default=None,
        ge=0,
        description="at a checkpoint step, write the resume state only when this many seconds passed since the last "
        "one (0: at every checkpoint step; a kill loses at most this much training); None: on a GPU 50 × the last "
        "state's cost (at most ~2 % of the run), elsewhere 0",
    )


class TrainConfig(_Config):
    """The full configuration of a training job: method, preset, backbone, data, corruption and model settings."""

    model_config = ConfigDict(arbitrary_types_allowed=True)  # (extra="forbid", frozen and finite numbers: _Config's)

    method: str = Field(
        default=DEFAULT_METHOD,
        description="a method of the registry (config/methods.py); an unknown name is refused with the known ones",
    )
    preset: str = "default"
    backbone: str = Field(
        default=DEFAULT_BACKBONE,
        min_length=1,
        pattern=r"\S",
        description="HF model id, local folder or packaged:minilm (never empty)",
    )
    supervised: bool = False
    ingest: IngestConfig = IngestConfig()
    max_length: int = Field(default=32, ge=4)
    corrupt: CorruptConfig = CorruptConfig()
    model: MethodConfig = Field(
        default=None,
        validate_default=True,
        description="the method's typed model config (given and dumped as a dict, backbone excluded)",
    )
    prefix_phase: PrefixPhaseConfig | None = Field(
        default=None, description="DiffAug stage 1; None for every other method"
    )
    aux_nli_batch_size: int = Field(
        default=0, ge=0, description="DiffAug semi w/ aux: NLI rows batched beside each Wiki batch"
    )

    batch_size: int = Field(default=144, ge=2)
    learning_rate: float = Field(default=0.021, gt=0)
    epochs: int = Field(default=2, ge=1)
    max_steps: int | None = Field(
        default=None,
        ge=1,
        description="stop after this many optimiser steps (smoke runs); "
        "None = no limit (0 is refused, never a synonym of None)",
    )
    max_train_sentences: int | None = Field(
        default=None, ge=1, description="use only the first N training rows; None = all"
    )
    grad_clip: float = Field(default=1.0, gt=0, description="global gradient-norm clipping threshold")
    grad_cache: GradCacheConfig = GradCacheConfig()
    speed: SpeedConfig = SpeedConfig()
    seed: int = Field(default=42, ge=0)
    eval_steps: int = Field(default=125, ge=1)
    checkpoint_steps: int | None = Field(default=None, ge=1, description="resume-state cadence; None = eval_steps")
    eval_batch_size: int = Field(default=128, ge=1)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        default="auto", description="training autocast; auto: bf16 on GPU, fp32 on CPU"
    )
    eval_precision: Literal["fp32", "tf32", "bf16"] = Field(
        default="fp32",
        description="STS-B dev selection and the test evaluation: fp32 as the reference evaluates; tf32 or bf16 only "
        "when asked (benchmarks/gpu_speed.py checks on a GPU whether they keep the seven STS scores within ±0.01)",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    deterministic: bool = Field(
        default=False, description="torch deterministic algorithms (resume gives bit-identical weights)"
    )
    log_steps: int = Field(default=10, ge=1)
    system_metrics: bool = True
    test_evaluation: bool = True
    selection: Literal["stsb", "transfer"] = Field(
        default="stsb",
        description="checkpoint selection every eval_steps: stsb = STS-B dev Spearman (the papers); transfer = "
        "the average dev accuracy of SentEval's 7 transfer tasks in SimCSE's fasttest settings "
        "(SimCSE's trainer `eval_transfer`; metric transfer_dev_avg)",
    )
    transfer_evaluation: bool = Field(
        default=False,
        description="test-evaluate the selected checkpoint on the 7 transfer tasks too (SentEval test settings; "
        "metrics mr … mrpc, transfer_avg in the training run); implied by selection transfer",
    )
    nproc_per_node: int = Field(
        default=1,
        ge=1,
        description="training processes (one per GPU) on each node; > 1 "
        "launches torchrun (training/distributed.py); batch sizes stay global",
    )
    nnodes: int = Field(
        default=1,
        ge=1,
        description="nodes of a multi-node job: rendezvous at $CSE_RDZV_ENDPOINT "
        "(host:port); the task runs node 0's torchrun and logs the command the other nodes run",
    )

    @model_validator(mode="before")
    @classmethod
    def _typed_model(cls, data: Any) -> Any:
        """`model` as a dict (or a model config) → the method's typed config, with the job's backbone."""
        if not isinstance(data, dict):
            return data
        spec = get_method(data.get("method", DEFAULT_METHOD))
        fields = data.get("model") or {}
        if isinstance(fields, MethodConfig):
            fields = {k: v for k, v in fields.to_dict().items() if k != "backbone"}
        if not isinstance(fields, dict):
            raise ValueError(
                f"model must be a dict of {spec.config_class.__name__} fields, got {type(fields).__name__}"
            )
        return {**data, "model": spec.model_config(str(data.get("backbone", DEFAULT_BACKBONE)), fields)}

    @field_serializer("model")
    def _dump_model(self, model: MethodConfig) -> dict[str, Any]:
        return {k: v for k, v in model.to_dict().items() if k != "backbone"}

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        spec = get_method(self.method)
        if not isinstance(self.model, spec.config_class):
            raise ValueError(f"model of method {self.method} must be a {spec.config_class.__name__}")
        if self.model.backbone != self.backbone:  # a copy with another backbone: the job's backbone is the one
            object.__setattr__(self, "model", replace(self.model, backbone=self.backbone))
        cls = spec.model_class
        if cls.uses_corruption:  # the reference: a fresh corruption per view and epoch, drawn from the job's seed
            object.__setattr__(
                self, "corrupt", self.corrupt.for_job(self.seed, required_variants(self.epochs, self.supervised))
            )
        if self.grad_cache.chunk_size is not None and (reason := cls.grad_cache_refusal(self.model)):
            raise ValueError(f"grad_cache.chunk_size: {self.method} cannot cache gradients exactly here: {reason}")
        phases = cls.phases
        if "prefix" in phases and self.prefix_phase is None:
            raise ValueError(f"method {self.method} trains a prefix phase first: set prefix_phase")
        if "prefix" not in phases and self.prefix_phase is not None:
            raise ValueError(f"method {self.method} has no prefix phase; prefix_phase must be null")
        if self.aux_nli_batch_size and not spec.accepts_aux_nli:
            takers = [name for name, other in REGISTRY.items() if other.accepts_aux_nli]
            raise ValueError(
                f"aux_nli_batch_size: method {self.method} takes no auxiliary NLI batch (methods that do: {takers})"
            )
        world = self.world_size
        batches = {
            "batch_size": self.batch_size,
            "aux_nli_batch_size": self.aux_nli_batch_size or world,
            "prefix_phase.batch_size": self.prefix_phase.batch_size if self.prefix_phase else world,
        }
        small = {k: v for k, v in batches.items() if v < world}
        if small:
            raise ValueError(f"global batch sizes {small} are smaller than the {world} training processes")
        return self

    @property
    def world_size(self) -> int:
        """Training processes of the job (`nproc_per_node × nnodes`)."""
        return self.nproc_per_node * self.nnodes

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def uses_corruption(self) -> bool:
        return get_method(self.method).uses_corruption

    @property
    def needs_nli(self) -> bool:
        """NLI rows beside the main dataset (DiffAug's stage 1 and auxiliary loss)."""
        return self.prefix_phase is not None or self.aux_nli_batch_size > 0

    @property
    def dataset(self) -> Literal["wiki1m", "nli"]:
        return "nli" if self.supervised else "wiki1m"

    def tokenize_config(self) -> TokenizeConfig:
        return TokenizeConfig(tokenizer=self.backbone, max_length=self.max_length)


def resolve_train_config(
    preset: str = "default", overrides: dict[str, Any] | None = None, method: str = DEFAULT_METHOD
) -> TrainConfig:
    """The TrainConfig of `method`'s `preset` (config/presets.py) with `overrides` (a nested dict) merged in."""
    spec = get_method(method)
    fields = spec.preset(preset)
    overrides = dict(check_parameter("overrides", overrides or {}))  # not 900 levels deep, not 10 MB
    if overrides.get("method", method) != method:
        raise ValueError(f"overrides name method {overrides['method']!r} but the preset belongs to {method!r}")
    base = {"method": method, "preset": preset}
    return TrainConfig.model_validate(deep_merge(deep_merge(base, dict(fields)), overrides))


def preset_row(method: str, preset: str) -> tuple[str, str | None, str]:
    """(method, backbone family, setting) of a preset: the published row it reproduces (config/published.py; family
    None: no paper reports its backbone)."""
    cfg = resolve_train_config(preset, method=method)
    return method, published.backbone_family(cfg.backbone), published.setting_of(method, preset, cfg.supervised)


def presets_for(key: tuple[str, str | None, str]) -> list[str]:
    """The presets of `key`'s method that reproduce that published row, in preset order (the first is canonical)."""
    from cse.config.presets import PRESETS

    method = key[0]
    return [p for p in PRESETS.get(method, {}) if preset_row(method, p) == key]
