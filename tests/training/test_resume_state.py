"""training/loop.py keeps its resume state in the files `cse.storage.runs.ResumeState` names (the job folder's
`RunDir.resume_state`): written whole, found again on resume, and `RunDir.has_state` agrees."""

from __future__ import annotations

import json

import numpy as np
import torch

from cse.models.method import StepOutput
from cse.storage.runs import ResumeState, RunDir
from cse.storage.training_data import TokenRows
from cse.training.loop import StopAfter, Trainer, TrainingInterrupted
from cse.training.rows import TrainingRows
from tests.loops import cpu_trainer, loop_config


class Weighted(torch.nn.Module):
    """The smallest trainable method: a weight per token position."""

    phases = ("main",)

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def training_step(self, batch, step=0, phase="main"):
        return StepOutput(((batch.input_ids.float() @ self.w) ** 2).mean() / 100)


def _trainer(state, stop_after=None, hooks=(), **loop_kw) -> Trainer:
    seqs = [np.array([1, i + 3, 2]) for i in range(8)]
    rows = TrainingRows(TokenRows(ids=np.arange(8), seqs={"text": seqs}), None, supervised=False, pad_id=0)
    loop = loop_config(epochs=2, eval_steps=2, checkpoint_steps=2, **loop_kw)
    torch.manual_seed(0)
    return cpu_trainer(
        Weighted(), rows, loop, state, hooks=[*hooks, *([StopAfter(stop_after)] if stop_after is not None else [])]
    )


def test_the_loop_writes_and_resumes_from_the_files_the_run_folder_names(tmp_path):
    run_dir = RunDir("simcse", "state-test", home=tmp_path)
    state = run_dir.resume_state
    assert state.folder == run_dir.state and not run_dir.has_state()
    try:
        _trainer(state, stop_after=2).run()
    except TrainingInterrupted:
        pass
    assert run_dir.has_state() and state.exists()
    assert sorted(p.name for p in state.folder.iterdir()) == sorted(
        p.name for p in (state.trainable, state.optimizer, state.progress)
    )
    assert json.loads(state.progress.read_text())["step"] == 2
    result = _trainer(state).run()
    assert result.resumed_from == 2 and result.steps == 4


def test_a_bare_folder_means_the_same_file_names(tmp_path):
    trainer = _trainer(tmp_path / "state")
    assert isinstance(trainer.state, ResumeState) and trainer.state.folder == tmp_path / "state"
    elsewhere = trainer.state.within(tmp_path / "tmp")
    names = lambda state: [p.name for p in (state.trainable, state.optimizer, state.progress)]
    assert names(elsewhere) == names(trainer.state)
    assert elsewhere.folder == tmp_path / "tmp"
