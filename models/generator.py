"""Fitting a masked-LM head on a frozen encoder: a replaced-token generator one can fit oneself.

Pure PyTorch + transformers: no Prefect, no MLflow.

The head is the standard BERT MLM head (Devlin et al., 2019, the `cls.predictions` of `BertForMaskedLM`; RoBERTa's
`lm_head` and DistilBERT's `vocab_*` layers are the same shape): a dense transform, the activation, LayerNorm, then a
decoder whose weight is the encoder's word-embedding matrix (tied) plus an output bias. The encoder is frozen (eval
mode, no dropout, no gradient): each batch's final hidden states are computed once under `torch.no_grad` and only
the head learns (transform, LayerNorm, output bias; the tied decoder weight is the frozen embedding matrix).

Masking is BERT's: 15 % of the non-special tokens are selected; of those 80 % become [MASK], 10 % a random id,
10 % stay unchanged; the loss is cross-entropy at every selected position (models/corruption.py's `mask_tokens`,
the same draws the corruption stage makes).

One choice beyond BERT: the output bias starts at the log unigram frequencies of the training tokens (centred), so
the head starts at the unigram baseline instead of the uniform one; `bias_init="zeros"` gives BERT's init.

`MLMFineTuner` is the other way to fit a generator (`GeneratorConfig.backbone_lr`): full masked-LM fine-tuning, the
encoder unfrozen, for a stronger generator than a head on a frozen sentence encoder can be.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from cse.models.corruption import Noise, SpecialTokens, candidate_mask, logits_at, mask_tokens, mlm_head, pad_batch
from cse.models.loading import word_embeddings


def tied_output_embeddings(model: PreTrainedModel) -> torch.nn.Linear:
    """The decoder (output embeddings) of a masked LM, checked to share its weight with the word embeddings."""
    out = cast(torch.nn.Linear | None, model.get_output_embeddings())  # a masked LM's decoder is a Linear
    if out is None or out.weight is not word_embeddings(model).weight:
        raise ValueError(
            f"{type(model).__name__}: the MLM decoder is not tied to the word embeddings "
            "(config.tie_word_embeddings must be true): a frozen-backbone head needs the tied decoder"
        )
    if getattr(out, "bias", None) is None:
        raise ValueError(f"{type(model).__name__}: the MLM decoder has no output bias")
    return out


def freeze_backbone(model: PreTrainedModel) -> list[torch.nn.Parameter]:
    """Freeze the encoder of a masked LM (and with it the tied decoder weight); returns the head's trainable
    parameters. The encoder is put in eval mode (no dropout)."""
    if model.base_model is model:
        raise ValueError(f"{type(model).__name__} is not a masked LM with a separate head")
    tied_output_embeddings(model)
    base = {id(p) for p in model.base_model.parameters()}
    head = []
    for p in model.parameters():  # shared parameters appear once
        p.requires_grad_(id(p) not in base)
        if p.requires_grad:
            head.append(p)
    if not head:
        raise ValueError(f"{type(model).__name__}: no head parameters outside the encoder")
    model.base_model.eval()
    return head


def token_counts(flat_ids: np.ndarray, vocab_size: int, special: tuple[int, ...] | list[int]) -> np.ndarray:
    """Occurrences of each token id in `flat_ids` (int64, length `vocab_size`), special ids set to 0."""
    ids = np.asarray(flat_ids, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size}): min {ids.min()}, max {ids.max()}")
    counts = np.bincount(ids, minlength=vocab_size).astype(np.int64)
    counts[list(special)] = 0
    return counts


def init_bias_from_counts(model: PreTrainedModel, counts: np.ndarray, smoothing: float = 1.0) -> None:
    """Set the output bias to the centred log of the smoothed unigram frequencies (ids beyond `counts`: the minimum)."""
    bias = tied_output_embeddings(model).bias
    logp = np.log(counts.astype(np.float64) + smoothing)
    logp -= logp.mean()
    values = torch.full_like(bias, float(logp.min()))
    values[: len(logp)] = torch.from_numpy(logp[: bias.numel()]).to(bias.dtype)
    with torch.no_grad():
        bias.copy_(values)


@dataclass
class MaskedBatch:
    """A padded batch with BERT masking: the model input, where the targets are, and the targets (original ids)."""

    input_ids: torch.Tensor  # (B, T), masked
    attention_mask: torch.Tensor  # (B, T)
    selected: torch.Tensor  # (B, T) bool
    targets: torch.Tensor  # (n_selected,) original ids, row-major over `selected`


def mask_batch(
    flat_ids: torch.Tensor,
    offsets: np.ndarray,
    rows: np.ndarray,
    tokens: SpecialTokens,
    mask_ratio: float,
    generator: torch.Generator,
) -> MaskedBatch:
    """BERT's 80/10/10 masking of the sequences `rows` (flat ids + offsets), padded to their longest."""
    ids, attention, _ = pad_batch(flat_ids, offsets, rows, tokens.pad)
    noise = Noise.draw(ids.shape, tokens.vocab_size, generator, with_sample=False)
    masked, selected = mask_tokens(ids, candidate_mask(ids, attention, tokens), noise, mask_ratio, tokens)
    return MaskedBatch(masked, attention, selected, ids[selected])


