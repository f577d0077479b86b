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

Speed (docs/gpu.md): a step reads nothing on the host. Its losses, terms and gradient norm stay on the device
(`StepMetrics`) and are read every `log_steps`; a non-finite loss or gradient norm trips the `NonFiniteGuard`, whose
flag the fused AdamW kernels read as `found_inf` (that update and every later one are skipped on the device), and the
next read raises `NonFiniteLoss` naming the step. Frozen Linear weights are cast once for bf16/fp16
(`cse.training.precision.FrozenLinearCast`); with `LoopConfig.compile` the whole step is one compiled graph (CUDA graphs on
a GPU); resume states are written on a background thread (`cse.training.state_writer`).

Public step API (what benchmarks and probes use instead of subclassing): `TrainerHooks` passed as
`Trainer(..., hooks=[...])` are called at phase start, around each step, around the forward and around the
parameter update (clipping + optimizer + scheduler); `enter_phase(i)`, `batch_at(step)` (the real input
preparation: the host batch the loop trains on at a global step), `train_step(batch)` (one optimiser step) and
`precision_context()` (autocast + SDPA kernel) are the pieces `run()` is made of. `StopAfter(n)` simulates a kill.
`LoopConfig.save_state=False` writes no resume state. On the meta device (shape checks) the loop runs with NaN
metrics: meta tensors have no values.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from cse.models import distributed
from cse.models.batching import TrainBatch
from cse.models.grad_cache import RowChunks
from cse.storage.runs import ResumeState, ResumeStateDamaged
from cse.training.memory import PeakMemory
from cse.training.precision import FrozenLinearCast
from cse.training.process import use_compile_cache
from cse.training.resume import load_resume_state, rng_state, set_rng_state, snapshot_state
from cse.training.rows import TrainingRows, epoch_order
from cse.training.state_writer import StateWriter
from cse.training.update import InGraphUpdate, linear_decay, observe_non_finite

if TYPE_CHECKING:
    from cse.models.method import StepOutput

log = logging.getLogger(__name__)

# `Trainer.batch_at`: (this rank's batch on the host, epoch, batch index, global sentences, global tokens)
HostBatch = tuple[TrainBatch, int, int, int, int]


class TrainingInterrupted(RuntimeError):
    """Raised by `StopAfter` to simulate a kill; the resume state of the last checkpoint is kept."""


class NonFiniteLoss(FloatingPointError):
    """The loss or the gradient norm of a step is not finite (inf / nan). The optimizer applies neither that step nor
    any later one (`NonFiniteGuard`), and training stops at the next read of the metrics (a log step, an evaluation,
    a state write, the end), so no NaN weights are saved, selected, registered or exported. The message names the
    step, the phase, which value and the step's other loss terms."""


def batches_per_epoch(rows: int, batch_size: int) -> int:
    """Batches of an epoch of `rows` rows (the last one may be short; at least one)."""
    return max(1, math.ceil(rows / batch_size))


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

    def __post_init__(self) -> None:
        if self.cycle and not self.max_steps:
            raise ValueError(f"phase {self.name!r}: cycle=True needs max_steps")
        if self.aux_rows is not None and self.aux_batch_size < 1:
            raise ValueError(f"phase {self.name!r}: aux_rows need aux_batch_size >= 1")

    @property
    def steps_per_epoch(self) -> int:
        return batches_per_epoch(len(self.rows), self.batch_size)

    @property
    def total_steps(self) -> int:
        if self.cycle and self.max_steps:  # (a cycling phase has its max_steps: __post_init__)
            return self.max_steps
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
    # Speed switches that leave results equal within float tolerance (not part of the run key; docs/gpu.md):
    # - fused_adamw: AdamW's fused kernels (None: on wherever torch has them, CUDA and CPU); the fused optimizer also
    #   carries the non-finite guard on the device (`NonFiniteGuard`), so the step reads nothing on the host;
    # - compile: torch.compile of the whole training step (forward and, through AOTAutograd, backward) as one graph
    #   (fullgraph); None decides by the run (`Trainer.compiles`: on CUDA, for a run long enough to repay the
    #   compilation); compile_mode "" = "reduce-overhead" (CUDA graphs) on CUDA, "default" elsewhere; compile_backend
    #   "inductor" (or "aot_eager", "cudagraphs": dynamo's own backends);
    # - compile_update: with compile (and the guard: no fp16 GradScaler), clipping, the non-finite guard and AdamW
    #   compiled as one more graph (training/update.py; equal to the eager fused update within float rounding);
    # - cast_frozen_weights: frozen nn.Linear weights cast once for bf16/fp16 training (training/precision.py; exact);
    # - sdpa_backend: one SDPA kernel for every attention call ("flash" | "efficient" | "cudnn" | "math"; "" =
    #   PyTorch's choice).
    # Environment: CSE_FUSED_ADAMW=0|1, CSE_COMPILE=0|1, CSE_COMPILE_MODE, CSE_COMPILE_BACKEND, CSE_COMPILE_UPDATE=0|1,
    # CSE_CAST_FROZEN=0|1, CSE_SDPA_BACKEND=<kernel>.
    fused_adamw: bool | None = field(default_factory=lambda: _env_flag("CSE_FUSED_ADAMW"))
    compile: bool | None = field(default_factory=lambda: _env_flag("CSE_COMPILE"))
    compile_mode: str = field(default_factory=lambda: os.environ.get("CSE_COMPILE_MODE", ""))
    compile_backend: str = field(default_factory=lambda: os.environ.get("CSE_COMPILE_BACKEND", "inductor"))
    compile_update: bool = field(default_factory=lambda: _env_flag("CSE_COMPILE_UPDATE") is not False)
    cast_frozen_weights: bool = field(default_factory=lambda: _env_flag("CSE_CAST_FROZEN") is not False)
    sdpa_backend: str = field(default_factory=lambda: os.environ.get("CSE_SDPA_BACKEND", ""))
    # Build the next batch on a host thread while the device runs this step, in pinned memory with non-blocking
    # copies (None: on CUDA only; a CPU step gains nothing from it).
    prefetch: bool | None = None
    # Write the resume state at checkpoint steps and at the end (False: nothing is written; the run cannot resume).
    save_state: bool = True
    # Resume states are written on a background thread (training/state_writer.py; False: inline), and at a checkpoint
    # step only when at least `state_interval_s` seconds passed since the last one (0: at every checkpoint step; the
    # last step always writes). None: on CUDA, `STATE_COST_FACTOR` × the last write's cost (its snapshot and its
    # background write), so states take at most ~2 % of a run (measured on an H100: a full BERT-base state with Adam,
    # 1.25 GiB, costs 0.8 s of snapshot and 2.9 s of writing, while SimCSE's 125 steps between checkpoints take 1.5 s);
    # elsewhere 0.
    async_state: bool = True
    state_interval_s: float | None = None
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


