"""Issue 23 item 3 (finite or fail), unit level: every configuration refuses inf and nan, and the training loop stops
at the first non-finite loss or gradient norm, naming the step, the phase and the value, before applying the step.
The end-to-end half (the run ends FAILED, nothing registered or exported) is in test_job_results.py."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from cse.config.evaluation import EvalConfig
from cse.config.stages import CorruptConfig
from cse.config.training import PrefixPhaseConfig, TrainConfig, resolve_train_config
from cse.models.method import StepOutput
from cse.training.loop import NonFiniteLoss, Trainer
from tests.reliability.conftest import eight_rows_and_loop


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, "inf", "NaN"])
def test_the_campaigns_learning_rate_inf_is_refused(value):
    with pytest.raises(ValidationError, match="learning_rate"):
        TrainConfig(learning_rate=value)


@pytest.mark.parametrize(
    "build",
    [
        lambda v: TrainConfig(grad_clip=v),
        lambda v: PrefixPhaseConfig(learning_rate=v),
        lambda v: CorruptConfig(mask_ratio=v),
        lambda v: EvalConfig(uniformity_t=v),
        lambda v: EvalConfig(alignment_threshold=v),
        lambda v: resolve_train_config("smoke", {"model": {"temperature": v}}, method="simcse"),
        lambda v: resolve_train_config("smoke", {"model": {"rtd_weight": v}}, method="d2cse"),
        lambda v: resolve_train_config("smoke", {"model": {"discriminator_learning_rate": v}}, method="d2cse"),
        lambda v: resolve_train_config("smoke", {"learning_rate": v}, method="dcpcse"),
    ],
    ids=[
        "grad_clip",
        "prefix_lr",
        "mask_ratio",
        "uniformity_t",
        "alignment_threshold",
        "simcse_temperature",
        "d2cse_rtd_weight",
        "d2cse_discriminator_lr",
        "dcpcse_lr_override",
    ],
)
def test_every_config_refuses_non_finite_numbers(build):
    """New cases of the class: stage, evaluation and method model configs, and overrides of a preset."""
    for value in (math.inf, math.nan):
        with pytest.raises(ValueError, match="finite"):
            build(value)


class _Weighted(torch.nn.Module):
    phases = ("main",)

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.w = torch.nn.Parameter(torch.ones(3))

    def training_step(self, batch, step=0, phase="main"):
        x = batch.input_ids.float()
        if self.kind == "sqrt":  # a finite loss (0) whose gradient is nan: d/dw sqrt(|w - 1|) at w = 1
            return StepOutput(torch.sqrt((self.w - 1).abs()).sum(), {"probe": torch.tensor(1.0)})
        return StepOutput(((x @ self.w) ** 2).mean(), {"contrastive": ((x @ self.w) ** 2).mean()})


def _run(kind: str, lr: float, tmp_path):
    rows, loop = eight_rows_and_loop(lr)
    model = _Weighted(kind)
    saved = []
    trainer = Trainer(
        model,
        rows,
        loop,
        torch.device("cpu"),
        tmp_path / "state",
        lambda *a: saved.append(a),
        lambda m: 0.0,
        lambda *a: None,
    )
    return trainer, model, saved


def test_a_diverging_run_stops_at_the_first_non_finite_loss(tmp_path):
    """A finite but huge learning rate (the config accepts it) blows the weights up after step 1: step 2's loss is
    inf. The loop stops there, names it, and applies nothing of step 2 (step 2 ran: its update was skipped on the
    device by the non-finite guard, so the weights stay those of step 1, finite)."""
    trainer, model, saved = _run("square", 1e30, tmp_path)
    message = r"step 2 of 4 \(phase 'main'\): the loss is inf \(loss=inf, contrastive=inf\)"
    with pytest.raises(NonFiniteLoss, match=message):
        trainer.run()
    assert trainer.step == 2 and torch.isfinite(model.w).all() and saved == []


def test_a_non_finite_gradient_norm_stops_the_run_before_the_optimizer_step(tmp_path):
    trainer, model, _ = _run("sqrt", 0.01, tmp_path)
    with pytest.raises(NonFiniteLoss, match=r"step 1 of 4 .*the gradient norm is nan \(loss=0, probe=1\)"):
        trainer.run()
    assert torch.equal(model.w.detach(), torch.ones(3))  # the nan gradient was never applied
