"""Alignment and uniformity (Wang & Isola, 2020) on L2-normalised embeddings (methods.md §7.3).

alignment = mean over positive pairs of ‖f(x) − f(y)‖^α (α = 2);
uniformity = log mean over all unordered distinct pairs of exp(−t‖f(x) − f(y)‖²) (t = 2).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _unit(x: Tensor) -> Tensor:
    x = torch.as_tensor(x, dtype=torch.float64)
    return torch.nn.functional.normalize(x, dim=-1)


def alignment(x: Tensor, y: Tensor, alpha: float = 2.0) -> float:
    """Mean ‖x̂ − ŷ‖^α over row pairs."""
    x, y = _unit(x), _unit(y)
    if x.shape != y.shape or x.shape[0] == 0:
        raise ValueError(f"alignment needs two non-empty [N, d] tensors of one shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    return float((x - y).norm(dim=1).pow(alpha).mean())


def uniformity(x: Tensor, t: float = 2.0) -> float:
    """log mean exp(−t‖x̂_i − x̂_j‖²) over i < j."""
    x = _unit(x)
    if x.shape[0] < 2:
        raise ValueError("uniformity needs at least 2 embeddings")
    return float(torch.pdist(x, p=2).pow(2).mul(-t).exp().mean().log())
