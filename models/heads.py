"""Trainable heads on top of the encoder: DiffCSE's BN-MLP, SimCSE's pooler MLP and the replaced-token-detection head."""

from __future__ import annotations

import torch
from torch import nn


class ProjectionMLP(nn.Module):
    """DiffCSE's BN-MLP, the projection D2CSE and DiffCSE train the contrastive vector `h` through.

    Linear(d, 2d, no bias) → BatchNorm1d(2d) → ReLU → Linear(2d, d, no bias) → BatchNorm1d(d, affine=False).
    Applied to the flattened `(B·n_sent, d)` CLS vectors, so the BatchNorm statistics cover all views together, as
    the reference code does. Linear weights N(0, init_std) as the references' `init_weights` leaves them; BatchNorm
    keeps PyTorch's init.

    Reference: Chuang et al. (2022), *DiffCSE: Difference-based Contrastive Learning for Sentence Embeddings*
    (`voidism/DiffCSE`, `ProjectionMLP`); Lee (2023), *D2CSE: Difference-aware Deep continuous prompts for
    Contrastive Sentence Embeddings*, reuses it.

    Args:
        hidden_size: d, the encoder's hidden size.
        init_std: standard deviation of the Linear weights' normal init.

    Examples:
        >>> import torch
        >>> from cse.models.heads import ProjectionMLP
        >>> mlp = ProjectionMLP(hidden_size=8)
        >>> mlp(torch.randn(6, 8)).shape
        torch.Size([6, 8])
    """

    def __init__(self, hidden_size: int, init_std: float = 0.02):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(hidden_size, 2 * hidden_size, bias=False),
            nn.BatchNorm1d(2 * hidden_size),
            nn.ReLU(),
            nn.Linear(2 * hidden_size, hidden_size, bias=False),
            nn.BatchNorm1d(hidden_size, affine=False),
        )
        for m in self.net:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SimCSEPoolerMLP(nn.Module):
    """SimCSE's `cls` pooler MLP: Linear(d, d) + tanh, N(0, init_std) weights and zero bias.

    SimCSE trains it on every sentence and, unsupervised, drops it at test time (`cls_before_pooler`); DCPCSE
    keeps SimCSE's design. Reference: Gao, Yao, Chen (2021), *SimCSE: Simple Contrastive Learning of Sentence
    Embeddings* (`princeton-nlp/SimCSE`, `MLPLayer`).

    Args:
        hidden_size: d, the encoder's hidden size.
        init_std: standard deviation of the weight's normal init.

    Examples:
        >>> import torch
        >>> from cse.models.heads import SimCSEPoolerMLP
        >>> out = SimCSEPoolerMLP(hidden_size=4)(torch.randn(2, 4))
        >>> out.shape, bool(out.abs().max() <= 1)
        (torch.Size([2, 4]), True)
    """

    def __init__(self, hidden_size: int, init_std: float = 0.02):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        nn.init.normal_(self.dense.weight, mean=0.0, std=init_std)
        nn.init.zeros_(self.dense.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class RTDHead(nn.Module):
    """The replaced-token-detection classifier Linear(d, 2) on the discriminator's token states.

    Created after the backbone, with PyTorch's default init, as DiffCSE's `electra_head` (`voidism/DiffCSE`).
    Its logits feed `cse.models.losses.rtd_loss`. Reference: Chuang et al. (2022), *DiffCSE*; Lee (2023), *D2CSE*.

    Args:
        hidden_size: d, the discriminator's hidden size.

    Examples:
        >>> import torch
        >>> from cse.models.heads import RTDHead
        >>> RTDHead(hidden_size=8)(torch.randn(2, 5, 8)).shape
        torch.Size([2, 5, 2])
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.classifier = nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.classifier(hidden_states)
