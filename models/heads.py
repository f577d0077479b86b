"""Trainable heads on top of the frozen encoder (methods.md §1.3, §4, §5)."""

from __future__ import annotations

import torch
from torch import nn


class ProjectionMLP(nn.Module):
    """DiffCSE's BN-MLP (§1.3): Linear(d, 2d, no bias) → BatchNorm1d(2d) → ReLU → Linear(2d, d, no bias) →
    BatchNorm1d(d, affine=False). Applied to the flattened `(B·n_sent, d)` CLS vectors, so the BatchNorm
    statistics cover all views together (§10.4). Linear weights N(0, init_std) as the references'
    `init_weights` leaves them; BatchNorm keeps PyTorch's init.
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
    """SimCSE's `cls` pooler MLP (§1.3): Linear(d, d) + tanh, N(0, init_std) weights and zero bias."""

    def __init__(self, hidden_size: int, init_std: float = 0.02):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        nn.init.normal_(self.dense.weight, mean=0.0, std=init_std)
        nn.init.zeros_(self.dense.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class RTDHead(nn.Module):
    """Replaced-token-detection classifier Linear(d, 2) on the discriminator's token states (§4, §10.25).

    Created after the backbone, with PyTorch's default init, as DiffCSE's `electra_head`.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.classifier = nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.classifier(hidden_states)
