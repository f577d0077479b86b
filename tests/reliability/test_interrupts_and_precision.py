"""Issue 32, the blemishes of runs that held: a SIGTERM'd training run, its resume, the non-finite stop's message,
fp16 on a CPU.

- After SIGTERM and resume, a step appeared twice in the `loss` history (the steps between the resume state and
  the kill ran, and were logged, again), and the interrupted run showed FAILED, not KILLED, until the rerun.
- `NonFiniteLoss` said "the resume state holds the last good step" when no `state/` folder existed.
- fp16 on a CPU ran without a GradScaler (it was enabled on CUDA only), and nothing said so.
(The fourth, error messages echoing a 10 MB value, is in test_cli_edges.py.)"""

from __future__ import annotations

import os
import signal

import mlflow
import pytest
import torch

from cse.models.method import StepOutput
from cse.training.loop import NonFiniteLoss, Trainer, TrainerHooks
from tests.reliability.conftest import eight_rows_and_loop, tiny_job_config

pytestmark = pytest.mark.filterwarnings("ignore:Logger 'prefect.task_runs' attempted to send logs:UserWarning")


class _SigtermAt(TrainerHooks):
    """Send this process SIGTERM after step `step` (its logging done, its resume state not written)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, batch, metrics) -> None:
        if trainer.step == self.step and not getattr(trainer, "_sent", False):
            trainer._sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigtermd_run_ends_killed_and_its_resume_logs_every_step_once(
    data_root, tiny_bert_dir, monkeypatch, prefect_harness
):
    """A flow run gets SIGTERM at step 3 (Prefect turns it into `TerminationSignal`, then passes the signal on to the
    process's handler); its resume state is step 2. The MLflow run ends KILLED; the rerun resumes at step 2, runs
    step 3 again and logs it only once."""
    from prefect import flow
    from prefect.exceptions import TerminationSignal

    import cse.training.job as job_module
    from cse.flows.train import train_job

    folder, refs = data_root
    monkeypatch.setenv("CSE_DATA_ROOT", str(folder))
    monkeypatch.setattr(job_module, "StopAfter", _SigtermAt)  # `stop_after=3` sends SIGTERM at step 3
    cfg = tiny_job_config(tiny_bert_dir, max_steps=4, eval_steps=4, checkpoint_steps=2, log_steps=1)

    @flow(name="reliability-sigterm")
    def train(stop_after=None):
        return train_job(cfg, refs["tokens"], None, refs["sts"], stop_after=stop_after)

    # after its crash handling Prefect sends SIGTERM again to the handler it found: the default one would end pytest
    resent: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: resent.append(signum))
    try:
        with pytest.raises(TerminationSignal):
            train(stop_after=3)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert resent == [signal.SIGTERM]
    [run] = mlflow.search_runs(experiment_names=["simcse"], output_format="list", max_results=1)
    assert run.info.status == "KILLED"
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "loss/loss")
    assert sorted(m.step for m in history) == [1, 2, 3]

    result = train()
    assert result.run_id == run.info.run_id and result.resumed_from == 2 and result.steps == 4
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "loss/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]  # step 3 ran twice, is logged once
    assert mlflow.get_run(run.info.run_id).info.status == "FINISHED"


class _Square(torch.nn.Module):
    phases = ("main",)

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def training_step(self, batch, step=0, phase="main"):
        loss = ((batch.input_ids.float() @ self.w) ** 2).mean()
        return StepOutput(loss, {"contrastive": loss})


def _trainer(state_folder, lr: float, precision: str = "fp32", checkpoint_steps: int = 100, hooks=()) -> Trainer:
    rows, loop = eight_rows_and_loop(lr, precision, checkpoint_steps)
    return Trainer(
        _Square(),
        rows,
        loop,
        torch.device("cpu"),
        state_folder,
        lambda *a: None,
        lambda m: 0.0,
        lambda *a: None,
        hooks=list(hooks),
    )


@pytest.mark.parametrize("written", [False, True])
def test_the_non_finite_stop_says_whether_a_resume_state_exists(written, tmp_path):
    """A learning rate of 1e30 blows the weights up after step 1: step 2's loss is inf. With `checkpoint_steps: 1`
    step 1's state was written; without, none was."""
    trainer = _trainer(tmp_path / "state", 1e30, checkpoint_steps=1 if written else 100)
    with pytest.raises(NonFiniteLoss) as e:
        trainer.run()
    text = str(e.value)
    assert (tmp_path / "state").is_dir() == written
    if written:
        assert "the resume state holds the last state written before it" in text
    else:
        assert "no resume state had been written yet, so a rerun starts from step 0" in text
        assert "resume state holds" not in text


def test_fp16_on_a_cpu_scales_its_loss_and_resumes(tmp_path):
    from cse.training.loop import StopAfter, TrainingInterrupted

    trainer = _trainer(tmp_path / "state", 0.01, precision="fp16", checkpoint_steps=2, hooks=[StopAfter(2)])
    assert trainer.scaler.is_enabled()
    with pytest.raises(TrainingInterrupted):
        trainer.run()
    scale = trainer.scaler.get_scale()
    resumed = _trainer(tmp_path / "state", 0.01, precision="fp16", checkpoint_steps=2)
    result = resumed.run()
    assert result.resumed_from == 2 and result.steps == 4 and resumed.scaler.is_enabled()
    assert scale > 0 and torch.isfinite(resumed.model.w).all()
