"""One training job from its `TrainConfig`: identity, model, phases, rows, and `fit` (the loop with its callbacks).

Pure: the caller injects the tracking callbacks (`log_params`, `log_metrics`: the `train` task passes its MLflow
logger, tasks/train.py; rank 0 of a distributed job its own, tasks/distributed_train.py), the dev evaluator and
the context held around the loop (the task's GPU slot).

Every evaluation of a method with a conditional discriminator (D2CSE, DiffCSE) also runs the RTD mechanism probe
(`ConditionalRTDModel.rtd_h_probe`) on one fixed batch (`rtd_probe`): the discriminator's RTD loss with the true h,
with h rolled by one row (another sentence's) and with no h, logged as `rtd_loss_true_h`, `rtd_loss_rolled_h`,
`rtd_loss_no_h` and `rtd_h_gap` = rolled − true, and the RTD term's gradient share (`rtd_grad_share`): on the same
batch, ‖λ∇L_RTD‖ / ‖∇L_CL‖ per trainable group, logged as `rtd_grad_share_<group>` (`rtd_grad_norm_<group>`,
‖λ∇L_RTD‖, for the discriminator's copy and the RTD head, which the contrastive loss does not reach), with
`rtd_probe_seconds`, the cost of both. It runs in the evaluation callback, outside the compiled training step, and
leaves the training's random state, buffers and gradients as they were.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from cse.config.training import (
    KEY_NEUTRAL_DEFAULTS,
    LAUNCH_FIELDS,
    TrainConfig,
)
from cse.models.finite import NonFiniteWeights as NonFiniteWeights  # (raised here; its home is models/finite.py)
from cse.models.finite import require_finite_model
from cse.models.methods.crtd import PROBE_METRICS, ConditionalRTDModel
from cse.storage import keys
from cse.storage.datasets import DatasetRef
from cse.storage.layout import DataRoot
from cse.storage.runs import RunDir
from cse.storage.settings import get_settings
from cse.storage.training_data import load_corruption_rows, load_token_rows
from cse.training.loop import LoopConfig, LoopResult, Phase, StopAfter, Trainer, set_seed
from cse.training.rows import TrainingRows

if TYPE_CHECKING:
    from cse.evaluation.evaluator import Evaluator
    from cse.evaluation.transfer import TransferEvaluator
    from cse.models.method import CSEModel
    from cse.storage.transfer import TransferInput

log = logging.getLogger(__name__)

LogParams = Callable[[dict[str, Any]], None]
LogMetrics = Callable[[dict[str, float], int], None]


def run_key(
    cfg: TrainConfig, tokens: DatasetRef, corruption: DatasetRef | None, nli_tokens: DatasetRef | None = None
) -> str:
    """The job's identity: its resolved config (without the launch fields) and the content of every dataset it reads."""
    config = keys.without_defaults(cfg.model_dump(exclude=set(LAUNCH_FIELDS)), KEY_NEUTRAL_DEFAULTS)
    return keys.run_key(
        config,
        tokens.content_hash,
        corruption.content_hash if corruption is not None else None,
        nli_tokens.content_hash if nli_tokens is not None else None,
    )


def resolve_precision(cfg: TrainConfig, device: torch.device) -> str:
    """The training precision: the configured one, or for `auto` bf16 on a CUDA `device` that supports it, else
    fp32."""
    if cfg.precision != "auto":
        return cfg.precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def build_model(cfg: TrainConfig, device: torch.device) -> CSEModel:
    """The configured method's model on its backbone, on `device`."""
    from cse.config.methods import get_method

    return get_method(cfg.method).build_model(cfg.model, backbone_name=cfg.backbone).to(device)


def require_finite_weights(model: torch.nn.Module, backbone: str) -> None:
    """Refuse a model with a non-finite parameter or buffer, naming each tensor (and, for a matrix, its first rows):
    a backbone whose embedding row of one token is `inf` trains without a word when the training rows never hold the
    token, then embeds every sentence that does as `nan`.

    Args:
        model: the job's model as built.
        backbone: the backbone's name, for the message.

    Raises:
        NonFiniteWeights: naming the tensors, their non-finite counts and the backbone.
    """
    require_finite_model(
        model,
        f"the model built on backbone {backbone!r}",
        "Refused before training: check or replace the backbone's weights",
    )


