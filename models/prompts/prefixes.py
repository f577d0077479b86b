"""The trainable key/value prefixes (`PrefixEncoder`, the P-tuning v2 layout of YJiangcm/DCPCSE), one sample of them
(`PrefixKeyValues`), and the attention-mask columns a prefix adds (shared by both injection routes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PrefixKeyValues:
    """One sample of prefix keys/values: per layer `(key, value)`, each `(B', H, P, Dh)`.

    `mask` is an optional `(B', P)` (or `(P,)`) visibility mask, 1 = visible; None = all visible (DCPCSE reference prefixes step 5).
    """

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.layers[0][0].shape[0]

    def with_mask(self, mask: torch.Tensor | None) -> PrefixKeyValues:
        return PrefixKeyValues(self.layers, mask)


class PrefixEncoder(nn.Module):
    """Trainable key/value prefixes for every layer (the P-tuning v2 layout of YJiangcm/DCPCSE).

    Without reparametrisation: one table `P × (2·L·d)`. With it: `P × d` → Linear(d, h_p) → tanh →
    Linear(h_p, 2·L·d). Weights N(0, init_std), biases 0. Dropout (p = hidden dropout 0.1) acts on the
    `(B', P, 2L, H, Dh)` tensor, independently per row, in train mode only. Flat layout of one prefix
    position: `[k_0 | v_0 | k_1 | v_1 | …]`, each block head-major (H × Dh).
    """

    def __init__(
        self,
        prefix_len: int,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        dropout: float = 0.1,
        projection: bool = False,
        projection_hidden: int = 512,
        init_std: float = 0.02,
    ):
        super().__init__()
        if prefix_len < 1:
            raise ValueError(f"prefix_len must be >= 1, got {prefix_len}")
        if hidden_size % num_heads != 0:
            raise ValueError(f"hidden size {hidden_size} is not a multiple of the head count {num_heads}")
        self.prefix_len, self.num_layers, self.hidden_size, self.num_heads = (
            prefix_len,
            num_layers,
            hidden_size,
            num_heads,
        )
        self.head_dim = hidden_size // num_heads
        width = 2 * num_layers * hidden_size
        self.register_buffer("prefix_ids", torch.arange(prefix_len), persistent=False)
        if projection:
            self.embedding = nn.Embedding(prefix_len, hidden_size)
            self.transform: nn.Sequential | None = nn.Sequential(
                nn.Linear(hidden_size, projection_hidden), nn.Tanh(), nn.Linear(projection_hidden, width)
            )
        else:
            self.embedding = nn.Embedding(prefix_len, width)
            self.transform = None
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters(init_std)

    def reset_parameters(self, std: float) -> None:
        """N(0, std) weights and zero biases, as the backbone's `_init_weights` gives them in the references."""
        nn.init.normal_(self.embedding.weight, mean=0.0, std=std)
        if self.transform is not None:
            for m in self.transform:
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, mean=0.0, std=std)
                    nn.init.zeros_(m.bias)

    def rows(self) -> torch.Tensor:
        """The `(P, 2·L·d)` prefix matrix before dropout (the projection is row-wise, so it runs on P rows)."""
        x = self.embedding(self.prefix_ids)
        return self.transform(x) if self.transform is not None else x

    def forward(self, batch_size: int, mask: torch.Tensor | None = None) -> PrefixKeyValues:
        """Steps 1–3 of DCPCSE reference prefixes: expand to `B'` rows, reshape, dropout, permute to `(2L, B', H, P, Dh)`, pair up."""
        # dropout on the `(B', P, 2·L·d)` rows, then the reshape: the same elements in the same order as dropping out
        # the 5-D view, and the backward's reshape then precedes dropout's (a compiled backward mis-strided the reverse)
        x = self.dropout(self.rows().unsqueeze(0).expand(batch_size, -1, -1))
        x = x.view(batch_size, self.prefix_len, 2 * self.num_layers, self.num_heads, self.head_dim)
        device = x.device.type  # (meta, the dry run's shape-only pass, has no autocast state to ask for)
        if device != "meta" and torch.is_autocast_enabled(device):  # one cast, not one per layer and K/V (same values)
            x = x.to(torch.get_autocast_dtype(device))
        kv = x.permute(2, 0, 3, 1, 4).unbind(0)  # unbind: one backward, no zero-filled tensor per slot
        return PrefixKeyValues(tuple((kv[2 * i], kv[2 * i + 1]) for i in range(self.num_layers)), mask)


def prefix_visibility(prefix: PrefixKeyValues, batch: int, device: torch.device) -> torch.Tensor:
    """`(B', P)` bool: which prefix slots the tokens may attend to (DCPCSE reference prefixes step 5)."""
    if prefix.mask is None:
        return torch.ones(batch, prefix.length, dtype=torch.bool, device=device)
    return prefix.mask.to(device=device, dtype=torch.bool).expand(batch, prefix.length)


def extend_mask(
    mask: torch.Tensor | None, prefix: PrefixKeyValues, query: torch.Tensor, boolean: bool
) -> torch.Tensor | None:
    """A mask over the T token keys (None, bool, or additive float; `(b, h, T, T)` with b ∈ {1, B'}, h ∈ {1, H})
    with the P prefix columns put in front: visible slots True / 0, hidden slots False / −inf. −inf rather than
    `finfo.min`: with an additive mask, a query row whose token keys are all masked attends exactly as in the plain
    model. `boolean` says the format when `mask` is None; None stays None when every slot is visible."""
    if mask is None and prefix.mask is None:
        return None
    batch, _, length, _ = query.shape
    visible = prefix_visibility(prefix, batch, query.device)[:, None, None, :]
    if mask is None:
        mask = (
            torch.ones(1, 1, length, length, dtype=torch.bool, device=query.device)
            if boolean
            else torch.zeros(1, 1, length, length, dtype=query.dtype, device=query.device)
        )
    if mask.dtype == torch.bool:
        columns = visible
    else:
        columns = torch.zeros(visible.shape, dtype=mask.dtype, device=mask.device).masked_fill(~visible, float("-inf"))
    lead = (max(mask.shape[0], batch), mask.shape[1])
    return torch.cat([columns.expand(*lead, length, prefix.length), mask.expand(*lead, length, mask.shape[-1])], dim=-1)
