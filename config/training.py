"""Training configuration: one typed model per training job, presets in `presets()`.

Defaults are the D2CSE paper's unsupervised BERT-base setting (Table 7; methods.md §5):
bert-base-uncased, Wiki1M, batch 144, lr 0.021, masking 0.3, λ 0.005, 2 epochs, prompt length 16,
no [CLS] prompt, generator distilbert-base-uncased. Optimisation follows the HF Trainer defaults
all references use (methods.md §1.5): AdamW (β 0.9/0.999, ε 1e-8, no weight decay), linear decay
to 0 without warm-up, gradient clipping at 1.0, STS-B dev every 125 steps, best checkpoint kept.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from config.stages import CorruptConfig, IngestConfig, TokenizeConfig, _Config


class D2CSEParams(_Config):
    """Model hyperparameters of D2CSE (methods.md §1.4, §5)."""

    prefix_len: int = Field(default=16, ge=1)
    prefix_dropout: float = 0.1
    prefix_projection: bool = False
    prefix_hidden: int = 512
    cls_prompt: bool = False
    temperature: float = 0.05
    rtd_weight: float = Field(default=0.005, ge=0.0, description="λ of L = L_CL + λ·L_CRTD")
    shift_positions: bool = Field(default=True, description="reference quirk: token positions start at P (methods.md §1.4 item 6)")
    rtd_mean_over_padding: bool = Field(default=True, description="reference: RTD CE averaged over all positions incl. padding")
    hard_negative_weight: float = 0.0


class TrainConfig(_Config):
    method: Literal["d2cse"] = "d2cse"
    preset: str = "default"
    backbone: str = "bert-base-uncased"
    supervised: bool = False
    ingest: IngestConfig = IngestConfig()
    max_length: int = 32
    corrupt: CorruptConfig = CorruptConfig()
    model: D2CSEParams = D2CSEParams()

    batch_size: int = Field(default=144, ge=2)
    learning_rate: float = 0.021
    epochs: int = Field(default=2, ge=1)
    max_steps: int | None = Field(default=None, description="stop after this many optimiser steps (smoke runs)")
    max_train_sentences: int | None = Field(default=None, description="use only the first N training rows")
    grad_clip: float = 1.0
    seed: int = 42
    eval_steps: int = Field(default=125, ge=1)
    checkpoint_steps: int | None = Field(default=None, description="resume-state cadence; default = eval_steps")
    eval_batch_size: int = 128
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(default="auto", description="auto: bf16 on GPU, fp32 on CPU")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    deterministic: bool = Field(default=False, description="torch deterministic algorithms (resume gives bit-identical weights)")
    log_steps: int = Field(default=10, ge=1)
    system_metrics: bool = True
    test_evaluation: bool = True

    @model_validator(mode="after")
    def _tokenizer_matches(self) -> TrainConfig:
        if self.max_length < 4:
            raise ValueError("max_length must be at least 4")
        return self

    @property
    def dataset(self) -> Literal["wiki1m", "nli"]:
        return "nli" if self.supervised else "wiki1m"

    def tokenize_config(self) -> TokenizeConfig:
        return TokenizeConfig(tokenizer=self.backbone, max_length=self.max_length)
