"""The training loop: AdamW + linear decay, clipping, autocast, dev-set selection, resumable state.

Pure PyTorch plus two callbacks (`log_metrics`, `evaluate_dev`), so MLflow and the evaluator stay
at the seams (tasks/train.py). Resume state holds the trainable tensors, optimizer, scheduler,
RNG states, the position in the data and the best dev score; with `deterministic=True` a killed
and resumed run ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from models.checkpoint import trainable_state_dict
from storage.atomic import atomic_dir
from tasks.train_data import TrainingRows, epoch_order


class TrainingInterrupted(RuntimeError):
    """Raised by `stop_after` to simulate a kill; the resume state of the last checkpoint is kept."""


@dataclass
class LoopConfig:
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


@dataclass
class LoopResult:
    steps: int
    best_score: float | None
    best_step: int | None
    resumed_from: int | None
    seconds: float
    sentences_per_s: float


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        rows: TrainingRows,
        cfg: LoopConfig,
        device: torch.device,
        state_dir: Path,
        save_best: Callable[[torch.nn.Module, int, float], None],
        evaluate_dev: Callable[[torch.nn.Module], float],
        log_metrics: Callable[[dict[str, float], int], None],
        stop_after: int | None = None,
    ):
        self.model, self.rows, self.cfg, self.device = model, rows, cfg, device
        self.state_dir, self.save_best, self.evaluate_dev, self.log_metrics = state_dir, save_best, evaluate_dev, log_metrics
        self.stop_after = stop_after  # tests: simulate a kill after this many steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        self.steps_per_epoch = math.ceil(len(rows) / cfg.batch_size)
        total = self.steps_per_epoch * cfg.epochs
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: max(0.0, 1.0 - s / self.total_steps))
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16" and device.type == "cuda")
        self.step, self.best_score, self.best_step = 0, None, None

    # ------------------------------------------------------------------ state
    def save_state(self) -> None:
        with atomic_dir(self.state_dir) as tmp:
            save_file(trainable_state_dict(self.model), str(tmp / "trainable.safetensors"))
            torch.save(
                {
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "scaler": self.scaler.state_dict(),
                    "rng_torch": torch.get_rng_state(),
                    "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                    "rng_numpy": np.random.get_state(),
                    "rng_python": random.getstate(),
                },
                tmp / "optimizer.pt",
            )
            (tmp / "trainer_state.json").write_text(json.dumps(
                {"step": self.step, "best_score": self.best_score, "best_step": self.best_step,
                 "total_steps": self.total_steps, "steps_per_epoch": self.steps_per_epoch}, indent=2))

    def load_state(self) -> None:
        meta = json.loads((self.state_dir / "trainer_state.json").read_text())
        if meta["steps_per_epoch"] != self.steps_per_epoch or meta["total_steps"] != self.total_steps:
            raise ValueError(f"resume state in {self.state_dir} belongs to another data size or schedule")
        missing, unexpected = self.model.load_state_dict(load_file(str(self.state_dir / "trainable.safetensors")), strict=False)
        if unexpected:
            raise ValueError(f"resume state has tensors the model does not: {unexpected[:5]}")
        st = torch.load(self.state_dir / "optimizer.pt", weights_only=False)
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        self.scaler.load_state_dict(st["scaler"])
        torch.set_rng_state(st["rng_torch"])
        if st["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["rng_cuda"])
        np.random.set_state(st["rng_numpy"])
        random.setstate(st["rng_python"])
        self.step, self.best_score, self.best_step = meta["step"], meta["best_score"], meta["best_step"]

    # ------------------------------------------------------------------ loop
    def _autocast(self):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.cfg.precision)
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def _train_step(self, batch) -> dict[str, float]:
        self.model.train()
        with self._autocast():
            out = self.model(batch.input_ids, batch.attention_mask, batch.corrupted_ids, batch.rtd_labels)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(out.loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        values = (out.loss, out.contrastive_loss, out.rtd_loss, out.rtd_accuracy, grad_norm)
        names = ("loss", "loss_contrastive", "loss_rtd", "rtd_accuracy", "grad_norm")
        return {n: float(v.detach()) for n, v in zip(names, values)}

    def _maybe_evaluate(self) -> None:
        score = self.evaluate_dev(self.model)
        self.log_metrics({"stsb_dev": score}, self.step)
        if self.best_score is None or score > self.best_score:  # strictly better (methods.md §1.5)
            self.best_score, self.best_step = score, self.step
            self.save_best(self.model, self.step, score)
            self.log_metrics({"best_stsb_dev": score}, self.step)

    def run(self) -> LoopResult:
        torch.use_deterministic_algorithms(self.cfg.deterministic, warn_only=True)
        resumed = None
        if (self.state_dir / "trainer_state.json").is_file():
            self.load_state()
            resumed = self.step
        else:
            set_seed(self.cfg.seed)
        t0, sentences = time.perf_counter(), 0
        window_t, window_sent, window_tok = time.perf_counter(), 0, 0
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", desc="train")
        while self.step < self.total_steps:
            epoch, in_epoch = divmod(self.step, self.steps_per_epoch)
            order = epoch_order(len(self.rows), self.cfg.seed, epoch)
            for b in range(in_epoch, self.steps_per_epoch):
                if self.step >= self.total_steps:
                    break
                idx = order[b * self.cfg.batch_size:(b + 1) * self.cfg.batch_size]
                batch = self.rows.batch(idx, epoch).to(self.device)
                metrics = self._train_step(batch)
                self.step += 1
                sentences += batch.sentences
                window_sent += batch.sentences
                window_tok += batch.tokens
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
                if self.step % self.cfg.log_steps == 0 or self.step == self.total_steps:
                    dt = max(time.perf_counter() - window_t, 1e-9)
                    metrics.update(learning_rate=self.scheduler.get_last_lr()[0], epoch=epoch + (b + 1) / self.steps_per_epoch,
                                   sentences_per_s=window_sent / dt, tokens_per_s=window_tok / dt)
                    if self.device.type == "cuda":
                        metrics["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
                    self.log_metrics(metrics, self.step)
                    window_t, window_sent, window_tok = time.perf_counter(), 0, 0
                if self.step % self.cfg.eval_steps == 0:
                    self._maybe_evaluate()
                if self.step % self.cfg.checkpoint_steps == 0 or self.step == self.total_steps:
                    self.save_state()
                if self.stop_after is not None and self.step >= self.stop_after:
                    bar.close()
                    raise TrainingInterrupted(f"stopped after step {self.step} (stop_after)")
        bar.close()
        if self.best_score is None:  # a run shorter than eval_steps still yields a selected checkpoint
            self._maybe_evaluate()
        seconds = time.perf_counter() - t0
        return LoopResult(self.step, self.best_score, self.best_step, resumed, seconds, sentences / max(seconds, 1e-9))
