"""`PeftPlan`: how one checkpoint maps onto a PEFT prefix-tuning adapter, filled in by
`cse.models.export.peft_export.adapter_plan` and the model class's `peft_plan` hook. Its own module (torch only), so
the method classes name it without importing the export code that loads checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class PeftPlan:
    """How one checkpoint maps onto PEFT, built by `adapter_plan` and the model class's `peft_plan`.

    Args:
        pooling: how `peft_embed.py` reads the embedding: `{"kind": "cls"}`, `{"kind": "pooler_output"}` or
            `{"kind": "mask", "template": ..., "mask_token_id": ...}`.
        modules_to_save: base-model modules PEFT carries in the adapter (`modules_to_save`).
        notes: `"<code>: <sentence>"` lines for the adapter's README and the model card.
        inexact: notes on what the adapter cannot reproduce (the export refuses unless `allow_inexact=True`).
        cls_fold: `(position row, [CLS] id)`: a [CLS] prompt folded into that position-embedding row.
        pooler_mlp: a module with a `dense` Linear carried as the base model's pooler.
    """

    pooling: dict[str, Any]
    modules_to_save: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    inexact: list[str] = field(default_factory=list)
    cls_fold: tuple[int, int] | None = None  # (position row, [CLS] id)
    pooler_mlp: nn.Module | None = None
