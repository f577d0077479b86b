"""The tests' training-loop settings in one place: `loop_config` (every `LoopConfig` field a test does not name takes
the value below), `cpu_trainer` (a CPU `Trainer` whose save-best, dev-evaluation and metric callbacks do nothing
unless given) and `heads_ingest` (a training job's data: the heads of the shared files)."""

from __future__ import annotations

from pathlib import Path

import torch

from cse.training.loop import LoopConfig, Trainer

TEST_LOOP = {
    "batch_size": 4,
    "learning_rate": 0.01,
    "epochs": 1,
    "max_steps": None,
    "grad_clip": 1.0,
    "seed": 0,
    "eval_steps": 100,
    "checkpoint_steps": 100,
    "log_steps": 1,
    "precision": "fp32",
    "deterministic": True,
}


def loop_config(**overrides) -> LoopConfig:
    """`LoopConfig` with `TEST_LOOP`'s values where `overrides` names no other."""
    return LoopConfig(**{**TEST_LOOP, **overrides})


def cpu_trainer(model, data, loop: LoopConfig, state: Path, *, log_metrics=None, hooks=()) -> Trainer:
    """A `Trainer` on the CPU: no best checkpoint is kept, the dev score is 0.0, metrics go to `log_metrics` (or
    nowhere)."""
    return Trainer(
        model,
        data,
        loop,
        torch.device("cpu"),
        state,
        lambda *a: None,
        lambda m: 0.0,
        log_metrics or (lambda *a: None),
        hooks=hooks,
    )


def heads_ingest(wiki: Path, senteval: Path) -> dict:
    """A training job's `ingest` override reading a head of the Wiki1M sample (`wiki_cut`) and of every SentEval file
    (`senteval_cut`): the row counts of the full SentEval files do not hold for them."""
    return {
        "datasets": ["wiki1m", "sts"],
        "wiki": {"path": str(wiki)},
        "senteval": {"path": str(senteval), "expected_rows": None},
    }
