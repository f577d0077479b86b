"""Training objectives: in-batch contrastive loss (methods.md §1.2) and replaced-token detection (§4 steps 4–6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models import distributed


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

    Distributed training (torch.distributed initialised, world > 1): `z1`/`z2`/`z3` are the rank's slice; they are
    all-gathered (the local slice keeps its gradient) and every rank computes the loss of the global batch with
    global targets, so its backward gives the full gradient of its own rows (`models.distributed`).
    """
    if distributed.is_distributed():
        views = [z1, z2] if z3 is None else [z1, z2, z3]
        views = distributed.gather_with_local_grad(torch.stack(views, dim=1)).unbind(1)
        z1, z2, z3 = views[0], views[1], (views[2] if z3 is not None else None)
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
    Distributed training: the mean over the positions of the global batch (`models.distributed.global_mean`).
    """
    labels = labels.long() * attention_mask.long()
    per_token = F.cross_entropy(logits.reshape(-1, 2).float(), labels.reshape(-1), reduction="none")
    if mean_over_padding:
        if distributed.is_distributed():
            return distributed.global_mean(per_token.sum(), per_token.numel())
        return per_token.mean()
    keep = attention_mask.reshape(-1).to(per_token.dtype)
    if distributed.is_distributed():
        return distributed.global_mean((per_token * keep).sum(), keep.sum())
    return (per_token * keep).sum() / keep.sum().clamp_min(1.0)


def rtd_accuracy(logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Share of non-pad positions whose argmax matches the label (DiffCSE's `electra_acc`)."""
    keep = attention_mask.bool()
    correct = (logits.argmax(-1) == labels.long()) & keep
    if distributed.is_distributed():
        return distributed.global_ratio(correct.sum(), keep.sum())
    return correct.sum().float() / keep.sum().clamp_min(1).float()


def cross_entropy_mean(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), labels)` (mean over the labelled rows); no rows → a zero loss on the graph.

    Distributed training: the mean over the labelled rows of the global batch (`models.distributed.global_mean`),
    so a classification or MLM term (DiffAug's NLI CE, DCPCSE's MLM loss) equals the single-process one. Every rank
    must call it, also one without labelled rows.
    """
    if not distributed.is_distributed():
        if logits.shape[0] == 0:
            return logits.sum() * 0.0
        return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index)
    per_row = F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="none")
    return distributed.global_mean(per_row.sum(), (labels != ignore_index).sum())