def training_phases(cfg: TrainConfig, rows: TrainingRows, nli_rows: TrainingRows | None) -> list[Phase]:
    """One phase for every method but DiffAug: prefix-only NLI steps, then joint tuning (DiffAug, Wang & Lu, 2022)."""
    joint = Phase("main", rows, cfg.batch_size, cfg.learning_rate, cfg.epochs, cfg.max_steps)
    if cfg.prefix_phase is None:
        return [joint]
    if nli_rows is None:
        raise ValueError(f"{cfg.method}/{cfg.preset}: its prefix phase reads NLI rows, and none were loaded")
    joint.name = "joint"
    if cfg.aux_nli_batch_size:
        joint.aux_rows, joint.aux_batch_size = nli_rows, cfg.aux_nli_batch_size
    pp = cfg.prefix_phase
    prefix = Phase(
        "prefix",
        nli_rows,
        pp.batch_size,
        pp.learning_rate,
        max_steps=pp.steps,
        cycle=True,
        schedule_steps=joint.total_steps if pp.schedule_over_joint_steps else None,
    )
    return [prefix, joint]


def load_training_rows(
    cfg: TrainConfig,
    root: DataRoot,
    tokens: DatasetRef,
    corruption: DatasetRef | None,
    nli_tokens: DatasetRef | None,
    pad_id: int,
) -> tuple[TrainingRows, TrainingRows | None]:
    """The job's training rows and, for DiffAug, its NLI rows."""
    token_rows = load_token_rows(
        root, tokens.key, ("sent0", "sent1", "hard_neg") if cfg.supervised else ("text",), limit=cfg.max_train_sentences
    )
    require_a_batch(root, tokens.key, len(token_rows.ids), cfg.batch_size, "batch_size")
    corruption_rows = load_corruption_rows(root, corruption.key, token_rows) if corruption is not None else None
    pad_to = cfg.max_length if cfg.speed.pad_to_max_length else None
    rows = TrainingRows(token_rows, corruption_rows, cfg.supervised, pad_id, pad_to)
    nli_rows = None
    if nli_tokens is not None:
        nli_token_rows = load_token_rows(
            root, nli_tokens.key, ("sent0", "sent1", "hard_neg"), limit=cfg.max_train_sentences
        )
        if cfg.prefix_phase is not None:
            require_a_batch(
                root, nli_tokens.key, len(nli_token_rows.ids), cfg.prefix_phase.batch_size, "prefix_phase.batch_size"
            )
        nli_rows = TrainingRows(nli_token_rows, None, True, pad_id, pad_to)
    return rows, nli_rows


def require_a_batch(root: DataRoot, key: str, rows: int, batch_size: int, field: str) -> None:
    """Refuse, at the job's start, training rows fewer than one batch (a contrastive batch of one row has no
    negatives; an empty one trains nothing): one message naming the tokens dataset's folder and both counts."""
    if rows < batch_size:
        raise ValueError(
            f"tokens dataset {key} ({root.dataset_dir('tokens', key)}) has {rows} training rows, fewer "
            f"than one batch ({field} = {batch_size}): use a larger source or a smaller batch"
        )


PROBE_ROWS = 64  # sentences in the RTD mechanism probe's fixed batch


