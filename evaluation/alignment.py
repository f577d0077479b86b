"""Alignment and uniformity on L2-normalised embeddings.

Reference: Tongzhou Wang, Phillip Isola (2020), *Understanding Contrastive Representation Learning through
Alignment and Uniformity on the Hypersphere*, ICML 2020; SimCSE (Gao et al., 2021) and D2CSE (Lee, 2023) report both.

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
    """Alignment: the mean ‖x̂ − ŷ‖^α over the row pairs of L2-normalised `x` and `y` (lower is better).

    Args:
        x: `[N, d]` embeddings of the first sentence of each positive pair.
        y: `[N, d]` embeddings of the second sentence.
        alpha: the exponent α (2 in the papers).

    Raises:
        ValueError: shapes differ or the tensors are empty.

    Examples:
        >>> import torch
        >>> from cse.evaluation.alignment import alignment
        >>> round(alignment(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 3.0]])), 6)  # unit vectors at 90 degrees
        2.0
    """
    x, y = _unit(x), _unit(y)
    if x.shape != y.shape or x.shape[0] == 0:
        raise ValueError(
            f"alignment needs two non-empty [N, d] tensors of one shape, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    return float((x - y).norm(dim=1).pow(alpha).mean())


def uniformity(x: Tensor, t: float = 2.0) -> float:
    """Uniformity: log mean exp(−t‖x̂_i − x̂_j‖²) over the distinct pairs i < j (lower is better).

    Args:
        x: `[N, d]` embeddings, N >= 2; they are L2-normalised first.
        t: the temperature t (2 in the papers).

    Raises:
        ValueError: fewer than 2 embeddings.

    Examples:
        >>> import torch
        >>> from cse.evaluation.alignment import uniformity
        >>> round(uniformity(torch.tensor([[1.0, 0.0], [-1.0, 0.0]])), 6)  # antipodal: exp(-2 * 4)
        -8.0
    """
    x = _unit(x)
    if x.shape[0] < 2:
        raise ValueError("uniformity needs at least 2 embeddings")
    return float(torch.pdist(x, p=2).pow(2).mul(-t).exp().mean().log())
