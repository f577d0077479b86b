"""Fitting a masked-LM generator on a tokens corpus (the fit-generator stage's training: tasks/fit_generator.py).

Pure PyTorch: the stage reads the corpus and hands over its flat token ids, logs through `log_metrics` and publishes
the fitted model. A fixed held-out split of the sentence ids (`split_rows`, seeded `split_seed`) is masked once with
a seed of its own (`stable_seed(split_seed, "heldout")`); the head on the frozen backbone (`HeadFitter`) or the whole
masked LM (`MLMFineTuner`, with `backbone_lr`) is fitted with BERT's 80/10/10 masking at `mask_ratio`, epoch by
epoch in chunks of `chunk_batches` fresh masks (each chunk `reuse` times), and scored on the held-out positions
every `eval_every` steps and at the end, beside the unigram predictors and the baseline generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from cse.config.stages import GeneratorConfig
from cse.models.corruption import SpecialTokens
from cse.models.generator import (
    HeadFitter,
    MaskedBatch,
    MLMFineTuner,
    batches,
    init_bias_from_counts,
    mask_batch,
    masked_lm_predictions,
    token_counts,
    unigram_accuracies,
)
from cse.models.loading import load_masked_lm
from cse.storage.hashing import stable_hash


@dataclass
class GeneratorFit:
    """A fitted generator: the model (on the CPU, every parameter trainable: a plain masked LM), the held-out top-1
    accuracy per predictor, the evaluation history and the counts the stage records."""

    model: PreTrainedModel
    accuracy: dict[str, float]
    history: list[dict[str, float]]
    steps: int
    epochs: int
    train_rows: int
    heldout_rows: int
    heldout_ids: list[int]
    heldout_positions: int


@dataclass
class _Corpus:
    """Rows of flat token ids (`offsets`: where each row starts, and the end)."""

    flat: torch.Tensor
    offsets: np.ndarray

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    def subset(self, rows: np.ndarray) -> _Corpus:
        lengths = self.offsets[rows + 1] - self.offsets[rows]
        index = (
            np.concatenate([np.arange(self.offsets[r], self.offsets[r + 1]) for r in rows])
            if len(rows)
            else np.zeros(0, np.int64)
        )
        return _Corpus(self.flat[torch.from_numpy(index)], np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def split_rows(ids: np.ndarray, config: GeneratorConfig) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(train rows, held-out rows, held-out sentence ids): whole sentence ids are held out (every column of an NLI
    row together), `min(max_heldout, round(heldout_fraction × ids))` of them, by a permutation seeded `split_seed`."""
    unique = np.unique(ids)
    n_held = min(config.max_heldout, round(config.heldout_fraction * len(unique)))
    if n_held < 1 or n_held >= len(unique):
        raise ValueError(
            f"the tokens dataset has {len(unique)} sentence ids: too few to hold out "
            f"{config.heldout_fraction:.0%} (at most {config.max_heldout}) and train on the rest"
        )
    held_ids = np.sort(np.random.default_rng(config.split_seed).permutation(unique)[:n_held])
    is_held = np.isin(ids, held_ids)
    return np.flatnonzero(~is_held), np.flatnonzero(is_held), held_ids.tolist()


def stable_seed(seed: int, what: str) -> int:
    """A deterministic 63-bit seed derived from `seed` and what it is for (other purposes: independent seeds)."""
    return int(stable_hash({"seed": seed, "what": what}), 16) & (2**63 - 1)


def _accuracy(predicted: torch.Tensor, targets: torch.Tensor) -> float:
    return float((predicted == targets).float().mean()) if len(targets) else 0.0


def fit_masked_lm(
    flat: torch.Tensor,
    offsets: np.ndarray,
    ids: np.ndarray,
    special: SpecialTokens,
    config: GeneratorConfig,
    device: torch.device,
    *,
    load_baseline: Callable[[], PreTrainedModel | None],
    log_metrics: Callable[[dict[str, float], int], None],
    name: str,
    desc: str,
) -> GeneratorFit:
    """Fit the generator of `config` on a tokens corpus and score it on its held-out split (module docstring).

    Args:
        flat: every row's token ids, one after the other (int64).
        offsets: where each row starts in `flat`, and the end.
        ids: each row's sentence id (an NLI row's columns share theirs).
        special: the tokenizer's special ids and vocabulary size.
        config: the head, masking, split and schedule.
        device: where to fit.
        load_baseline: the baseline generator (`config.baseline_generator`), None without one.
        log_metrics: called with the held-out top-1 (and the mean training loss since the last one) at each step
            scored (0 first).
        name: the tokens dataset, as the errors name it.
        desc: the progress bar's label.
    """
    corpus = _Corpus(flat, offsets)
    train_rows, held_rows, held_ids = split_rows(ids, config)
    train, held = corpus.subset(train_rows), corpus.subset(held_rows)
    counts = token_counts(train.flat.numpy(), special.vocab_size, special.special)
    model = _init_model(config, counts)
    fitting = _Fitting.of(model, special, config, device, _planned_steps(train.rows, config))
    held_batches, targets, predict = fitting.held_out(held)
    accuracy: dict[str, float] = unigram_accuracies(counts, targets.numpy())
    if (baseline := load_baseline()) is not None:
        accuracy["random_init"] = _accuracy(
            torch.cat([masked_lm_predictions(baseline, b, special.vocab_size, device) for b in held_batches]), targets
        )
        del baseline

    def evaluate(step: int, loss: float | None) -> dict[str, float]:
        entry = {"step": step, "heldout_top1": _accuracy(predict(), targets)}
        entry.update({"train_loss": loss} if loss is not None else {})
        log_metrics({k: v for k, v in entry.items() if k != "step"}, step)
        return entry

    history, epochs = fitting.train(train, evaluate, name, desc)
    accuracy["fitted"] = history[-1]["heldout_top1"]
    model.cpu()
    for p in model.parameters():
        p.requires_grad_(True)  # saved as a plain masked LM
    return GeneratorFit(
        model, accuracy, history, fitting.fitter.steps, epochs, len(train_rows), len(held_rows), held_ids, len(targets)
    )


