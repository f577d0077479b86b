"""Unpadded encoder passes: the real tokens of `(R, T)` rows packed into one `(1, N)` sequence at a fixed budget N.

Every token-wise part of a BERT-style layer (embeddings, Q/K/V and output projections, feed-forward, LayerNorm) runs
on the N packed slots only; the attention of each row is computed in the padded `(R, H, T, Dh)` layout, so each row's
tokens see their own tokens and their own prefix slots (the deep prompts, `PrefixKeyValues`, stay per row) and
nothing of another row: the variable-length attention of the packed sequence, in the layout the padded pass uses
(at T = 32 and a prefix of 16 the attention is ~1 % of a BERT-base layer's FLOPs; the token-wise parts are the rest).
The last hidden states go back to `(R, T, d)` with zeros at the positions not computed, so every pooler reads
each row's [CLS] (or [MASK]) position as in the padded pass.

The budget is fixed by the call's shape: `N = packed_budget(R, T, fill)` = ceil(fill · R · T) rounded up to a
multiple of 8 (at most R · T), so a compiled step keeps one shape (CUDA graphs stay). Slot i holds the i-th real
token in row-major order; the slots after the real tokens hold the first pad positions of the padded layout (their
states are those the padded pass computes there, and nothing reads them). More real tokens than N is an error (a
`ValueError` on the host; inside a compiled graph a device-side assert), never a silent truncation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PACKED_KWARG = "cse_packed"


def packed_budget(rows: int, length: int, fill: float) -> int:
    """The token slots of one packed pass over `(rows, length)` rows: ceil(fill · rows · length), rounded up to a
    multiple of 8, at most rows · length.

    Args:
        rows: the rows of the pass.
        length: their padded length.
        fill: the share of the padded positions the budget holds, in (0, 1].

    Examples:
        >>> from cse.models.prompts.packing import packed_budget
        >>> packed_budget(128, 32, 0.8), packed_budget(4, 3, 1.0)
        (3280, 12)
    """
    if not 0.0 < fill <= 1.0:
        raise ValueError(f"the unpadded fill must be in (0, 1], got {fill}")
    positions = rows * length
    return min(positions, math.ceil(math.ceil(fill * positions) / 8) * 8)


def packed_index(token_mask: torch.Tensor, fill: float) -> torch.Tensor:
    """`(N,)` flat positions into the `(R·T)` padded layout: the real tokens in row-major order, then pad positions.

    Computed from cumulative sums (no sort, no value read on the host but the overflow check on a CPU).

    Args:
        token_mask: `(R, T)`, 1 on real tokens.
        fill: the budget's share of the padded positions (`packed_budget`).

    Raises:
        ValueError: the rows hold more real tokens than the budget (on a CPU, outside a compiled graph; elsewhere a
            device-side assert stops the step).
    """
    rows, length = token_mask.shape
    budget = packed_budget(rows, length, fill)
    real = token_mask.reshape(-1).long()
    count = real.sum()
    pads = 1 - real
    slot = torch.where(real.bool(), real.cumsum(0) - real, count + pads.cumsum(0) - pads)
    positions = torch.arange(rows * length, device=token_mask.device)
    index = torch.empty_like(positions).scatter_(0, slot, positions)[:budget]
    if token_mask.device.type == "cpu" and not torch.compiler.is_compiling():
        if int(count) > budget:
            raise ValueError(
                f"the rows hold {int(count)} real tokens, more than the unpadded budget of {budget} slots "
                f"({rows} rows x {length} x fill {fill}): raise speed.unpadded_fill"
            )
    else:
        torch._assert_async(count <= budget, "real tokens beyond the unpadded budget: raise speed.unpadded_fill")
    return index


@dataclass(frozen=True)
class PackedRows:
    """One packed pass: `index` `(N,)` (flat positions of the slots in the `(R·T)` padded layout), the padded shape,
    and `attention_mask`, the padded layout's boolean SDPA mask `(R, 1, T, K)` (K = prefix slots + T) that the
    attention of every layer uses."""

    index: torch.Tensor
    rows: int
    length: int
    attention_mask: torch.Tensor

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """`(R, T, ...)` → `(1, N, ...)`: the packed slots' values."""
        return t.reshape(self.rows * self.length, *t.shape[2:]).index_select(0, self.index).unsqueeze(0)

    def scatter(self, t: torch.Tensor) -> torch.Tensor:
        """`(1, N, ...)` → `(R, T, ...)`: the slots back at their positions, zeros elsewhere (differentiable)."""
        flat = t.new_zeros(self.rows * self.length, *t.shape[2:]).index_copy(0, self.index, t[0])
        return flat.view(self.rows, self.length, *t.shape[2:])

    def first_positions(self) -> torch.Tensor:
        """`(1, N, 1)` bool: the slots at position 0 of their row (each row's [CLS])."""
        return (self.index % self.length == 0)[None, :, None]

    def slot_rows(self) -> torch.Tensor:
        """`(N,)` the row of every slot."""
        return torch.div(self.index, self.length, rounding_mode="floor")


@dataclass(frozen=True)
class PackedPosition0:
    """The position-0 input of a packed pass (DiffCSE step 5 / the CRTD conditioning): `values` `(1, N, d)` replaces
    the first layer's input where `first` `(1, N, 1)` is True."""

    first: torch.Tensor
    values: torch.Tensor


def heads_to_rows(packed: PackedRows, t: torch.Tensor) -> torch.Tensor:
    """Packed `(1, H, N, Dh)` queries/keys/values → padded `(R, H, T, Dh)` (zeros at the positions not computed)."""
    return packed.scatter(t.transpose(1, 2)).transpose(1, 2)


def rows_to_slots(packed: PackedRows, t: torch.Tensor) -> torch.Tensor:
    """An attention output in the padded `(R, T, H, Dh)` layout → the packed `(1, N, H, Dh)`."""
    return packed.gather(t)
