"""The training loop: AdamW + linear decay, clipping, autocast, dev-set selection, resumable state.

Pure PyTorch plus callbacks (`log_metrics`, `evaluate_dev`, `save_best`), so MLflow and the evaluator stay
at the seams (training/job.py builds them; tasks/train.py injects the MLflow logger). The model is a `cse.models.method.CSEModel`; the loop calls its
`training_step(batch, step, phase)`. A job is a list of `Phase`s run one after the other (one for
every method but DiffAug, whose prefix-only NLI stage precedes joint tuning); each phase has its
own data, batch size, learning rate, AdamW over `model.parameter_groups(phase)` and linear decay;
the global step counts across phases, and dev evaluation / best-checkpoint selection span them all
(as DiffAug's reference code, TianduoWang/DiffAug, counts steps). Resume state holds the trainable tensors, optimizer,
scheduler, RNG states, the position in the data and the best dev score, in the files that
`cse.storage.runs.ResumeState` names (the job folder's `RunDir.resume_state`); with `deterministic=True` a
killed and resumed run ends with the same weights as an uninterrupted one.

Distributed (torch.distributed initialised with world > 1, e.g. under torchrun: training/distributed.py):
the batch size stays the global batch; every rank draws the same global batch (same seed and order) and
trains on its contiguous slice (`cse.models.distributed.shard_batch`). The losses compute the global-batch
objective (models/distributed.py), BatchNorm layers use global statistics, and the gradients are SUMMED over
ranks before clipping, so a step equals the single-process step on the concatenated batch. Dropout draws
differ by rank (rank r > 0 seeds its RNG from (seed, r)). Only rank 0 evaluates, saves the best checkpoint,
writes the resume state (with every rank's RNG state) and logs; the others wait at a barrier. Resume works
with the same or another world size (the schedule depends only on the global batch).

Public step API (what benchmarks and probes use instead of subclassing): `TrainerHooks` passed as
`Trainer(..., hooks=[...])` are called at phase start, around each step, around the forward and around the
parameter update (clipping + optimizer + scheduler); `enter_phase(i)`, `batch_at(step)` (the real input
preparation: the host batch the loop trains on at a global step), `train_step(batch)` (one optimiser step) and
`precision_context()` (autocast + SDPA kernel) are the pieces `run()` is made of. `StopAfter(n)` simulates a kill.
`LoopConfig.save_state=False` writes no resume state. On the meta device (shape checks) the loop runs with NaN
metrics: meta tensors have no values.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from cse.models import distributed
from cse.models.checkpoint import trainable_state_dict
from cse.models.grad_cache import RowChunks
from cse.storage.atomic import atomic_dir
from cse.storage.runs import ResumeState, ResumeStateDamaged, check_file_records, file_records
from cse.training.memory import PeakMemory
from cse.training.rows import TrainingRows, epoch_order

log = logging.getLogger(__name__)


class TrainingInterrupted(RuntimeError):
    """Raised by `StopAfter` to simulate a kill; the resume state of the last checkpoint is kept."""


class NonFiniteLoss(FloatingPointError):
    """The loss or the gradient norm of a step is not finite (inf / nan): training stops at that step, before the
    optimizer applies it, so no NaN weights are saved, selected, registered or exported. The message names the
    step, the phase, which value and the step's other loss terms."""


@dataclass
class Phase:
    """One training phase. `cycle`: run exactly `max_steps` steps, cycling the rows (DiffAug stage 1);
    otherwise `epochs` passes capped by `max_steps`. `schedule_steps`: the linear-decay horizon (default:
    the phase's own steps). `aux_rows`: a second dataset batched beside the main one (`TrainBatch.aux`)."""

    name: str
    rows: TrainingRows
    batch_size: int
    learning_rate: float
    epochs: int = 1
    max_steps: int | None = None
    cycle: bool = False
    schedule_steps: int | None = None
    aux_rows: TrainingRows | None = None
    aux_batch_size: int = 0

    def __post_init__(self):
        if self.cycle and not self.max_steps:
            raise ValueError(f"phase {self.name!r}: cycle=True needs max_steps")
        if self.aux_rows is not None and self.aux_batch_size < 1:
            raise ValueError(f"phase {self.name!r}: aux_rows need aux_batch_size >= 1")

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(len(self.rows) / self.batch_size))

    @property
    def total_steps(self) -> int:
        if self.cycle:
            return int(self.max_steps)
        total = self.steps_per_epoch * self.epochs
        return min(total, self.max_steps) if self.max_steps else total