def batches(n_rows: int, batch_size: int, generator: torch.Generator | None) -> Iterator[np.ndarray]:
    """Row indices in batches: shuffled with `generator`, or in order when None."""
    order = np.arange(n_rows) if generator is None else torch.randperm(n_rows, generator=generator).numpy()
    for start in range(0, n_rows, batch_size):
        yield order[start : start + batch_size]


class _Scheduled:
    """The optimiser part the two fitters share: `optimizer` with linear warmup and linear decay to zero
    (`scheduler`), and `steps`, the optimiser steps taken."""

    def _schedule(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int) -> None:
        """Set `optimizer`, its schedule (`warmup_steps` up, then down to zero at `total_steps`) and no steps taken."""
        self.optimizer = optimizer
        total, warm = max(total_steps, 1), max(warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(total - warm, 1))
        )
        self.steps = 0

    def _descend(self, loss: torch.Tensor) -> float:
        """One optimiser and schedule step on `loss`; returns the loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.steps += 1
        return float(loss.detach())


class HeadFitter(_Scheduled):
    """AdamW on the head of a frozen-encoder masked LM, with linear warmup and linear decay to zero."""

    def __init__(
        self,
        model: PreTrainedModel,
        vocab_size: int,
        lr: float,
        weight_decay: float,
        total_steps: int,
        warmup_steps: int,
        device: torch.device | str = "cpu",
    ):
        self.device = torch.device(device)
        self.model = model.to(self.device)  # type: ignore[arg-type]  # PreTrainedModel.to is a functools.wraps wrapper: its stub binds no self
        self.params = freeze_backbone(model)
        head = mlm_head(model)
        if head is None:
            raise ValueError(f"{type(model).__name__}: unknown masked-LM head")
        self.head: Callable[[torch.Tensor], torch.Tensor] = head
        self.vocab_size = vocab_size
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]  # biases and LayerNorm, as BERT
        self._schedule(
            torch.optim.AdamW(
                [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
            ),
            total_steps,
            warmup_steps,
        )

    @torch.no_grad()
    def features(self, batch: MaskedBatch) -> torch.Tensor:
        """The frozen encoder's final hidden states at the selected positions, (n_selected, hidden)."""
        self.model.base_model.eval()
        hidden = self.model.base_model(
            input_ids=batch.input_ids.to(self.device), attention_mask=batch.attention_mask.to(self.device)
        )[0]
        return hidden[batch.selected.to(self.device)]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)[:, : self.vocab_size]

    def step(self, features: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimiser step on the cross-entropy at the selected positions; returns the loss."""
        self.model.train()
        self.model.base_model.eval()
        loss = F.cross_entropy(self.logits(features), targets.to(self.device))
        return self._descend(loss)

    @torch.no_grad()
    def predict(self, features: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
        """Top-1 ids for precomputed features (chunked over positions)."""
        self.model.eval()
        return (
            torch.cat([self.logits(features[i : i + chunk]).argmax(-1).cpu() for i in range(0, len(features), chunk)])
            if len(features)
            else torch.zeros(0, dtype=torch.long)
        )


class MLMFineTuner(_Scheduled):
    """Full masked-LM fine-tuning (`GeneratorConfig.backbone_lr`): AdamW on every parameter, the backbone (with the
    tied word embeddings) at `backbone_lr` and the head at `lr`, each batch through the model in train mode (dropout
    on), with linear warmup and linear decay to zero; the loss is cross-entropy at the selected positions."""

    def __init__(
        self,
        model: PreTrainedModel,
        vocab_size: int,
        lr: float,
        backbone_lr: float,
        weight_decay: float,
        total_steps: int,
        warmup_steps: int,
        device: torch.device | str = "cpu",
    ):
        if model.base_model is model:
            raise ValueError(f"{type(model).__name__} is not a masked LM with a separate head")
        tied_output_embeddings(model)
        self.device = torch.device(device)
        self.model = model.to(self.device)  # type: ignore[arg-type]  # PreTrainedModel.to is a functools.wraps wrapper: its stub binds no self
        self.model.requires_grad_(True)
        self.vocab_size = vocab_size
        base = {id(p) for p in model.base_model.parameters()}
        groups = []
        for in_base, rate in ((True, backbone_lr), (False, lr)):
            params = [p for p in model.parameters() if (id(p) in base) == in_base]
            groups += [
                {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay, "lr": rate},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": rate},
            ]
        self._schedule(torch.optim.AdamW([g for g in groups if g["params"]]), total_steps, warmup_steps)

    def step(self, batch: MaskedBatch) -> float:
        """One optimiser step on the batch's selected positions; returns the loss."""
        self.model.train()
        logits = logits_at(
            self.model,
            batch.input_ids.to(self.device),
            batch.attention_mask.to(self.device),
            batch.selected.to(self.device),
        )[:, : self.vocab_size]
        loss = F.cross_entropy(logits, batch.targets.to(self.device))
        return self._descend(loss)

    def predict(self, batches: list[MaskedBatch]) -> torch.Tensor:
        """Top-1 ids at the selected positions of `batches` (eval mode), in order."""
        out = [masked_lm_predictions(self.model, b, self.vocab_size, self.device) for b in batches]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


@torch.no_grad()
def masked_lm_predictions(
    model: PreTrainedModel, batch: MaskedBatch, vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Top-1 ids of any masked LM (eval mode: no dropout) at the batch's selected positions."""
    device = torch.device(device)
    model.to(device).eval()  # type: ignore[arg-type]  # PreTrainedModel.to is a functools.wraps wrapper: its stub binds no self
    logits = logits_at(model, batch.input_ids.to(device), batch.attention_mask.to(device), batch.selected.to(device))
    return logits[:, :vocab_size].argmax(-1).cpu()


def unigram_accuracies(counts: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """The unigram baselines' top-1 accuracy on `targets` (counts from the training split, special ids 0):
    `unigram_argmax` = always predict the most frequent training token; `unigram_sample` = the expected accuracy of
    predicting a token drawn from the training frequencies (what `corrupt.mode: unigram` replaces with)."""
    targets = np.asarray(targets, dtype=np.int64)
    if not len(targets):
        return {"unigram_argmax": 0.0, "unigram_sample": 0.0}
    p = counts / max(counts.sum(), 1)
    return {
        "unigram_argmax": float((targets == int(counts.argmax())).mean()),
        "unigram_sample": float(p[targets].mean()),
    }