@dataclass(frozen=True)
class RTDProbe:
    """The fixed batch of the RTD mechanism probe: `(B, T)` rows, one view each, with their corruption (variant 0).

    Attributes:
        input_ids: `(B, T)` original ids.
        attention_mask: `(B, T)` token mask.
        corrupted_ids: `(B, T)` corrupted ids (the corruption stage's variant 0).
        rtd_labels: `(B, T)` labels (1 = replaced).
        held_out: whether the job never trains on these rows.
        rows: where the rows come from, in words (the run's parameter `rtd_probe_rows`).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    corrupted_ids: torch.Tensor
    rtd_labels: torch.Tensor
    held_out: bool
    rows: str

    def run(self, model: ConditionalRTDModel, device: torch.device) -> dict[str, float]:
        """The probe's metrics for `model` as it is now: `cse.models.methods.crtd.PROBE_METRICS`, the RTD term's
        gradient share per trainable group (`ConditionalRTDModel.rtd_grad_share`: `rtd_grad_share_<group>`, and
        `rtd_grad_norm_<group>` for the groups only the RTD loss reaches) and `rtd_probe_seconds`, the cost of both."""
        t0 = time.perf_counter()
        rows = (self.input_ids, self.attention_mask, self.corrupted_ids, self.rtd_labels)
        ids, mask, corrupted, labels = (t.to(device) for t in rows)
        out = model.rtd_h_probe(ids, mask, corrupted, labels)
        shares = model.rtd_grad_share(ids, mask, corrupted, labels)
        return {
            **{PROBE_METRICS[k]: v for k, v in out.items()},
            **{f"rtd_grad_{k}": v for k, v in shares.items()},
            "rtd_probe_seconds": time.perf_counter() - t0,
        }


def rtd_probe(
    cfg: TrainConfig, root: DataRoot, tokens: DatasetRef, corruption: DatasetRef | None, pad_id: int
) -> RTDProbe | None:
    """The RTD probe's fixed batch for a job that reads a corruption (None otherwise): the last `PROBE_ROWS`
    sentences of the tokens dataset (first column: `text`, or the anchor `sent0` when supervised), corruption
    variant 0. They are held out when the job trains on at most the dataset's rows minus those (`max_train_sentences`,
    e.g. the smoke presets); a job on the whole dataset also trains on them, and the parameter `rtd_probe_rows` says so
    (at paper scale, 64 of 1M sentences seen once per epoch)."""
    if corruption is None:
        return None
    column = "sent0" if cfg.supervised else "text"
    token_rows = load_token_rows(root, tokens.key, (column,))
    n = len(token_rows)
    k = min(PROBE_ROWS, n)
    if k < 2:
        return None
    rows = TrainingRows(token_rows, load_corruption_rows(root, corruption.key, token_rows), False, pad_id)
    batch = rows.batch(list(range(n - k, n)), 0)  # (k, 2, T): view 0 reads variant 0
    if batch.corrupted_ids is None or batch.rtd_labels is None:
        raise ValueError(f"corruption {corruption.key} gave the probe's rows no corrupted ids")
    trained = min(cfg.max_train_sentences or n, n)
    held_out = trained <= n - k
    where = (
        f"the last {k} of {n:,} sentences ({column}), {'never trained on' if held_out else 'also training rows'} "
        f"(the job trains on the first {trained:,})"
    )
    return RTDProbe(
        batch.input_ids[:, 0],
        batch.attention_mask[:, 0],
        batch.corrupted_ids[:, 0],
        batch.rtd_labels[:, 0],
        held_out,
        where + "; corruption variant 0",
    )


def transfer_evaluator(data_root: str | Path) -> tuple[TransferEvaluator, TransferInput]:
    """The SentEval transfer tasks (shared mirror, else the newest ingested `transfer` dataset) and their source."""
    from cse.evaluation.transfer import TransferEvaluator
    from cse.storage.transfer import load_transfer_input

    source = load_transfer_input(None, DataRoot(data_root), get_settings().shared_data)
    return TransferEvaluator(source.table), source


def loop_config(cfg: TrainConfig, precision: str) -> LoopConfig:
    """The loop settings of a job."""
    speed = cfg.speed
    # unset (None, ""): the loop's default, its environment switch (compile: `Trainer.compiles` decides)
    switches: dict[str, Any] = {
        "fused_adamw": speed.fused_adamw,
        "compile_mode": speed.compile_mode or None,
        "compile": speed.compile,
    }
    return LoopConfig(
        batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate,
        epochs=cfg.epochs,
        max_steps=cfg.max_steps,
        grad_clip=cfg.grad_clip,
        seed=cfg.seed,
        eval_steps=cfg.eval_steps,
        checkpoint_steps=cfg.checkpoint_steps or cfg.eval_steps,
        log_steps=cfg.log_steps,
        precision=precision,
        deterministic=cfg.deterministic,
        grad_cache_chunk_size=cfg.grad_cache.chunk_size,
        cast_frozen_weights=speed.cast_frozen_weights,
        async_state=speed.async_state,
        state_interval_s=speed.state_interval_s,
        **{k: v for k, v in switches.items() if v is not None},
    )


def fit(
    cfg: TrainConfig,
    rows: TrainingRows,
    nli_rows: TrainingRows | None,
    run_dir: RunDir,
    run_id: str,
    device: torch.device,
    precision: str,
    evaluator: Evaluator | None,
    log_params: LogParams,
    log_metrics: LogMetrics,
    stop_after: int | None = None,
    slot: AbstractContextManager | None = None,
    logger: logging.Logger | logging.LoggerAdapter | None = None,
    probe: RTDProbe | None = None,
) -> LoopResult:
    """Build the model and run the training loop: the single-process job, or one rank of a distributed job
    (training/distributed.py; only rank 0 calls the callbacks, so `evaluator` may be None elsewhere). `slot` is held
    around the loop (the `train` task's GPU slot); `logger` says when the job resumes; `probe` (`rtd_probe`) is run
    and logged at every evaluation when the model has a conditional discriminator."""
    # the initial prompts, MLPs and heads follow the job's seed (the references seed before building)
    set_seed(cfg.seed)
    model = build_model(cfg, device)
    require_finite_weights(model, cfg.backbone)
    if cfg.speed.unpadded_fill is not None:
        model.use_unpadded(cfg.speed.unpadded_fill)  # (cse.models.prompts.packing)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log_params(
        {
            "trainable_parameters": n_trainable,
            "resolved_precision": precision,
            "resolved_device": str(device),
            "train_rows": len(rows),
            "corruption_reuse": rows.reuse_description(cfg.epochs),
        }
    )
    if probe is not None and not isinstance(model, ConditionalRTDModel):
        probe = None  # (a method without a conditional discriminator)
    if probe is not None:
        log_params({"rtd_probe_rows": probe.rows})
    save_best, evaluate_dev = _selection(
        cfg, run_dir, run_id, device, evaluator, log_metrics, probe, step=lambda: trainer.step
    )
    trainer = Trainer(
        model,
        training_phases(cfg, rows, nli_rows),
        loop_config(cfg, precision),
        device,
        run_dir.resume_state,
        save_best,
        evaluate_dev,
        log_metrics,
        hooks=[StopAfter(stop_after)] if stop_after is not None else [],
    )
    trainer.selection_metric = selection_metric(cfg)
    trainer.warn = (logger or log).warning
    log_params({"total_steps": trainer.total_steps})  # (what `cse run` measures its progress bar against)
    if trainer.step == 0 and run_dir.has_state():
        (logger or log).info("resuming %s from %s", run_id, run_dir.state)
    with slot if slot is not None else contextlib.nullcontext():
        return trainer.run()


def selection_metric(cfg: TrainConfig) -> str:
    """What the job selects its best checkpoint on: `transfer_dev_avg` with `selection = "transfer"`, else `stsb_dev`."""
    return "transfer_dev_avg" if cfg.selection == "transfer" else "stsb_dev"


def _selection(
    cfg: TrainConfig,
    run_dir: RunDir,
    run_id: str,
    device: torch.device,
    evaluator: Any,
    log_metrics: LogMetrics,
    probe: RTDProbe | None,
    step: Callable[[], int],
) -> tuple[Callable[[torch.nn.Module, int, float], None], Callable[[torch.nn.Module], float]]:
    """The loop's `save_best` (the checkpoint into `run_dir.best`) and `evaluate_dev` (STS-B dev, or SentEval's
    fasttest dev average with `selection = "transfer"`; the RTD probe first, logged at the loop's `step()`)."""
    from cse.models.checkpoint import save_checkpoint

    metric = selection_metric(cfg)
    transfer_dev = None
    settings: dict[str, Any] = {"batch_size": cfg.eval_batch_size, "precision": cfg.eval_precision}

    def save_best(m: torch.nn.Module, step: int, score: float) -> None:  # (the trainer's model: build_model's)
        save_checkpoint(cast("CSEModel", m), run_dir.best, extra_meta={"step": step, metric: score, "run_id": run_id})

    def evaluate_dev(m: torch.nn.Module) -> float:
        nonlocal transfer_dev
        model = cast("CSEModel", m)  # (the trainer's model: build_model's)
        if probe is not None:  # the RTD probe on its fixed batch (fp32; h probe in eval mode, gradient share forked)
            log_metrics(probe.run(cast(ConditionalRTDModel, model), device), step())
        stsb = evaluator.run(model, mode="dev", **settings).metrics()["stsb_dev"]
        if cfg.selection != "transfer":
            return stsb
        # SimCSE's trainer with eval_transfer: SentEval fasttest settings, the mean devacc of the 7 tasks
        if transfer_dev is None:
            transfer_dev = transfer_evaluator(get_settings().data_root)[0]
        res = transfer_dev.run(model, classifier="fasttest", **settings)
        log_metrics({"stsb_dev": stsb, **{f"{t}_dev": s.devacc for t, s in res.tasks.items()}}, step())
        return res.dev_score

    return save_best, evaluate_dev