@dataclass
class LoopConfig:
    """Settings of the whole job; `batch_size` … `max_steps` describe the single phase used when the
    Trainer is given plain `TrainingRows` instead of a list of phases."""

    batch_size: int
    learning_rate: float
    epochs: int
    max_steps: int | None
    grad_clip: float
    seed: int
    eval_steps: int
    checkpoint_steps: int
    log_steps: int
    precision: str  # fp32 | bf16 | fp16
    deterministic: bool
    # Speed switches that leave results equal within float tolerance (off by default; not part of the run key):
    # fused AdamW kernels, torch.compile of the model's training step, and one SDPA kernel for every attention
    # call ("flash" | "efficient" | "cudnn" | "math"; "" = PyTorch's choice). Environment: CSE_FUSED_ADAMW=1,
    # CSE_COMPILE=1, CSE_SDPA_BACKEND=<kernel>.
    fused_adamw: bool = field(default_factory=lambda: os.environ.get("CSE_FUSED_ADAMW", "") == "1")
    compile: bool = field(default_factory=lambda: os.environ.get("CSE_COMPILE", "") == "1")
    sdpa_backend: str = field(default_factory=lambda: os.environ.get("CSE_SDPA_BACKEND", ""))
    # Build the next batch on a host thread while the device runs this step, in pinned memory with non-blocking
    # copies (None: on CUDA only; a CPU step gains nothing from it).
    prefetch: bool | None = None
    # Write the resume state at checkpoint steps and at the end (False: nothing is written; the run cannot resume).
    save_state: bool = True
    # Exact gradient caching (models/grad_cache.py): the per-row passes of a step run in chunks of this many rows of
    # the rank's batch, the loss on the whole batch; None runs them whole.
    grad_cache_chunk_size: int | None = None


@dataclass
class LoopResult:
    """Summary of a training loop: steps, best dev score and its step, resume point, time and throughput."""

    steps: int
    best_score: float | None
    best_step: int | None
    resumed_from: int | None
    seconds: float
    sentences_per_s: float


# LoopConfig.sdpa_backend → torch.nn.attention.SDPBackend member.
SDPA_BACKENDS = {
    "flash": lambda: SDPBackend.FLASH_ATTENTION,
    "efficient": lambda: SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": lambda: SDPBackend.CUDNN_ATTENTION,
    "math": lambda: SDPBackend.MATH,
}


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's random number generators.

    Args:
        seed: the seed (taken modulo 2**32 for NumPy).
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class TrainerHooks:
    """Callbacks of the training loop; every method is a no-op, override the ones you need.

    The loop calls, in order: `on_phase_start` (after the phase's optimizer and scheduler are built), then per
    step `on_step_start`, `on_forward_start`/`on_forward_end` (around `model.training_step`),
    `on_update_start`/`on_update_end` (around gradient clipping, the optimizer and scheduler steps: the
    batch-independent part of a step) and `on_step_end` (after `trainer.step` is incremented and the step's
    logging, dev evaluation and resume state are done, with the step's metrics as floats; an exception raised
    there stops training, as `StopAfter` does). Every method gets the `Trainer`, whose `step`, `phase`,
    `optimizer` and `model` are public.

    Example:
        >>> class Losses(TrainerHooks):
        ...     def __init__(self):
        ...         self.losses = []
        ...     def on_step_end(self, trainer, batch, metrics):
        ...         self.losses.append(metrics["loss"])
    """

    def on_phase_start(self, trainer: Trainer) -> None:
        """`trainer.phase` was entered (fresh optimizer and scheduler)."""

    def on_step_start(self, trainer: Trainer, batch) -> None:
        """Step `trainer.step + 1` is about to run on `batch` (already on the device)."""

    def on_forward_start(self, trainer: Trainer, batch) -> None:
        """The model's `training_step` (the forward and the loss) is about to run."""

    def on_forward_end(self, trainer: Trainer, batch) -> None:
        """The model's `training_step` returned."""

    def on_update_start(self, trainer: Trainer) -> None:
        """The gradients are computed; clipping, the optimizer step and the scheduler step follow."""

    def on_update_end(self, trainer: Trainer) -> None:
        """The parameters and the learning rate were updated."""

    def on_step_end(self, trainer: Trainer, batch, metrics: dict[str, float]) -> None:
        """Step `trainer.step` ended with `metrics` (loss terms, grad_norm)."""