COMPILE_MIN_STEPS = 3000  # LoopConfig.compile=None: compile on CUDA for runs of at least this many steps
STATE_COST_FACTOR = 50.0  # LoopConfig.state_interval_s=None on CUDA: states apart by 50 × their cost (≤ 2 %)


@dataclass
class _Window:
    """What the loop counts between two logs: start time, sentences, tokens and host wait."""

    start: float = field(default_factory=time.perf_counter)
    sentences: int = 0
    tokens: int = 0
    wait: float = 0.0


LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}  # LoopConfig.precision → autocast dtype
# LoopConfig.sdpa_backend → torch.nn.attention.SDPBackend member.
SDPA_BACKENDS = {
    "flash": lambda: SDPBackend.FLASH_ATTENTION,
    "efficient": lambda: SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": lambda: SDPBackend.CUDNN_ATTENTION,
    "math": lambda: SDPBackend.MATH,
}


def _env_flag(name: str) -> bool | None:
    """An on/off environment switch: "1" on, "0" off, unset or empty None (the default applies)."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return None if value == "" else value == "1"


class StepMetrics(Mapping):
    """The metrics of one training step, kept on the device: the loss, the method's terms and the gradient norm, as one
    tensor. Nothing is read until asked: `floats()` (or any item) copies them to the host once, so a loop that reads
    them every `log_steps` waits for the device only then.

    Args:
        names: the metric names, in the order of `values`.
        values: `(len(names),)` float32 values on the step's device.
    """

    def __init__(self, names: tuple[str, ...], values: torch.Tensor):
        self.names, self.tensor = names, values
        self._floats: dict[str, float] | None = None

    def floats(self) -> dict[str, float]:
        """The values as Python floats (NaN on the meta device, which has no values)."""
        if self._floats is None:
            if self.tensor.device.type == "meta":
                self._floats = dict.fromkeys(self.names, float("nan"))
            else:
                self._floats = dict(zip(self.names, self.tensor.tolist()))
        return self._floats

    def __getitem__(self, name: str) -> float:
        return self.floats()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class NonFiniteGuard:
    """The non-finite check kept on the device: a sticky flag that turns every later optimizer update into a no-op.

    `observe` runs after the backward, before the optimizer: if the step's loss or gradient norm is not finite the
    flag goes to 1 and stays there, and the fused AdamW kernels, which read it as their `found_inf`, skip the update
    (weights, moments and step count unchanged) for this step and every later one. The first bad step and its values
    are recorded on the device too; `check` reads the flag (one sync: the trainer calls it every `log_steps`, before
    every evaluation and state write, and at the end) and raises `NonFiniteLoss` naming that step.

    Args:
        device: the training device.
    """

    def __init__(self, device: torch.device):
        self.flag = torch.zeros((), dtype=torch.float32, device=device)
        # per set of metric names (a phase's): (first bad step, its values), step -1 while none
        self.records: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def slot(self, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(first bad step, its values) of the metrics `names` on the device, made at first use (-1 and NaN)."""
        if names not in self.records:
            self.records[names] = (
                torch.full((), -1, dtype=torch.long, device=self.flag.device),
                torch.full((len(names),), float("nan"), device=self.flag.device),
            )
        return self.records[names]

    def observe(self, step: int, names: tuple[str, ...], values: torch.Tensor) -> None:
        """Record step `step` (1-based) with `values` (`names`: the loss first, the gradient norm last)."""
        observe_non_finite(self.flag, *self.slot(names), step, values)

    def tripped(self) -> bool:
        """Whether a step was not finite (reads the flag: a sync)."""
        return self.flag.device.type != "meta" and bool(self.flag)

    def first(self) -> tuple[int, dict[str, float]]:
        """(1-based step, its values by name) of the first non-finite step."""
        for names, (step, values) in self.records.items():
            if int(step) > 0:
                return int(step), dict(zip(names, values.tolist()))
        raise RuntimeError("no non-finite step was recorded")


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
    logging, dev evaluation and resume state are done, with the step's metrics; an exception raised
    there stops training, as `StopAfter` does). The metrics of `on_step_end` stay on the device until read (a
    `StepMetrics`: reading one waits for the step); on a log step they are the logged floats, with the window's rates,
    learning rates and epoch. Every method gets the `Trainer`, whose `step`, `phase`, `optimizer` and `model` are
    public.

    Example:
        >>> class Losses(TrainerHooks):
        ...     def __init__(self):
        ...         self.losses = []
        ...     def on_step_end(self, trainer, batch, metrics):
        ...         self.losses.append(metrics["loss"])
    """

    def on_phase_start(self, trainer: Trainer) -> None:
        """`trainer.phase` was entered (fresh optimizer and scheduler)."""

    def on_step_start(self, trainer: Trainer, batch: TrainBatch) -> None:
        """Step `trainer.step + 1` is about to run on `batch` (already on the device)."""

    def on_forward_start(self, trainer: Trainer, batch: TrainBatch) -> None:
        """The model's `training_step` (the forward and the loss) is about to run."""

    def on_forward_end(self, trainer: Trainer, batch: TrainBatch) -> None:
        """The model's `training_step` returned."""

    def on_update_start(self, trainer: Trainer) -> None:
        """The gradients are computed; clipping, the optimizer step and the scheduler step follow."""

    def on_update_end(self, trainer: Trainer) -> None:
        """The parameters and the learning rate were updated."""

    def on_step_end(self, trainer: Trainer, batch: TrainBatch, metrics: Mapping[str, float]) -> None:
        """Step `trainer.step` ended with `metrics` (loss terms, grad_norm; read lazily)."""


