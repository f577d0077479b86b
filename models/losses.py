"""Training objectives: in-batch contrastive loss (methods.md §1.2) and replaced-token detection (§4 steps 4–6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cosine_logits(a: torch.Tensor, b: torch.Tensor, temperature: float) -> torch.Tensor:
    """`S[i, j] = cos(a_i, b_j) / τ`, computed in float32 (eps 1e-8 as nn.CosineSimilarity)."""
    return F.cosine_similarity(a.float().unsqueeze(1), b.float().unsqueeze(0), dim=-1, eps=1e-8) / temperature


def contrastive_loss(
    z1: torch.Tensor,
    z2: torch.Tensor,
    z3: torch.Tensor | None = None,
    temperature: float = 0.05,
    hard_negative_weight: float = 0.0,
) -> torch.Tensor:
    """Mean cross-entropy of `z1_i` against target `z2_i` (§1.2).

    Unsupervised: logits `B×B`. Supervised (`z3` = hard negatives): `B×2B`, every hard negative of the batch is
    a negative for every anchor; `hard_negative_weight` is added to the logit at `(i, B+i)` only (0 = weight 1).
    """
    logits = cosine_logits(z1, z2, temperature)
    if z3 is not None:
        hard = cosine_logits(z1, z3, temperature)
        if hard_negative_weight != 0.0:
            hard = hard + hard_negative_weight * torch.eye(hard.shape[0], hard.shape[1], device=hard.device, dtype=hard.dtype)
        logits = torch.cat([logits, hard], dim=1)
    targets = torch.arange(logits.shape[0], device=logits.device)
    return F.cross_entropy(logits, targets)


def rtd_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor,
    mean_over_padding: bool = True,
) -> torch.Tensor:
    """2-class cross-entropy of `(N, T, 2)` logits against `(N, T)` labels (1 = replaced) (§4 step 6, §10.2).

    Reference (DiffCSE code): mean over all N·T positions, padding included (pads carry label 0).
    `mean_over_padding=False`: mean over non-pad positions only.
    """
    labels = labels.long() * attention_mask.long()
    per_token = F.cross_entropy(logits.reshape(-1, 2).float(), labels.reshape(-1), reduction="none")
    if mean_over_padding:
        return per_token.mean()
    keep = attention_mask.reshape(-1).to(per_token.dtype)
    return (per_token * keep).sum() / keep.sum().clamp_min(1.0)


def rtd_accuracy(logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Share of non-pad positions whose argmax matches the label (DiffCSE's `electra_acc`)."""
    keep = attention_mask.bool()
    correct = (logits.argmax(-1) == labels.long()) & keep
    return correct.sum().float() / keep.sum().clamp_min(1).float()
