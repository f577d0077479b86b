"""A training job's resume state, read and written: the files `cse.storage.runs.ResumeState` names, as the `Trainer`
(training/loop.py) records them at checkpoint steps and reads them back when a job resumes.

- `load_resume_state`: the one reading of a state (progress, trainable tensors, optimizer payload), each file checked
  against the size and hash recorded when it was written; `ResumeStateDamaged` names the file that is not right.
- `snapshot_state`: what a state holds, copied to host memory (`cse.training.state_writer` writes it).
- `rng_state` / `set_rng_state`: the random number generators a state carries.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from cse.models.checkpoint import frozen_parameter_names
from cse.storage.runs import ResumeState, ResumeStateDamaged, check_file_records
from cse.training.state_writer import StateSnapshot, host_copy, require_finite_state


@dataclass
class LoadedState:
    """A resume state as read (nothing applied yet): `progress` (step, best score, phase, schedule signature),
    the trainable `tensors` and the `payload` (optimizer, scheduler, scaler, RNG states)."""

    progress: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    payload: dict[str, Any]


def load_resume_state(state: ResumeState, map_location: str | None = None) -> LoadedState:
    """Read the resume state in `state` (the payload's tensors onto `map_location`; None: where they were saved).

    Raises `ResumeStateDamaged` naming the file when one is missing, unreadable or differs from the size and hash
    recorded when it was written."""
    progress = state.progress
    try:
        meta = json.loads(progress.read_text())
        step = meta["step"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ResumeStateDamaged(progress, f"unreadable ({type(e).__name__}: {e})") from None
    recorded = meta.get("files") or {}
    for path in (state.trainable, state.optimizer):
        if not path.is_file():
            raise ResumeStateDamaged(path, "missing")
        if problems := check_file_records(
            state.folder, {path.name: recorded[path.name]} if path.name in recorded else {}
        ):
            raise ResumeStateDamaged(path, problems[0].split(": ", 1)[1])
    try:
        tensors = load_file(str(state.trainable))
    except Exception as e:  # noqa: BLE001 - safetensors' errors name no file
        raise ResumeStateDamaged(state.trainable, f"unreadable ({type(e).__name__}: {e})") from None
    try:
        payload = torch.load(state.optimizer, weights_only=False, map_location=map_location)
    except Exception as e:  # noqa: BLE001 - torch.load's errors name no file either
        raise ResumeStateDamaged(state.optimizer, f"unreadable ({type(e).__name__}: {e})") from None
    require_finite_state(state, tensors, payload)  # nan/inf in a state whose hashes match: damaged too
    return LoadedState({**meta, "step": step}, tensors, payload)


def snapshot_state(
    model: torch.nn.Module, stateful: Mapping[str, Any], progress: dict[str, Any], extra: dict[str, Any]
) -> StateSnapshot:
    """A resume state of `model` in host memory: its trainable tensors (the frozen backbone weights are rebuilt from
    its name), the `state_dict()` of each of `stateful` (optimizer, scheduler, scaler) with this process's RNG states
    and `extra`, and `progress`."""
    frozen = frozen_parameter_names(model)
    return StateSnapshot(
        tensors={
            k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items() if k not in frozen
        },
        payload=host_copy({**{k: v.state_dict() for k, v in stateful.items()}, **rng_state(), **extra}),
        progress=progress,
    )


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch (CPU and every CUDA device), NumPy and Python."""
    return {
        "rng_torch": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "rng_numpy": np.random.get_state(),
        "rng_python": random.getstate(),
    }


def set_rng_state(st: Mapping[str, Any]) -> None:
    """Set the RNG states `rng_state` returned."""
    torch.set_rng_state(st["rng_torch"])
    if st["rng_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["rng_cuda"])
    np.random.set_state(st["rng_numpy"])
    random.setstate(st["rng_python"])