class StopAfter(TrainerHooks):
    """Raise `TrainingInterrupted` once `steps` steps have run (after that step's logging, evaluation and resume
    state): simulates a kill for resume tests (`cse.training.job.fit(stop_after=...)`).

    Args:
        steps: the global step after which training stops.
    """

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, trainer: Trainer, batch: TrainBatch, metrics: Mapping[str, float]) -> None:
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
        self.state = state if isinstance(state, ResumeState) else ResumeState(state)
        self.save_best, self.evaluate_dev, self.log_metrics = save_best, evaluate_dev, log_metrics
        self.hooks = list(hooks)
        self.warn: Callable[[str], None] = log.warning  # says that a damaged resume state was set aside
        self.phases = self._check_phases(model, data, cfg)
        self.world, self.rank = distributed.world(), distributed.rank()
        if self.world > 1:
            self._check_shardable()
            distributed.convert_batchnorm(model)  # BatchNorm statistics over the global batch
        self.offsets = [sum(p.total_steps for p in self.phases[:i]) for i in range(len(self.phases))]
        self.total_steps = sum(p.total_steps for p in self.phases)
        self._configure_step(cfg)
        self.writer = StateWriter(self.state, background=cfg.async_state)
        self._last_state_t: float | None = None
        self._last_snapshot_s = 0.0
        # Peak memory of the steps of each log window (CUDA allocations; CPU: the resident set), the last window's
        # and the run's, GiB
        self.memory = PeakMemory(device) if device.type in ("cuda", "cpu") else None
        self.step_peak_memory_gb, self.peak_memory_gb = float("nan"), 0.0
        # Host time spent getting each step's batch onto the device (waiting for the prefetch, building it, issuing
        # the copy) and the loop's wall time, both since run() began: host_wait_share = host_wait_s / loop_s.
        self.host_wait_s, self.loop_s = 0.0, 0.0
        self.step: int = 0
        self.best_score: float | None = None
        self.best_step: int | None = None
        self.phase_index = -1
        self._orders: dict[tuple[int, int, int], np.ndarray] = {}
        self.enter_phase(0)

    @staticmethod
    def _check_phases(model: torch.nn.Module, data: TrainingRows | list[Phase], cfg: LoopConfig) -> list[Phase]:
        """The job's phases (plain rows: one phase `main` of `cfg`'s settings), each one the model knows."""
        if isinstance(data, TrainingRows):
            data = [Phase("main", data, cfg.batch_size, cfg.learning_rate, cfg.epochs, cfg.max_steps)]
        if not data:
            raise ValueError("a training job needs at least one phase")
        known = getattr(model, "phases", ("main",))
        unknown = [p.name for p in data if p.name not in known]
        if unknown:
            raise ValueError(f"phases {unknown} are not phases of {type(model).__name__} {known}")
        return data

    def _configure_step(self, cfg: LoopConfig) -> None:
        """What a step runs with: the fp16 loss scaler, the SDPA kernel, prefetching, gradient caching, the fused
        AdamW and its `NonFiniteGuard`, the cast of the frozen weights and the compiled step."""
        device = self.device
        # fp16 scales its loss on every device (fp16's narrow range underflows small gradients on a CPU as on a GPU)
        scaled = cfg.precision == "fp16" and device.type in ("cuda", "cpu")
        self.scaler = torch.amp.GradScaler(device.type if scaled else "cuda", enabled=scaled)
        if cfg.sdpa_backend and cfg.sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"sdpa_backend {cfg.sdpa_backend!r} is not one of {sorted(SDPA_BACKENDS)}")
        self.prefetch = device.type == "cuda" if cfg.prefetch is None else cfg.prefetch
        self._use_grad_cache(cfg)
        # AdamW's fused kernels wherever torch has them; with them (and no fp16 GradScaler, which skips steps itself)
        # the non-finite check stays on the device (`NonFiniteGuard`), else every step reads its loss on the host.
        self.fused_adamw = cfg.fused_adamw if cfg.fused_adamw is not None else device.type in ("cuda", "cpu")
        guarded = self.fused_adamw and not self.scaler.is_enabled() and device.type != "meta"
        self.guard = NonFiniteGuard(device) if guarded else None
        low = LOW_PRECISION.get(cfg.precision)
        cast = FrozenLinearCast(self.model, low) if low is not None and cfg.cast_frozen_weights else None
        self.frozen_cast = cast if cast is not None and len(cast) and device.type != "meta" else None
        self.cudagraphs = False  # set by _compiled_step: the step replays CUDA graphs
        self.compiled = self.compiles() and use_compile_cache(cfg.compile_backend)  # (else eager, said)
        self._step_tensor = torch.zeros((), dtype=torch.long, device=device) if self.compiled else None
        self._step_fn = self._compiled_step() if self.compiled else self._model_step
        # (built per phase by enter_phase: the phase's optimizer, offset and decay horizon)
        self.in_graph_update: InGraphUpdate | None = None

    def compiles(self) -> bool:
        """Whether the step is compiled: `LoopConfig.compile`, or when None, on CUDA for a single-process run without
        gradient caching (its chunks re-run outside the compiled step) of at least `COMPILE_MIN_STEPS` steps. Measured
        on an H100 (docs/gpu.md): compilation takes 25–124 s once and saves 21–46 ms a step, so it repays itself
        after 800–2,700 steps; every default preset runs 3,907 or more, a smoke run 40."""
        if self.cfg.compile is not None:
            return self.cfg.compile
        return (
            self.device.type == "cuda"
            and self.world == 1
            and self.cfg.grad_cache_chunk_size is None
            and self.total_steps >= COMPILE_MIN_STEPS
        )

    @property
    def _model_step(self) -> Callable[..., StepOutput]:
        """The model's `training_step(batch, step, phase)` (a `cse.models.method.CSEModel`'s)."""
        return cast("Callable[..., StepOutput]", self.model.training_step)

    def _compiled_step(self) -> Callable[..., StepOutput]:
        """`torch.compile` of the model's whole training step as one graph (`fullgraph=True`: a graph break is an
        error, not a silent slow path; every method's step compiles so, tests/training/test_speed.py). AOTAutograd
        compiles its backward too. Mode "reduce-overhead" (the CUDA default) replays both as CUDA graphs: one launch
        for hundreds of kernels. The step number reaches the step as a device tensor (`_step_tensor`), so one graph
        serves every step. The room left for recompilations covers an encoder's layers for the case a graph per
        layer is made (the prompted attention is specialised on its layer's index, `cse.models.prompts`)."""
        config = torch._dynamo.config
        depth = [getattr(m.config, "num_hidden_layers", 0) for m in self.model.modules() if hasattr(m, "config")]
        room = 4 * max(depth, default=12) + 8  # (a layer's variants: views, discriminator input, prefix modules)
        for name in ("recompile_limit", "cache_size_limit"):  # (the name before torch 2.6: cache_size_limit)
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), room))
                break
        mode = self.cfg.compile_mode or ("reduce-overhead" if self.device.type == "cuda" else "default")
        backend = self.cfg.compile_backend
        self.cudagraphs = self.device.type == "cuda" and (
            backend == "cudagraphs" or (backend == "inductor" and mode in ("reduce-overhead", "max-autotune"))
        )
        self.compile_mode = mode if backend == "inductor" else None  # (dynamo's own backends take no mode)
        # static shapes: a batch of another shape (DiffAug's two phases, an epoch's short last batch) gets a graph of
        # its own rather than one symbolic graph for all (CUDA graphs replay fixed shapes)
        return torch.compile(self._model_step, fullgraph=True, dynamic=False, backend=backend, mode=self.compile_mode)

    def _use_grad_cache(self, cfg: LoopConfig) -> None:
        """Hand `grad_cache_chunk_size` to the model (`CSEModel.use_grad_cache`), refusing what cannot combine."""
        if cfg.grad_cache_chunk_size is None:
            return
        if cfg.compile:  # (None: the automatic choice leaves compilation off with gradient caching)
            raise ValueError(
                "grad_cache.chunk_size and compile (CSE_COMPILE=1) cannot be combined: the cached chunks are re-run during "
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
                last = n - (batches_per_epoch(n, bs) - 1) * bs
                if min(bs, last) < self.world:
                    raise ValueError(
                        f"phase {p.name!r}: a batch of {min(bs, last)} rows ({n} rows, batch size {bs}) cannot "
                        f"be split over {self.world} ranks"
                    )

    def _main_only(self, fn: Callable[[], None]) -> None:
        """Run `fn` on rank 0 only (per-process losses, no collectives); the other ranks wait."""
        if self.rank == 0:
            with distributed.local_only():
                fn()
        distributed.barrier()

    @property
    def phase(self) -> Phase:
        return self.phases[self.phase_index]

    def _phase_of(self, step: int) -> int:
        return bisect.bisect_right(self.offsets, step) - 1  # (the last phase from its first step on)

    def enter_phase(self, index: int) -> None:
        """Enter phase `index` (no-op when it is the current one): fresh AdamW (β 0.9/0.999, ε 1e-8, no weight decay) over the model's parameter groups of phase `index` (a
        group without its own `lr` takes the phase's) and one linear decay that scales every group."""
        if index == self.phase_index:
            return
        self.phase_index = index
        phase = self.phases[index]
        parameter_groups = getattr(self.model, "parameter_groups", None)
        if parameter_groups is not None:
            groups = [dict(g) for g in parameter_groups(phase.name)]
        else:
            groups = [{"params": [p for p in self.model.parameters() if p.requires_grad]}]
        groups = [g for g in groups if g["params"]]
        self.params = [p for g in groups for p in g["params"]]  # clipping and gradient reduction see every group
        fused = {"fused": True} if self.fused_adamw else {}
        self.optimizer = torch.optim.AdamW(
            groups, lr=phase.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **fused
        )
        if self.guard is not None:  # the fused kernels skip the update while the guard's flag is set
            setattr(self.optimizer, "found_inf", self.guard.flag)  # noqa: B010 - an attribute torch's fused AdamW reads
        horizon = phase.schedule_steps or phase.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: linear_decay(s, horizon))
        if self.compiled and self.cfg.compile_update and self.guard is not None:
            self.in_graph_update = InGraphUpdate(
                self.optimizer,
                self.cfg.grad_clip,
                self.offsets[index],
                horizon,
                self.cfg.compile_backend,
                self.compile_mode,
            )
        for h in self.hooks:
            h.on_phase_start(self)

    # ------------------------------------------------------------------ state
    def save_state(self, force: bool = False) -> None:
        """Write the resume state (rank 0; every rank's RNG state): a snapshot now, the files on the writer's thread.
        Nothing when `LoopConfig.save_state` is off, or when less than `state_interval_s` passed since the last write
        (unless `force`: the last step)."""
        if not self.cfg.save_state:
            return
        now = time.monotonic()
        if not force and self._last_state_t is not None and now - self._last_state_t < self.state_interval_s():
            return
        self._last_state_t = now
        if self.world > 1:  # every rank's RNG state goes into rank 0's file
            ranks_rng = distributed.all_gather_object(rng_state())
            if self.rank == 0:
                self._write_state({"rng_ranks": ranks_rng, "world": self.world})
            distributed.barrier()
            return
        self._write_state({})

    def state_interval_s(self) -> float:
        """The least time between two resume states at checkpoint steps (`LoopConfig.state_interval_s`; None: on CUDA
        `STATE_COST_FACTOR` × the last state's cost, the snapshot on this thread plus the write on the writer's)."""
        if self.cfg.state_interval_s is not None:
            return self.cfg.state_interval_s
        if self.device.type != "cuda" or not self.writer.writes:
            return 0.0
        return STATE_COST_FACTOR * (self._last_snapshot_s + self.writer.write_s / self.writer.writes)

    def _write_state(self, extra: dict[str, Any]) -> None:
        self.writer.wait()  # (the previous write's time counts as the snapshot's wait)
        t0 = time.perf_counter()
        with self._fp32_weights():
            snapshot = snapshot_state(
                self.model,
                {"optimizer": self.optimizer, "scheduler": self.scheduler, "scaler": self.scaler},
                {
                    "step": self.step,
                    "best_score": self.best_score,
                    "best_step": self.best_step,
                    "phase": self.phase_index,
                    "total_steps": self.total_steps,
                    "phases": self._phase_signature(),
                },
                extra,
            )
        self._last_snapshot_s = time.perf_counter() - t0
        self.writer.write(snapshot)

    def _fp32_weights(self) -> AbstractContextManager[None]:
        """The fp32 masters of the frozen weights while active (evaluation, checkpoints, state; `FrozenLinearCast`)."""
        return self.frozen_cast.masters() if self.frozen_cast is not None else nullcontext()

    def _phase_signature(self) -> list[dict]:
        return [
            {"name": p.name, "total_steps": p.total_steps, "steps_per_epoch": p.steps_per_epoch} for p in self.phases
        ]

    def load_state(self) -> None:
        """Resume from the state in `state` (`cse.training.resume.load_resume_state`): the phase, the trainable
        tensors, the optimizer, scheduler and scaler, this rank's RNG states, the step and the best dev score."""
        loaded = load_resume_state(self.state, map_location="cpu" if self.world > 1 else None)
        meta, st = loaded.progress, loaded.payload
        if meta.get("phases") != self._phase_signature() or meta["total_steps"] != self.total_steps:
            raise ValueError(f"resume state in {self.state.folder} belongs to another data size or schedule")
        self.enter_phase(meta["phase"])
        missing, unexpected = self.model.load_state_dict(loaded.tensors, strict=False)
        if unexpected:
            raise ValueError(f"resume state has tensors the model does not: {unexpected[:5]}")
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        if st["scaler"] or not self.scaler.is_enabled():  # (a state from before fp16 scaled on the CPU has none)
            self.scaler.load_state_dict(st["scaler"])
        ranks_rng = st.get("rng_ranks")
        if ranks_rng is not None and len(ranks_rng) == self.world:
            set_rng_state(ranks_rng[self.rank])
        elif self.rank == 0:
            set_rng_state(st)
        else:  # resumed with another world size: a fresh stream of this rank's own
            set_seed(distributed.rank_seed(self.cfg.seed, self.rank, salt=1 + meta["step"]))
        self.step, self.best_score, self.best_step = meta["step"], meta["best_score"], meta["best_step"]

    # ------------------------------------------------------------------ loop
    def autocast(self) -> AbstractContextManager[Any]:
        """The autocast context of `LoopConfig.precision` (bf16/fp16; none for fp32)."""
        dtype = LOW_PRECISION.get(self.cfg.precision)
        return nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    def sdpa_context(self) -> AbstractContextManager[Any]:
        """The `LoopConfig.sdpa_backend` kernel for every attention call ("": PyTorch's choice)."""
        return sdpa_kernel(SDPA_BACKENDS[self.cfg.sdpa_backend]()) if self.cfg.sdpa_backend else nullcontext()

    def precision_context(self) -> contextlib.ExitStack:
        """What the forward of a training step runs under: `autocast()` and `sdpa_context()`."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.autocast())
        stack.enter_context(self.sdpa_context())
        return stack

    def train_step(self, batch: TrainBatch) -> StepMetrics:
        """One optimiser step of the current phase on `batch` (on the device): forward under `precision_context()`,
        backward, gradient reduction over ranks, clipping, AdamW and scheduler steps. Does not advance `step`.

        Nothing is read on the host: the metrics stay on the device (`StepMetrics`), and a non-finite loss or gradient
        norm trips the `NonFiniteGuard` (the update is skipped on the device) and raises at the next `check_finite`.
        Without the guard (an optimizer without fused kernels, or fp16 with its GradScaler) each step checks on the
        host, as before.

        Args:
            batch: a `TrainBatch` on `device` (e.g. `batch_at(trainer.step)[0].to(trainer.device)`).

        Returns:
            The step's loss, its loss terms and the gradient norm (read lazily).
        """
        out = self._forward(batch)
        self.optimizer.zero_grad(set_to_none=True)
        # (the SDPA kernel choice also holds in the backward, where grad_cache re-runs its chunks)
        with self.sdpa_context():
            self.scaler.scale(out.loss).backward()
        if self.world > 1:  # Σ over ranks = the gradient of the global batch (models/distributed.py)
            distributed.all_reduce_gradients(self.params)
            distributed.check_replicated(out.loss, f"{self.phase.name}-phase loss of {type(self.model).__name__}")
        for h in self.hooks:
            h.on_update_start(self)
        names = ("loss", *out.metrics, "grad_norm")
        if self.in_graph_update is not None and self.guard is not None and self._step_tensor is not None:
            values = self.in_graph_update(
                [out.loss, *out.metrics.values()], self._step_tensor, (self.guard.flag, *self.guard.slot(names))
            )
            self.scheduler.step()
            for h in self.hooks:
                h.on_update_end(self)
            return StepMetrics(names, values.clone() if self.cudagraphs else values)
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        values = torch.stack(
            [
                torch.as_tensor(v, device=grad_norm.device).detach().float().reshape(())
                for v in (out.loss, *out.metrics.values(), grad_norm)
            ]
        )  # (a new tensor: a CUDA graph's outputs are overwritten by its next replay)
        # (fp16's scaler skips a step with inf gradients and lowers its scale itself)
        if self.guard is not None:
            self.guard.observe(self.step + 1, names, values)
        elif not self.scaler.is_enabled():
            self._require_finite("gradient norm", grad_norm, {"loss": out.loss, **out.metrics})
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        for h in self.hooks:
            h.on_update_end(self)
        return StepMetrics(names, values)

    def _forward(self, batch: TrainBatch) -> StepOutput:
        """The model's `training_step` on `batch` under `precision_context()`, between the forward hooks (the step
        number as a device tensor for the compiled step); without the guard, the loss checked on the host."""
        self.model.train()
        if self.frozen_cast is not None:
            self.frozen_cast.low()
        for h in self.hooks:
            h.on_forward_start(self, batch)
        step: int | torch.Tensor = self.step
        if self._step_tensor is not None:  # one compiled graph for every step: the number travels as a tensor
            self._step_tensor.fill_(self.step)
            step = self._step_tensor
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with self.precision_context():
            out = self._step_fn(batch, step=step, phase=self.phase.name)
        for h in self.hooks:
            h.on_forward_end(self, batch)
        if self.guard is None:
            self._require_finite("loss", out.loss, out.metrics)
        return out

    def check_finite(self) -> None:
        """Raise `NonFiniteLoss` for the first step whose loss or gradient norm was not finite (reads the guard's flag:
        the loop calls it every `log_steps`, before evaluations and state writes, and at the end)."""
        if self.guard is None or not self.guard.tripped():
            return
        step, values = self.guard.first()
        loss, norm = values.get("loss", float("nan")), values.get("grad_norm", float("nan"))
        what, value = ("loss", loss) if not math.isfinite(loss) else ("gradient norm", norm)
        terms = {n: v for n, v in values.items() if n != "grad_norm"}
        self._raise_non_finite(step, what, value, terms, later=self.step - step)

    def _require_finite(self, what: str, value: torch.Tensor, terms: dict) -> None:
        """`NonFiniteLoss` naming the step, the phase, `what` and the step's loss terms when `value` is inf or nan (never
        on the meta device, which has no values): the host check of a trainer without the `NonFiniteGuard`."""
        if value.device.type == "meta":
            return
        v = float(value.detach())
        if math.isfinite(v):
            return
        self._raise_non_finite(self.step + 1, what, v, {n: float(t) for n, t in terms.items()}, later=0)

    def _raise_non_finite(self, step: int, what: str, value: float, terms: dict[str, float], later: int) -> None:
        shown = ", ".join(f"{n}={v:.6g}" for n, v in terms.items())
        phase = self.phases[self._phase_of(step - 1)].name
        after = f"; the {later} later step(s) before this check ran with their updates skipped" if later > 0 else ""
        try:  # a state write in flight is finished first: the message says what a rerun will find
            self.writer.wait()
        except Exception as e:  # noqa: BLE001 - said with the stop, which stays the error raised
            kept = f"the last resume state could not be written ({type(e).__name__}: {e})"
        else:
            if self.state.exists():
                kept = "the resume state holds the last state written before it"
            else:
                kept = "no resume state had been written yet, so a rerun starts from step 0"
        raise NonFiniteLoss(
            f"training stopped at step {step} of {self.total_steps} (phase {phase!r}): the {what} is {value}"
            + (f" ({shown})" if shown else "")
            + f"; nothing of this step was applied{after}. Lower the learning rate or check the data and "
            f"precision; {kept}"
        )

    def _order(self, n: int, seed: int, epoch: int) -> np.ndarray:
        key = (n, seed, epoch)
        if key not in self._orders:
            if len(self._orders) > 4:
                self._orders.clear()
            self._orders[key] = epoch_order(n, seed, epoch)
        return self._orders[key]

    def _rows_batch(
        self, rows: TrainingRows, batch_size: int, seed: int, phase_step: int
    ) -> tuple[TrainBatch, int, int]:
        """(the batch of `rows` at in-phase step `phase_step`, its epoch, its index in the epoch)."""
        epoch, b = divmod(phase_step, batches_per_epoch(len(rows), batch_size))
        idx = self._order(len(rows), seed, epoch)[b * batch_size : (b + 1) * batch_size]
        return rows.batch(idx, epoch), epoch, b

    def phase_batch(self, phase: Phase, phase_step: int, phase_index: int) -> tuple[TrainBatch, int, int]:
        """The batch of in-phase step `phase_step`: a pure function of (seed, phase, step), so resume sees the same."""
        seed = self.cfg.seed + 7919 * phase_index
        batch, epoch, b = self._rows_batch(phase.rows, phase.batch_size, seed, phase_step)
        if phase.aux_rows is not None:
            batch.aux = self._rows_batch(phase.aux_rows, phase.aux_batch_size, seed + 1, phase_step)[0]
        return batch, epoch, b

    def batch_at(self, step: int) -> HostBatch:
        """(this rank's batch of global step `step` on the host, epoch, batch index, global sentences, global tokens);
        pinned when prefetching to CUDA. Pure (no RNG, no trainer state changed), so a host thread may build it."""
        index = self._phase_of(step)
        phase = self.phases[index]
        batch, epoch, b = self.phase_batch(phase, step - self.offsets[index], index)
        n_sentences, n_tokens = batch.sentences, batch.tokens  # of the global batch
        check = getattr(self.model, "check_batch", None)
        if check is not None:  # the values are checked here, on the host, never inside the step
            check(batch)
        batch = distributed.shard_batch(batch, self.rank, self.world)
        if self.prefetch and self.device.type == "cuda":
            batch = batch.pin_memory()
        return batch, epoch, b, n_sentences, n_tokens

    # what `evaluate_dev` returns (training/job.py: transfer_dev_avg with selection transfer)
    selection_metric = "stsb_dev"

    def _maybe_evaluate(self) -> None:
        self.check_finite()  # (never evaluate, select or save the weights of a run that already failed)
        with self._fp32_weights():
            score = self.evaluate_dev(self.model)
        self.log_metrics({self.selection_metric: score}, self.step)
        if self.best_score is None or score > self.best_score:  # strictly better (SimCSE's trainer)
            self.best_score, self.best_step = score, self.step
            with self._fp32_weights():
                self.save_best(self.model, self.step, score)
            self.log_metrics({f"best_{self.selection_metric}": score}, self.step)

    def run(self) -> LoopResult:
        torch.use_deterministic_algorithms(self.cfg.deterministic, warn_only=True)
        resumed = self._resume()
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
            try:
                self.writer.wait()  # a state in flight is completed, also when training stopped with an error
            finally:
                if self.frozen_cast is not None:
                    self.frozen_cast.master()
                self.loop_s = time.perf_counter() - t0
        return result

    def _resume(self) -> int | None:
        """Resume from the state in `state` when there is one (its step; None: starting at step 0, seeded). A damaged
        state is set aside, said (`warn`), and training restarts. Every rank then starts at the same step with the
        same weights."""
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
        return resumed

    def _log_window(self, metrics: StepMetrics, window: _Window, epoch: float, bar: tqdm) -> dict[str, float]:
        """Read the step's metrics (the guard first), add the window's rates, memory and learning rates, log them and
        return them."""
        self.check_finite()
        logged = dict(metrics.floats())
        dt = max(time.perf_counter() - window.start, 1e-9)
        logged.update(
            learning_rate=float(self.scheduler.get_last_lr()[0]),
            epoch=epoch,
            phase=float(self.phase_index),
            sentences_per_s=window.sentences / dt,
            tokens_per_s=window.tokens / dt,
            host_wait_share=window.wait / dt,
        )
        for group, lr in zip(self.optimizer.param_groups[1:], self.scheduler.get_last_lr()[1:]):
            logged[f"learning_rate_{group.get('name', 'group')}"] = float(lr)
        if self.memory is not None:  # the window's peak (CUDA: allocated tensors; CPU: resident set)
            self.step_peak_memory_gb = self.memory.peak_gb()
            self.peak_memory_gb = max(self.peak_memory_gb, self.step_peak_memory_gb)
            logged["peak_memory_gb"] = self.step_peak_memory_gb
            self.memory.reset()
        bar.set_postfix(phase=self.phase.name, loss=f"{logged['loss']:.4f}", refresh=False)
        if self.rank == 0:
            self.log_metrics(logged, self.step)
        return logged

    def _run_steps(self, pool: ThreadPoolExecutor | None, bar: tqdm, t0: float, resumed: int | None) -> LoopResult:
        sentences, window = 0, _Window()
        next_batch = None  # (step, future) of the prefetched batch
        if self.memory is not None:
            self.memory.reset()
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
            window.wait += waited
            for h in self.hooks:
                h.on_step_start(self, batch)
            step_metrics = self.train_step(batch)
            metrics: Mapping[str, float] = step_metrics  # (on a log step: the logged floats)
            self.step += 1
            sentences += n_sentences
            window.sentences += n_sentences
            window.tokens += n_tokens
            bar.update(1)
            last = self.step == self.total_steps
            if self.step % self.cfg.log_steps == 0 or last:  # the only place a step's values are read
                metrics = self._log_window(step_metrics, window, epoch + (b + 1) / phase.steps_per_epoch, bar)
                window = _Window()
            if self.step % self.cfg.eval_steps == 0:
                self._main_only(self._maybe_evaluate)
            if self.step % self.cfg.checkpoint_steps == 0 or last:
                self.check_finite()
                self.save_state(force=last)
            for h in self.hooks:
                h.on_step_end(self, batch, metrics)
        bar.close()
        if self.rank == 0 and self.best_score is None:  # a run shorter than eval_steps still selects a checkpoint
            self._main_only(self._maybe_evaluate)
        else:
            distributed.barrier()
        if self.world > 1:
            self.best_score, self.best_step = distributed.broadcast_object((self.best_score, self.best_step))
        seconds = time.perf_counter() - t0
        return LoopResult(self.step, self.best_score, self.best_step, resumed, seconds, sentences / max(seconds, 1e-9))
