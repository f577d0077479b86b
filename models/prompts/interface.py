"""The "interface" route (BERT, RoBERTa, XLM-RoBERTa, ELECTRA, DistilBERT, ModernBERT): attention functions
registered in transformers' `AttentionInterface` as `cse_prefix_sdpa` / `cse_prefix_eager` (at import) that prepend
the layer's prefix K/V, handed to them as the `cse_prefix` keyword argument of one forward call. A packed pass
(`cse.models.prompts.packing`, the `cse_packed` keyword argument) has its packed queries, keys and values put back in
the padded layout for the attention, and its output packed again."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import eager_attention_forward as _bert_eager_attention

from cse.models.prompts.packing import PACKED_KWARG, PackedRows, heads_to_rows, rows_to_slots
from cse.models.prompts.prefixes import PrefixKeyValues, extend_mask

PREFIX_KWARG = "cse_prefix"
PREFIX_IMPLEMENTATIONS = {"sdpa": "cse_prefix_sdpa", "eager": "cse_prefix_eager"}


def _eager_attention(module: nn.Module) -> Callable[..., Any]:
    """The eager attention function of the module's own family (BERT's for the BERT-style families)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", _bert_eager_attention)


def _prefix_attention(inner: str) -> Callable[..., Any]:
    """An attention function that prepends this layer's prefix K/V (DCPCSE reference prefixes step 4), then runs `inner`.

    A mask that covers only the token keys (ModernBERT's own global / sliding-window masks, or none) gets the
    prefix columns in front; the BERT-style families receive the `(B', 1, T, P+T)` mask `PromptedBackbone` built.
    A packed pass (`cse_packed`) brings its own padded-layout mask (prefix columns included); its `(1, H, N, Dh)`
    inputs are put in the `(R, H, T, Dh)` layout and the output taken back to the N slots.
    """

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> Any:
        prefix: PrefixKeyValues | None = kwargs.pop(PREFIX_KWARG, None)
        packed: PackedRows | None = kwargs.pop(PACKED_KWARG, None)
        fn = ALL_ATTENTION_FUNCTIONS["sdpa"] if inner == "sdpa" else _eager_attention(module)
        if packed is not None:
            query, key, value = (heads_to_rows(packed, t) for t in (query, key, value))
            if prefix is not None:
                k_p, v_p = prefix.layers[cast(int, module.layer_idx)]
                key = torch.cat([k_p.to(key.dtype), key], dim=2)
                value = torch.cat([v_p.to(value.dtype), value], dim=2)
            out, weights = fn(module, query, key, value, packed.attention_mask, **kwargs)
            return rows_to_slots(packed, out), weights
        if prefix is not None:
            k_p, v_p = prefix.layers[cast(int, module.layer_idx)]  # an int: set on every module (PromptedBackbone)
            if attention_mask is None or attention_mask.shape[-1] == key.shape[2]:
                attention_mask = extend_mask(attention_mask, prefix, query, boolean=inner == "sdpa")
            key = torch.cat([k_p.to(key.dtype), key], dim=2)
            value = torch.cat([v_p.to(value.dtype), value], dim=2)
        return fn(module, query, key, value, attention_mask, **kwargs)

    return attention


for _inner, _name in PREFIX_IMPLEMENTATIONS.items():
    AttentionInterface.register(_name, _prefix_attention(_inner))
    AttentionMaskInterface.register(_name, sdpa_mask if _inner == "sdpa" else eager_mask)