def _init_model(config: GeneratorConfig, counts: np.ndarray) -> PreTrainedModel:
    """The masked LM of `config.backbone`, its head's random init seeded `config.seed` (the global RNG untouched),
    its output bias from the training split's unigram counts with `bias_init = "unigram"`."""
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        model = load_masked_lm(config.backbone)
    if not isinstance(model, PreTrainedModel):  # (saved with save_pretrained)
        raise TypeError(f"{config.backbone}: a {type(model).__name__}, not a transformers masked LM")
    if config.bias_init == "unigram":
        init_bias_from_counts(model, counts)
    return model


def _planned_steps(rows: int, config: GeneratorConfig) -> int:
    return math.ceil(rows / config.batch_size) * config.epochs * config.reuse


@dataclass
class _Fitting:
    """One fit: its settings, the fitter (`HeadFitter`: the MLM head on the frozen backbone; `MLMFineTuner`: with
    `backbone_lr`, the whole masked LM) and its `total` steps."""

    config: GeneratorConfig
    special: SpecialTokens
    fitter: HeadFitter | MLMFineTuner
    total: int

    @classmethod
    def of(
        cls, model: PreTrainedModel, special: SpecialTokens, config: GeneratorConfig, device: torch.device, planned: int
    ) -> _Fitting:
        total = min(config.max_steps or planned, planned)
        warmup, vocab, decay = round(config.warmup_ratio * total), special.vocab_size, config.weight_decay
        if config.backbone_lr is None:
            return cls(config, special, HeadFitter(model, vocab, config.lr, decay, total, warmup, device), total)
        fitter = MLMFineTuner(model, vocab, config.lr, config.backbone_lr, decay, total, warmup, device)
        return cls(config, special, fitter, total)

    def held_out(self, held: _Corpus) -> tuple[list[MaskedBatch], torch.Tensor, Callable[[], torch.Tensor]]:
        """The held-out batches, masked once (seeded by `split_seed`), their targets and the fitter's predictions on
        them (a frozen backbone's features computed once)."""
        gen = torch.Generator().manual_seed(stable_seed(self.config.split_seed, "heldout"))
        held_batches = [
            mask_batch(held.flat, held.offsets, rows, self.special, self.config.mask_ratio, gen)
            for rows in batches(held.rows, self.config.batch_size, None)
        ]
        targets = torch.cat([b.targets for b in held_batches])
        if isinstance(fitter := self.fitter, HeadFitter):
            held_features = torch.cat([fitter.features(b) for b in held_batches])
            return held_batches, targets, lambda: fitter.predict(held_features)
        tuner = fitter
        return held_batches, targets, lambda: tuner.predict(held_batches)

    def train(
        self, train: _Corpus, evaluate: Callable[[int, float | None], dict[str, float]], name: str, desc: str
    ) -> tuple[list[dict[str, float]], int]:
        """Fit for `total` steps, epoch after epoch (fresh masks over the shuffled training rows); returns the
        evaluation history (`evaluate` at step 0, every `eval_every` steps and at the last) and the epochs started."""
        config, fitter = self.config, self.fitter
        history = [evaluate(0, None)]
        train_gen = torch.Generator().manual_seed(config.seed)
        bar = tqdm(total=self.total, unit="step", desc=desc)
        losses: list[float] = []

        def on_step(loss: float) -> None:
            losses.append(loss)
            bar.update(1)
            if fitter.steps % config.eval_every == 0 or fitter.steps == self.total:
                history.append(evaluate(fitter.steps, float(np.mean(losses[-config.eval_every :]))))
                last = history[-1]
                bar.set_postfix(loss=f"{last['train_loss']:.3f}", heldout_top1=f"{last['heldout_top1']:.4f}")

        epoch = 0
        while fitter.steps < self.total:
            steps_before = fitter.steps
            self.epoch(train, train_gen, on_step)
            epoch += 1
            if fitter.steps == steps_before:
                raise ValueError(
                    f"tokens dataset {name}: no token was masked in a whole epoch (mask_ratio "
                    f"{config.mask_ratio}, {train.rows} training rows): nothing to fit"
                )
        bar.close()
        return history, epoch

    def epoch(self, train: _Corpus, gen: torch.Generator, on_step: Callable[[float], None]) -> None:
        """One epoch, chunk by chunk (each chunk's batches masked afresh, a frozen backbone's features computed once
        and reused `reuse` times in shuffled order), until it ends or `total` steps are reached."""
        config, fitter = self.config, self.fitter
        epoch_batches = list(batches(train.rows, config.batch_size, gen))
        for start in range(0, len(epoch_batches), config.chunk_batches):
            chunk = [
                mask_batch(train.flat, train.offsets, rows, self.special, config.mask_ratio, gen)
                for rows in epoch_batches[start : start + config.chunk_batches]
            ]
            cached: list[tuple[Any, ...]]
            if isinstance(fitter, HeadFitter):
                cached = [(fitter.features(b), b.targets) for b in chunk if len(b.targets)]
            else:  # (reuse is 1: each batch runs through the unfrozen backbone once)
                cached = [(b,) for b in chunk if len(b.targets)]
            for _ in range(config.reuse):
                for i in torch.randperm(len(cached), generator=gen).tolist():
                    on_step(fitter.step(*cached[i]))
                    if fitter.steps >= self.total:
                        return