class StopAfter(TrainerHooks):
    """Raise `TrainingInterrupted` once `steps` steps have run (after that step's logging, evaluation and resume
    state): simulates a kill for resume tests (`cse.training.job.fit(stop_after=...)`).

    Args:
        steps: the global step after which training stops.
    """

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, trainer: Trainer, batch, metrics: dict[str, float]) -> None:
        """Raise `TrainingInterrupted` once `steps` steps have run."""
        if trainer.step >= self.steps:
            raise TrainingInterrupted(f"stopped after step {trainer.step} (stop_after)")


class Trainer:
    """Runs a job's phases with AdamW + linear decay (module docstring).

    Args:
        model: a `cse.models.method.CSEModel` (its `training_step(batch, step, phase)`).
        data: the rows of a single phase, or the job's `Phase`s.
        cfg: the loop settings.
        device: where the model trains.
        state: the resume-state files (a bare folder: the same file names).
        save_best: called with (model, step, score) when the dev score improves.
        evaluate_dev: the dev score of the model.
        log_metrics: called with (metrics, step) every `log_steps` steps and with dev scores.
        hooks: `TrainerHooks` called around phases, steps, forwards and updates (e.g. `StopAfter`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        data: TrainingRows | list[Phase],
        cfg: LoopConfig,
        device: torch.device,
        state: ResumeState | Path,
        save_best: Callable[[torch.nn.Module, int, float], None],
        evaluate_dev: Callable[[torch.nn.Module], float],
        log_metrics: Callable[[dict[str, float], int], None],
        hooks: list[TrainerHooks] | tuple[TrainerHooks, ...] = (),
    ):
        self.model, self.cfg, self.device = model, cfg, device
        self.state = (
            state if isinstance(state, ResumeState) else ResumeState(state)
        )  # a bare folder: the same file names
        self.save_best, self.evaluate_dev, self.log_metrics = save_best, evaluate_dev, log_metrics
        self.hooks = list(hooks)
        self.warn: Callable[[str], None] = log.warning  # says that a damaged resume state was set aside
        if isinstance(data, TrainingRows):
            data = [Phase("main", data, cfg.batch_size, cfg.learning_rate, cfg.epochs, cfg.max_steps)]
        if not data:
            raise ValueError("a training job needs at least one phase")
        known = getattr(model, "phases", ("main",))
        unknown = [p.name for p in data if p.name not in known]
        if unknown:
            raise ValueError(f"phases {unknown} are not phases of {type(model).__name__} {known}")
        self.phases = data
        self.world, self.rank = distributed.world(), distributed.rank()
        if self.world > 1:
            self._check_shardable()
            distributed.convert_batchnorm(model)  # BatchNorm statistics over the global batch
        self.offsets = [sum(p.total_steps for p in data[:i]) for i in range(len(data))]
        self.total_steps = sum(p.total_steps for p in data)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16" and device.type == "cuda")
        if cfg.sdpa_backend and cfg.sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"sdpa_backend {cfg.sdpa_backend!r} is not one of {sorted(SDPA_BACKENDS)}")
        self.prefetch = device.type == "cuda" if cfg.prefetch is None else cfg.prefetch
        self._use_grad_cache(cfg)
        self._step_fn = self._compiled_step() if cfg.compile else self.model.training_step
        # Peak memory of each step (CUDA allocations; CPU: the resident set), the last step's and the run's, GiB
        self.memory = PeakMemory(device) if device.type in ("cuda", "cpu") else None
        self.step_peak_memory_gb, self.peak_memory_gb = float("nan"), 0.0
        # Host time spent getting each step's batch onto the device (waiting for the prefetch, building it, issuing
        # the copy) and the loop's wall time, both since run() began: host_wait_share = host_wait_s / loop_s.
        self.host_wait_s, self.loop_s = 0.0, 0.0
        self.step, self.best_score, self.best_step = 0, None, None
        self.phase_index = -1
        self._orders: dict[tuple[int, int, int], object] = {}
        self.enter_phase(0)

    def _compiled_step(self):
        """`torch.compile` of the model's training step, with room for one graph per encoder layer: the prompted
        attention function is specialised on its layer's index (`cse.models.prefix`), and at dynamo's default limit of 8
        recompilations the rest of a 12-layer encoder ran uncompiled (measured on an H100: D2CSE's compiled step was
        no faster than its eager one)."""
        config = torch._dynamo.config
        depth = [getattr(m.config, "num_hidden_layers", 0) for m in self.model.modules() if hasattr(m, "config")]
        room = 4 * max(depth, default=12) + 8  # (a layer's variants: views, discriminator input, prefix modules)
        for name in ("recompile_limit", "cache_size_limit"):  # (the name before torch 2.6: cache_size_limit)
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), room))
                break
        return torch.compile(self.model.training_step)

    def _use_grad_cache(self, cfg: LoopConfig) -> None:
        """Hand `grad_cache_chunk_size` to the model (`CSEModel.use_grad_cache`), refusing what cannot combine."""
        if cfg.grad_cache_chunk_size is None:
            return
        if cfg.compile:
            raise ValueError(
                "grad_cache.chunk_size and CSE_COMPILE=1 cannot be combined: the cached chunks are re-run during "
                "the backward, outside the compiled training step; unset one of them"
            )
        use = getattr(self.model, "use_grad_cache", None)
        if use is None:
            raise ValueError(f"grad_cache.chunk_size: {type(self.model).__name__} has no per-row passes to cache")
        use(RowChunks(cfg.grad_cache_chunk_size))

    def _check_shardable(self) -> None:
        """Every rank needs at least one row of every batch (the last batch of an epoch may be short)."""
        for p in self.phases:
            sizes = [(p.batch_size, len(p.rows))] + (
                [(p.aux_batch_size, len(p.aux_rows))] if p.aux_rows is not None else []
            )
            for bs, n in sizes:
                last = n - (max(1, math.ceil(n / bs)) - 1) * bs
                if min(bs, last) < self.world:
                    raise ValueError(
                        f"phase {p.name!r}: a batch of {min(bs, last)} rows ({n} rows, batch size {bs}) cannot "
                        f"be split over {self.world} ranks"
                    )

    def _shard(self, batch):
        return distributed.shard_batch(batch, self.rank, self.world)

    def _main_only(self, fn) -> None:
        """Run `fn` on rank 0 only (per-process losses, no collectives); the other ranks wait."""
        if self.rank == 0:
            with distributed.local_only():
                fn()
        distributed.barrier()

    def _rng_state(self) -> dict:
        return {
            "rng_torch": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "rng_numpy": np.random.get_state(),
            "rng_python": random.getstate(),
        }

    def _set_rng_state(self, st: dict) -> None:
        torch.set_rng_state(st["rng_torch"])
        if st["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["rng_cuda"])
        np.random.set_state(st["rng_numpy"])
        random.setstate(st["rng_python"])

    @property
    def phase(self) -> Phase:
        return self.phases[self.phase_index]

    @property
    def steps_per_epoch(self) -> int:
        return self.phases[0].steps_per_epoch

    def _phase_of(self, step: int) -> int:
        return (
            max(i for i, off in enumerate(self.offsets) if step >= off)
            if step < self.total_steps
            else len(self.phases) - 1
        )

    def enter_phase(self, index: int) -> None:
        """Enter phase `index` (no-op when it is the current one): fresh AdamW (β 0.9/0.999, ε 1e-8, no weight decay) over the model's parameter groups of phase `index` (a
        group without its own `lr` takes the phase's) and one linear decay that scales every group."""
        if index == self.phase_index:
            return
        self.phase_index = index
        phase = self.phases[index]
        if hasattr(self.model, "parameter_groups"):
            groups = [dict(g) for g in self.model.parameter_groups(phase.name)]
        else:
            groups = [{"params": [p for p in self.model.parameters() if p.requires_grad]}]
        groups = [g for g in groups if g["params"]]
        self.params = [p for g in groups for p in g["params"]]  # clipping and gradient reduction see every group
        fused = {"fused": True} if self.cfg.fused_adamw else {}
        self.optimizer = torch.optim.AdamW(
            groups, lr=phase.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **fused
        )
        horizon = phase.schedule_steps or phase.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: max(0.0, 1.0 - s / horizon))
        for h in self.hooks:
            h.on_phase_start(self)

    # ------------------------------------------------------------------ state
    def save_state(self) -> None:
        """Write the resume state (rank 0; every rank's RNG state); nothing when `LoopConfig.save_state` is off."""
        if not self.cfg.save_state:
            return
        if self.world > 1:  # every rank's RNG state goes into rank 0's file
            ranks_rng = distributed.all_gather_object(self._rng_state())
            if self.rank == 0:
                self._write_state({"rng_ranks": ranks_rng, "world": self.world})
            distributed.barrier()
            return
        self._write_state({})

    def _write_state(self, extra: dict) -> None:
        with atomic_dir(self.state.folder) as tmp:
            files = self.state.within(tmp)
            save_file(trainable_state_dict(self.model), str(files.trainable))
            torch.save(
                {
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "scaler": self.scaler.state_dict(),
                    **self._rng_state(),
                    **extra,
                },
                files.optimizer,
            )
            recorded = file_records(tmp)  # sizes and hashes: a damaged state is named on resume (`_read_state`)
            files.progress.write_text(
                json.dumps(
                    {
                        "files": recorded,
                        "step": self.step,
                        "best_score": self.best_score,
                        "best_step": self.best_step,
                        "phase": self.phase_index,
                        "total_steps": self.total_steps,
                        "phases": self._phase_signature(),
                    },
                    indent=2,
                )
            )

    def _phase_signature(self) -> list[dict]:
        return [
            {"name": p.name, "total_steps": p.total_steps, "steps_per_epoch": p.steps_per_epoch} for p in self.phases
        ]

    def _read_state(self) -> tuple[dict, dict, dict]:
        """The progress, trainable tensors and optimizer state read (nothing applied yet); `ResumeStateDamaged`
        naming the file when one is unreadable or differs from the size and hash recorded when it was written."""
        progress = self.state.progress
        try:
            meta = json.loads(progress.read_text())
            step = meta["step"]
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise ResumeStateDamaged(progress, f"unreadable ({type(e).__name__}: {e})") from None
        recorded = meta.get("files") or {}
        for path in (self.state.trainable, self.state.optimizer):
            if not path.is_file():
                raise ResumeStateDamaged(path, "missing")
            if problems := check_file_records(
                self.state.folder, {path.name: recorded[path.name]} if path.name in recorded else {}
            ):
                raise ResumeStateDamaged(path, problems[0].split(": ", 1)[1])
        try:
            tensors = load_file(str(self.state.trainable))
        except Exception as e:  # noqa: BLE001 - safetensors' errors name no file
            raise ResumeStateDamaged(self.state.trainable, f"unreadable ({type(e).__name__}: {e})") from None
        try:
            st = torch.load(self.state.optimizer, weights_only=False, map_location="cpu" if self.world > 1 else None)
        except Exception as e:  # noqa: BLE001
            raise ResumeStateDamaged(self.state.optimizer, f"unreadable ({type(e).__name__}: {e})") from None
        return {**meta, "step": step}, tensors, st

    def load_state(self) -> None:
        meta, tensors, st = self._read_state()
        if meta.get("phases") != self._phase_signature() or meta["total_steps"] != self.total_steps:
            raise ValueError(f"resume state in {self.state.folder} belongs to another data size or schedule")
        self.enter_phase(meta["phase"])
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        if unexpected:
            raise ValueError(f"resume state has tensors the model does not: {unexpected[:5]}")
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        self.scaler.load_state_dict(st["scaler"])
        ranks_rng = st.get("rng_ranks")
        if ranks_rng is not None and len(ranks_rng) == self.world:
            self._set_rng_state(ranks_rng[self.rank])
        elif self.rank == 0:
            self._set_rng_state(st)
        else:  # resumed with another world size: a fresh stream of this rank's own
            set_seed(distributed.rank_seed(self.cfg.seed, self.rank, salt=1 + meta["step"]))
        self.step, self.best_score, self.best_step = meta["step"], meta["best_score"], meta["best_step"]

    # ------------------------------------------------------------------ loop
    def autocast(self):
        """The autocast context of `LoopConfig.precision` (bf16/fp16; none for fp32)."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.cfg.precision)
        if dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def precision_context(self):
        """What the forward of a training step runs under: `autocast()` and the `LoopConfig.sdpa_backend` kernel."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.autocast())
        if self.cfg.sdpa_backend:
            stack.enter_context(sdpa_kernel(SDPA_BACKENDS[self.cfg.sdpa_backend]()))
        return stack

    def _value(self, t) -> float:
        """A metric as a Python float; NaN on the meta device (shapes only, no values)."""
        if torch.is_tensor(t):
            return float("nan") if t.device.type == "meta" else float(t.detach())
        return float(t)

    def train_step(self, batch) -> dict[str, float]:
        """One optimiser step of the current phase on `batch` (on the device): forward under `precision_context()`,
        backward, gradient reduction over ranks, clipping, AdamW and scheduler steps. Does not advance `step`.

        Args:
            batch: a `TrainBatch` on `device` (e.g. `batch_at(trainer.step)[0].to(trainer.device)`).

        Returns:
            The step's loss, its loss terms and the gradient norm, as floats.
        """
        self.model.train()
        if self.memory is not None:
            self.memory.reset()
        for h in self.hooks:
            h.on_forward_start(self, batch)
        with self.precision_context():
            out = self._step_fn(batch, step=self.step, phase=self.phase.name)
        for h in self.hooks:
            h.on_forward_end(self, batch)
        self._require_finite("loss", out.loss, out.metrics)
        self.optimizer.zero_grad(set_to_none=True)
        # (the SDPA kernel choice also holds in the backward, where grad_cache re-runs its chunks)
        with sdpa_kernel(SDPA_BACKENDS[self.cfg.sdpa_backend]()) if self.cfg.sdpa_backend else nullcontext():
            self.scaler.scale(out.loss).backward()
        if self.world > 1:  # Σ over ranks = the gradient of the global batch (models/distributed.py)
            distributed.all_reduce_gradients(self.params)
            distributed.check_replicated(out.loss, f"{self.phase.name}-phase loss of {type(self.model).__name__}")
        for h in self.hooks:
            h.on_update_start(self)
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        if not self.scaler.is_enabled():  # (fp16's scaler skips a step with inf gradients and lowers its scale itself)
            self._require_finite("gradient norm", grad_norm, {"loss": out.loss, **out.metrics})
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        for h in self.hooks:
            h.on_update_end(self)
        if self.memory is not None:
            self.step_peak_memory_gb = self.memory.peak_gb()
            self.peak_memory_gb = max(self.peak_memory_gb, self.step_peak_memory_gb)
        values = {"loss": out.loss, **out.metrics, "grad_norm": grad_norm}
        return {n: self._value(v) for n, v in values.items()}

    def _require_finite(self, what: str, value: torch.Tensor, terms: dict) -> None:
        """`NonFiniteLoss` naming the step (1-based, as logged), the phase, `what` and the step's loss terms when
        `value` is inf or nan (never on the meta device, which has no values)."""
        if value.device.type == "meta":
            return
        v = float(value.detach())
        if math.isfinite(v):
            return
        shown = ", ".join(f"{n}={self._value(t):.6g}" for n, t in terms.items())
        raise NonFiniteLoss(
            f"training stopped at step {self.step + 1} of {self.total_steps} (phase {self.phase.name!r}): "
            f"the {what} is {v}"
            + (f" ({shown})" if shown else "")
            + "; nothing of this step was applied. Lower the learning rate or check the data and "
            "precision; the resume state holds the last good step"
        )

    def _order(self, n: int, seed: int, epoch: int):
        key = (n, seed, epoch)
        if key not in self._orders:
            if len(self._orders) > 4:
                self._orders.clear()
            self._orders[key] = epoch_order(n, seed, epoch)
        return self._orders[key]

    def phase_batch(self, phase: Phase, phase_step: int, phase_index: int | None = None):
        """The batch of in-phase step `phase_step`: a pure function of (seed, phase, step), so resume sees the same."""
        epoch, b = divmod(phase_step, phase.steps_per_epoch)
        seed = self.cfg.seed + 7919 * (self.phase_index if phase_index is None else phase_index)
        idx = self._order(len(phase.rows), seed, epoch)[b * phase.batch_size : (b + 1) * phase.batch_size]
        batch = phase.rows.batch(idx, epoch)
        if phase.aux_rows is not None:
            aux_spe = max(1, math.ceil(len(phase.aux_rows) / phase.aux_batch_size))
            ae, ab = divmod(phase_step, aux_spe)
            aux_idx = self._order(len(phase.aux_rows), seed + 1, ae)[
                ab * phase.aux_batch_size : (ab + 1) * phase.aux_batch_size
            ]
            batch.aux = phase.aux_rows.batch(aux_idx, ae)
        return batch, epoch, b

    def batch_at(self, step: int):
        """(this rank's batch of global step `step` on the host, epoch, batch index, global sentences, global tokens);
        pinned when prefetching to CUDA. Pure (no RNG, no trainer state changed), so a host thread may build it."""
        index = self._phase_of(step)
        phase = self.phases[index]
        batch, epoch, b = self.phase_batch(phase, step - self.offsets[index], index)
        n_sentences, n_tokens = batch.sentences, batch.tokens  # of the global batch
        batch = self._shard(batch)
        if self.prefetch and self.device.type == "cuda":
            batch = batch.pin_memory()
        return batch, epoch, b, n_sentences, n_tokens

    selection_metric = (
        "stsb_dev"  # what `evaluate_dev` returns (training/job.py: transfer_dev_avg with selection transfer)
    )

    def _maybe_evaluate(self) -> None:
        score = self.evaluate_dev(self.model)
        self.log_metrics({self.selection_metric: score}, self.step)
        if self.best_score is None or score > self.best_score:  # strictly better (SimCSE's trainer)
            self.best_score, self.best_step = score, self.step
            self.save_best(self.model, self.step, score)
            self.log_metrics({f"best_{self.selection_metric}": score}, self.step)

    def run(self) -> LoopResult:
        torch.use_deterministic_algorithms(self.cfg.deterministic, warn_only=True)
        resumed = None
        if self.state.exists():
            try:
                self.load_state()
                resumed = self.step
            except ResumeStateDamaged as e:  # only one state is kept: restart from the first step, saying so
                if self.rank == 0:
                    moved = self.state.quarantine(str(e))
                    self.warn(f"{e}: moved to {moved}; no earlier good state is kept, so training restarts from step 0")
                distributed.barrier()
        if resumed is None:
            set_seed(distributed.rank_seed(self.cfg.seed, self.rank))
        if self.world > 1:
            steps = distributed.all_gather_object(self.step)
            if len(set(steps)) != 1:
                raise RuntimeError(
                    f"ranks start at different steps {steps}: the resume state must be visible to every rank"
                )
            distributed.broadcast_module(self.model)  # identical starting weights and buffers on every rank
        t0 = time.perf_counter()
        self.host_wait_s = 0.0
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", desc="train", disable=self.rank != 0)
        pool = ThreadPoolExecutor(1, thread_name_prefix="cse-prefetch") if self.prefetch else None
        try:
            result = self._run_steps(pool, bar, t0, resumed)
        finally:
            bar.close()
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            self.loop_s = time.perf_counter() - t0
        return result

    def _run_steps(self, pool, bar, t0: float, resumed: int | None) -> LoopResult:
        sentences, window_t, window_sent, window_tok, window_wait = 0, time.perf_counter(), 0, 0, 0.0
        window_peak = 0.0  # the highest per-step peak memory since the last log
        next_batch = None  # (step, future) of the prefetched batch
        while self.step < self.total_steps:
            self.enter_phase(self._phase_of(self.step))
            phase = self.phase
            t_wait = time.perf_counter()
            if next_batch is not None and next_batch[0] == self.step:
                host = next_batch[1].result()
            else:
                host = self.batch_at(self.step)
            if pool is not None and self.step + 1 < self.total_steps:
                next_batch = (self.step + 1, pool.submit(self.batch_at, self.step + 1))
            batch, epoch, b, n_sentences, n_tokens = host
            batch = batch.to(self.device)
            waited = time.perf_counter() - t_wait
            self.host_wait_s += waited
            window_wait += waited
            for h in self.hooks:
                h.on_step_start(self, batch)
            metrics = self.train_step(batch)
            window_peak = max(window_peak, self.step_peak_memory_gb)
            self.step += 1
            sentences += n_sentences
            window_sent += n_sentences
            window_tok += n_tokens
            bar.update(1)
            bar.set_postfix(phase=phase.name, loss=f"{metrics['loss']:.4f}", refresh=False)
            if self.step % self.cfg.log_steps == 0 or self.step == self.total_steps:
                dt = max(time.perf_counter() - window_t, 1e-9)
                metrics.update(
                    learning_rate=self.scheduler.get_last_lr()[0],
                    epoch=epoch + (b + 1) / phase.steps_per_epoch,
                    phase=float(self.phase_index),
                    sentences_per_s=window_sent / dt,
                    tokens_per_s=window_tok / dt,
                    host_wait_share=window_wait / dt,
                )
                for group, lr in zip(self.optimizer.param_groups[1:], self.scheduler.get_last_lr()[1:]):
                    metrics[f"learning_rate_{group.get('name', 'group')}"] = lr
                if self.memory is not None:  # the steps' peak (CUDA: allocated tensors; CPU: resident set)
                    metrics["peak_memory_gb"] = window_peak
                if self.rank == 0:
                    self.log_metrics(metrics, self.step)
                window_t, window_sent, window_tok, window_wait = time.perf_counter(), 0, 0, 0.0
                window_peak = 0.0
            if self.step % self.cfg.eval_steps == 0:
                self._main_only(self._maybe_evaluate)
            if self.step % self.cfg.checkpoint_steps == 0 or self.step == self.total_steps:
                self.save_state()
            for h in self.hooks:
                h.on_step_end(self, batch, metrics)
        bar.close()
        if (
            self.best_score is None and self.world == 1
        ):  # a run shorter than eval_steps still yields a selected checkpoint
            self._maybe_evaluate()
        if self.world > 1:
            if self.rank == 0 and self.best_score is None:
                self._main_only(self._maybe_evaluate)
            else:
                distributed.barrier()
            self.best_score, self.best_step = distributed.broadcast_object((self.best_score, self.best_step))
        seconds = time.perf_counter() - t0
        return LoopResult(self.step, self.best_score, self.best_step, resumed, seconds, sentences / max(seconds, 1e-9))
