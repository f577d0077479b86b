"""The "module" route (MPNet, DeBERTa-v2/v3, whose attention is their own code): each self-attention module's class is
swapped for a prefix-aware subclass (same parameters and state-dict names), and the prefix reaches it through a
context variable set only for the duration of `PromptedBackbone.forward` (`prefix_scope`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn
from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention, scaled_size_sqrt
from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

from cse.models.prompts.prefixes import PrefixKeyValues, extend_mask, prefix_visibility

# The "module" route: the prefix of the running `PromptedBackbone.forward`, per attention module (by identity).
_ScopedLayer = tuple[torch.Tensor, torch.Tensor, PrefixKeyValues]
_SCOPE: ContextVar[dict[int, _ScopedLayer] | None] = ContextVar("cse_prefix_scope", default=None)


@contextmanager
def prefix_scope(modules: list[nn.Module], prefix: PrefixKeyValues | None) -> Iterator[None]:
    """While active, `modules[i]` (swapped attention modules) attend to `prefix.layers[i]`; reset on exit."""
    if prefix is None:
        yield
        return
    token = _SCOPE.set({id(m): (k, v, prefix) for m, (k, v) in zip(modules, prefix.layers)})
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _scoped_prefix(module: nn.Module) -> _ScopedLayer | None:
    scope = _SCOPE.get()
    return None if scope is None else scope.get(id(module))


class PrefixMPNetSelfAttention(MPNetSelfAttention):
    """MPNet self-attention that also attends to a prefix: `[k_p; k]`, `[v_p; v]`, relative position bias 0 on the
    prefix columns (a slot has no position), the model's additive mask extended by the prefix visibility. Without a
    prefix in scope it is `MPNetSelfAttention`."""

    def forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
        scoped = _scoped_prefix(self)
        if scoped is None:
            return super().forward(
                hidden_states, attention_mask, position_bias, output_attentions=output_attentions, **kwargs
            )
        k_p, v_p, prefix = scoped
        shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
        q = self.q(hidden_states).view(shape).transpose(1, 2)
        k = torch.cat([k_p.to(q.dtype), self.k(hidden_states).view(shape).transpose(1, 2)], dim=2)
        v = torch.cat([v_p.to(q.dtype), self.v(hidden_states).view(shape).transpose(1, 2)], dim=2)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        if position_bias is not None:
            scores = scores + nn.functional.pad(position_bias, (prefix.length, 0))
        mask = extend_mask(attention_mask, prefix, q, boolean=False)
        if mask is not None:
            scores = scores + mask
        probs = self.dropout(nn.functional.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(*hidden_states.shape[:-1], self.all_head_size)
        out = self.o(context)
        return (out, probs) if output_attentions else (out,)


class PrefixDisentangledSelfAttention(DisentangledSelfAttention):
    """DeBERTa-v2/v3 disentangled self-attention that also attends to a prefix. Token↔token logits are DeBERTa's
    (c2c + c2p + p2c); a prefix slot's logit is content→content only, `q·k_p / sqrt(d_h·s)`. Prefix columns are
    visible to the query rows DeBERTa lets see any token (padded rows see none, as in the plain model). Without a
    prefix in scope it is `DisentangledSelfAttention`."""

    def forward(
        self,
        hidden_states,
        attention_mask,
        output_attentions=False,
        query_states=None,
        relative_pos=None,
        rel_embeddings=None,
    ):
        scoped = _scoped_prefix(self)
        if scoped is None:
            return super().forward(
                hidden_states,
                attention_mask,
                output_attentions,
                query_states=query_states,
                relative_pos=relative_pos,
                rel_embeddings=rel_embeddings,
            )
        k_p, v_p, prefix = scoped
        heads = self.num_attention_heads
        query = self.transpose_for_scores(
            self.query_proj(hidden_states if query_states is None else query_states), heads
        )
        key = self.transpose_for_scores(self.key_proj(hidden_states), heads)
        value = self.transpose_for_scores(self.value_proj(hidden_states), heads)
        scale_factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
        scale = scaled_size_sqrt(query, scale_factor).to(dtype=query.dtype)
        scores = torch.bmm(query, key.transpose(-1, -2) / scale)
        if self.relative_attention:
            scores = scores + self.disentangled_attention_bias(
                query, key, relative_pos, self.pos_dropout(rel_embeddings), scale_factor
            )
        rows, length, head_dim = query.shape
        k_p = k_p.to(key.dtype).reshape(rows, prefix.length, head_dim)
        v_p = v_p.to(value.dtype).reshape(rows, prefix.length, head_dim)
        prefix_scores = torch.bmm(query, k_p.transpose(-1, -2) / scale)

        token_visible = attention_mask.bool()  # (B', 1, T, T): DeBERTa's query-and-key padding product
        slot_visible = (
            token_visible.any(-1, keepdim=True)
            & prefix_visibility(prefix, token_visible.shape[0], query.device)[:, None, None, :]
        )
        scores = scores.view(-1, heads, length, key.shape[1]).masked_fill(~token_visible, torch.finfo(query.dtype).min)
        prefix_scores = prefix_scores.view(-1, heads, length, prefix.length).masked_fill(~slot_visible, float("-inf"))
        probs = self.dropout(nn.functional.softmax(torch.cat([prefix_scores, scores], dim=-1), dim=-1))
        context = torch.bmm(probs.view(rows, length, -1), torch.cat([v_p, value], dim=1))
        context = context.view(-1, heads, length, head_dim).permute(0, 2, 1, 3).reshape(-1, length, heads * head_dim)
        return (context, probs if output_attentions else None)


MODULE_ROUTE: dict[type, type] = {
    MPNetSelfAttention: PrefixMPNetSelfAttention,
    DisentangledSelfAttention: PrefixDisentangledSelfAttention,
}
