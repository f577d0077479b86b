"""The objective D2CSE and DiffCSE share: contrastive loss on `h` + λ · conditional replaced-token detection.

`ConditionalRTDModel` does the shape checks, RTD label defaulting (`corrupted != original` on real tokens,
methods.md §4 step 4), the contrastive loss (§1.2), the RTD loss (§4 step 6, §10.2) and `training_step`; a
subclass says how the training rows are encoded (`encode_rows`) and how its discriminator reads the corrupted
rows conditioned on `h` (`discriminate_rows`).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from models.batching import TrainBatch
from models.heads import ProjectionMLP, RTDHead
from models.losses import contrastive_loss, rtd_accuracy, rtd_loss
from models.method import CSEModel, StepOutput

def check_objective(temperature: float, rtd_weight: float) -> None:
    """Validation of the hyperparameters every contrastive + conditional-RTD config has (τ, λ)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if rtd_weight < 0:
        raise ValueError(f"rtd_weight must be >= 0, got {rtd_weight}")


def align_corruption(input_ids: torch.Tensor, attention_mask: torch.Tensor, corrupted_ids: torch.Tensor,
                     rtd_labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked `(B, n, T)` corrupted ids and RTD labels for `(B, n, T)` rows, n = 2 (unsup) or 3 (sup).

    `corrupted_ids` / `rtd_labels` may be `(B, n, T)` or `(B, 1, T)` (one corruption shared by every view).
    Labels default to `corrupted != original` on non-pad positions (§4 step 4).
    """
    if input_ids.dim() != 3 or input_ids.shape[1] not in (2, 3):
        raise ValueError(f"input_ids must be (B, 2|3, T), got {tuple(input_ids.shape)}")
    batch, n, length = input_ids.shape
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if corrupted_ids is None:
        raise ValueError("corrupted_ids are required (the corruption stage's output)")
    if corrupted_ids.dim() != 3 or corrupted_ids.shape[0] != batch or corrupted_ids.shape[1] not in (1, n) \
            or corrupted_ids.shape[2] != length:
        raise ValueError(f"corrupted_ids must be (B, {n}|1, T) = ({batch}, {n}|1, {length}), got {tuple(corrupted_ids.shape)}")
    corrupted_ids = corrupted_ids.expand(batch, n, length)
    if rtd_labels is None:
        rtd_labels = (corrupted_ids != input_ids) & attention_mask.bool()
    elif rtd_labels.shape not in (corrupted_ids.shape, (batch, 1, length)):
        raise ValueError(f"rtd_labels must be (B, {n}|1, T), got {tuple(rtd_labels.shape)}")
    return corrupted_ids, rtd_labels.expand(batch, n, length)


@dataclass
class CRTDOutput:
    """Losses of one training forward; `h` is the `(B, n, d)` BN-MLP output."""

    loss: torch.Tensor
    contrastive_loss: torch.Tensor
    rtd_loss: torch.Tensor
    rtd_accuracy: torch.Tensor
    h: torch.Tensor




class ConditionalRTDModel(CSEModel):
    """Contrastive loss on the BN-MLP output `h` plus conditional RTD on precomputed corruptions (§4, §5).

    Per step on `(B, n, T)` rows flattened to `(B·n, T)`: `encode_rows` → CLS states → `self.projection`
    (BN-MLP over all B·n rows together) → `h` (contrastive vector and conditioning vector, not detached);
    contrastive loss on `h` (hard negatives when n = 3); `discriminate_rows` → RTD logits `(B·n, T, 2)` on
    the corrupted rows; `L = L_CL + λ·L_RTD` with the RTD mean over all positions (padding included) unless
    `rtd_mean_over_padding=False`. The config must carry `temperature`, `rtd_weight`,
    `hard_negative_weight` and `rtd_mean_over_padding`; subclasses set `projection` and `rtd_head`.
    """

    uses_corruption = True
    evaluation_pooler = "cls_before_pooler"
    not_for_inference = ("discriminator.", "rtd_head.")
    projection: ProjectionMLP
    rtd_head: RTDHead

    @abstractmethod
    def encode_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_type_ids: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """Last-layer CLS states `(B', d)` of the training pass, and a context handed to `discriminate_rows`."""

    @abstractmethod
    def discriminate_rows(self, corrupted_ids: torch.Tensor, attention_mask: torch.Tensor, h: torch.Tensor,
                          token_type_ids: torch.Tensor | None, context: Any) -> torch.Tensor:
        """RTD logits `(B', T, 2)` of the training pass's discriminator on `(B', T)` corrupted rows given `h`."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, corrupted_ids: torch.Tensor,
                rtd_labels: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None) -> CRTDOutput:
        """One training forward on `(B, n, T)` rows, n = 2 (unsup, two dropout views) or 3 (sup, with hard negative).

        `corrupted_ids` / `rtd_labels`: `(B, n, T)`, or `(B, 1, T)` for one corruption shared by every view.
        Labels default to `corrupted != original` on non-pad positions (§4 step 4).
        """
        corrupted_ids, rtd_labels = align_corruption(input_ids, attention_mask, corrupted_ids, rtd_labels)
        batch, n, length = input_ids.shape
        rows = batch * n
        flat = lambda t: None if t is None else t.reshape(rows, length)  # noqa: E731
        ids, mask, types = flat(input_ids), flat(attention_mask), flat(token_type_ids)

        cls, context = self.encode_rows(ids, mask, types)
        h = self.projection(cls)
        z = h.view(batch, n, -1)
        cfg = self.config
        l_cl = contrastive_loss(z[:, 0], z[:, 1], z[:, 2] if n == 3 else None,
                                temperature=cfg.temperature, hard_negative_weight=cfg.hard_negative_weight)

        logits = self.discriminate_rows(flat(corrupted_ids), mask, h, types, context)
        labels = flat(rtd_labels)
        l_rtd = rtd_loss(logits, labels, mask, mean_over_padding=cfg.rtd_mean_over_padding)
        with torch.no_grad():
            acc = rtd_accuracy(logits, labels, mask)
        return CRTDOutput(loss=l_cl + cfg.rtd_weight * l_rtd, contrastive_loss=l_cl, rtd_loss=l_rtd,
                          rtd_accuracy=acc, h=z)

    def training_step(self, batch: TrainBatch, step: int = 0, phase: str = "main") -> StepOutput:
        out = self(batch.input_ids, batch.attention_mask, batch.corrupted_ids, batch.rtd_labels)
        return StepOutput(out.loss, {"loss_contrastive": out.contrastive_loss.detach(), "loss_rtd": out.rtd_loss.detach(),
                                     "rtd_accuracy": out.rtd_accuracy})
