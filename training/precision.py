"""Frozen weights cast once: a low-precision copy of every frozen `nn.Linear` for the autocast training passes.

Autocast caches the low-precision copy of a weight only while the weight is a leaf that requires grad; a frozen
weight (the frozen PLM of D2CSE and DCPCSE, DCPCSE's LM head) is therefore cast again at every use: 288 of D2CSE's
861 copy kernels per step on BERT-base. `FrozenLinearCast` makes the copies once, when training starts, and swaps
them in for the training passes. The values are exactly those autocast computes (the same round-to-nearest cast of
the same fp32 tensor), and autocast runs every Linear in its low-precision type anyway, so the loss and every
gradient are bit-identical (tests/training/test_speed.py). Only `nn.Linear` weights and biases are cast: autocast
keeps embeddings and LayerNorm in fp32, and so does this.

The fp32 masters stay the module's parameters for everything else: evaluation (fp32 as the references evaluate),
checkpoints, exports and the backbone fingerprint. The trainer swaps them back around every evaluation and state
write (`Trainer`, training/loop.py); the copies are kept, so a compiled step sees the same tensors at every step.

Examples:
    >>> import torch
    >>> layer = torch.nn.Linear(4, 4).requires_grad_(False)
    >>> cast = FrozenLinearCast(layer, torch.bfloat16)
    >>> cast.low()
    >>> layer.weight.dtype
    torch.bfloat16
    >>> cast.master()
    >>> layer.weight.dtype
    torch.float32
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class FrozenLinearCast:
    """Low-precision copies of the frozen fp32 `nn.Linear` weights and biases of `model`, swapped in by `low()`.

    Args:
        model: the model; every `nn.Linear` whose weight or bias is a frozen fp32 parameter gets a copy.
        dtype: the autocast type (`torch.bfloat16` or `torch.float16`).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        # (module, parameter name, fp32 master, low-precision copy)
        self.entries: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        for module in model.modules():
            if not isinstance(module, nn.Linear):
                continue
            for name in ("weight", "bias"):
                p = module._parameters.get(name)
                if p is not None and not p.requires_grad and p.dtype == torch.float32:
                    copy = nn.Parameter(p.detach().to(dtype), requires_grad=False)
                    self.entries.append((module, name, p, copy))
        self.is_low = False

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def bytes(self) -> int:
        """Memory held by the copies."""
        return sum(c.numel() * c.element_size() for *_, c in self.entries)

    def low(self) -> None:
        """The training passes' weights: the low-precision copies."""
        if not self.is_low:
            for module, name, _, copy in self.entries:
                module._parameters[name] = copy
            self.is_low = True

    def master(self) -> None:
        """The fp32 masters (evaluation, checkpoints, exports)."""
        if self.is_low:
            for module, name, master, _ in self.entries:
                module._parameters[name] = master
            self.is_low = False

    @contextmanager
    def masters(self) -> Iterator[None]:
        """The fp32 masters while active; the previous choice afterwards."""
        was = self.is_low
        self.master()
        try:
            yield
        finally:
            if was:
                self.low()
