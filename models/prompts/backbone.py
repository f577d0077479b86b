"""Deep continuous prompts (P-tuning v2 prefixes) on a frozen HF encoder (YJiangcm/DCPCSE), on eight encoder families.

`PrefixEncoder` holds the trainable key/value prefixes; `PromptedBackbone` runs a Hugging Face encoder
with those prefixes prepended to every self-attention layer's keys and values.

Injection (transformers 5.x, where tuples as `past_key_values` are gone; see docs/methods-overview.md). The
family of the backbone (`EncoderFamily`, looked up from `config.model_type` by `encoder_family`) says which of two
routes its attention takes:

- **interface** (BERT, RoBERTa, XLM-RoBERTa, ELECTRA, DistilBERT, ModernBERT): the attention code calls
  transformers' `AttentionInterface`. The backbone's attention implementation is switched to `cse_prefix_sdpa` /
  `cse_prefix_eager`, registered below. The prefix tensors of one forward call travel as the keyword argument
  `cse_prefix` (transformers forwards extra model kwargs down to the attention function), so the wrapped model
  keeps no per-call state and two sequential passes cannot see each other's prefixes. The attention function
  concatenates the layer's prefix K/V in front of the token K/V and calls the stock sdpa function or the family's
  own eager function. For the BERT-style families the `(B', 1, T, P+T)` mask is built once per call by
  `PromptedBackbone` and handed to the model as a 4-D mask, which transformers passes through unchanged. ModernBERT
  builds two masks of its own (global and sliding-window layers), so it gets the 2-D token mask as usual and the
  attention function prepends the prefix columns to whichever mask the layer receives.
- **module** (MPNet, DeBERTa-v2/v3): the attention is the family's own code (MPNet's relative position bias,
  DeBERTa's disentangled attention) and no kwargs reach it. Each self-attention module's class is swapped for a
  prefix-aware subclass (same parameters and state-dict names; without a prefix it runs the parent's forward), and
  the prefix reaches it through a context variable set only for the duration of `PromptedBackbone.forward`.

What the prefix slots are, per family (the choices a relative-position or rotary encoder forces):

- absolute-position families (BERT, RoBERTa, XLM-RoBERTa, ELECTRA, DistilBERT): prefix K/V carry no position (as
  in the references: position embeddings are added to token inputs only);
- MPNet: the relative position bias of a prefix slot is 0 (the slot has no position); token↔token bias unchanged;
- DeBERTa-v2/v3: a prefix slot's logit is the content→content term only, `q·k_p / sqrt(d_h · s)` with the layer's
  own scale factor `s = 1 + |pos_att_type|`; c2p and p2c need a relative distance a positionless slot lacks. Padded
  query rows (which DeBERTa lets see no token) see no prefix slot either: they attend as in the plain model;
- ModernBERT: prefix keys are used as given, i.e. unrotated (post-RoPE space; a fixed rotation would only
  reparametrise a free parameter), and are visible to every token in global and sliding-window (local) layers alike.

`shift_positions` (the HF 4.x quirk, DCPCSE reference prefixes: token positions continue after a P-long past) means, per family:
BERT/ELECTRA/DistilBERT absolute positions `P … P+T-1`; RoBERTa/XLM-RoBERTa/MPNet padding-aware positions from
`padding_idx + 1 + P` (MPNet's relative bias among tokens is unchanged); DeBERTa-v2 with `position_biased_input`
absolute positions `P …`, DeBERTa-v3 (no absolute positions) nothing — no shift is possible, the flag is a no-op;
ModernBERT rotary positions `P … P+T-1` (as an HF decoder continuing a P-long cache; equivalent to rotating every
prefix key by −P). Without a prefix the wrapped model is exactly the plain model (mask creation is registered for
the new implementation names as well).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import eager_attention_forward as _bert_eager_attention
from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention, scaled_size_sqrt
from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

PREFIX_KWARG = "cse_prefix"
POSITION0_KWARG = "cse_position0"
_PREFIX_IMPLEMENTATIONS = {"sdpa": "cse_prefix_sdpa", "eager": "cse_prefix_eager"}


# ============================================================================================== encoder families
@dataclass(frozen=True)
class EncoderFamily:
    """How deep prompts reach one HF encoder family (the per-family choices are in the module docstring).

    `layers`: dotted path of the layer list on the bare model; `attention`: dotted path of the self-attention module
    inside one layer ("" = the first submodule with `layer_idx` and `query`, the BERT layout); `injection`:
    "interface" (prefix as the `cse_prefix` kwarg of transformers' attention functions) or "module" (own attention
    code, class swapped for a prefix-aware subclass); `positions`: "absolute" (`offset … offset+T-1`), "padding"
    (RoBERTa's padding-aware numbering from `padding_idx + 1 + offset`) or "rotary" (RoPE angles `offset …`);
    `prebuilt_mask`: the `(B', 1, T, P+T)` mask is built by `PromptedBackbone` (else the attention extends the
    family's own mask with the prefix columns); `token_types`: the model takes `token_type_ids`; `layer_kwargs`: the
    family's encoder hands the model's extra keyword arguments to every layer, so position-0 vectors reach the first
    layer as the `cse_position0` argument (else, DeBERTa-v2/v3, a forward hook on the embeddings replaces them).
    """

    name: str
    layers: str
    attention: str
    injection: str
    positions: str
    prebuilt_mask: bool
    token_types: bool
    layer_kwargs: bool = True

    def position_kind(self, config) -> str:
        """`positions`, or "none" for DeBERTa-v2/v3 without absolute position embeddings (`position_biased_input`)."""
        if self.positions == "absolute" and not getattr(config, "position_biased_input", True):
            return "none"
        return self.positions


_BERT_LIKE = dict(
    layers="encoder.layer", attention="attention.self", injection="interface", prebuilt_mask=True, token_types=True
)
ENCODER_FAMILIES: dict[str, EncoderFamily] = {
    "bert": EncoderFamily("BERT", positions="absolute", **_BERT_LIKE),
    "roberta": EncoderFamily("RoBERTa", positions="padding", **_BERT_LIKE),
    "xlm-roberta": EncoderFamily("XLM-RoBERTa", positions="padding", **_BERT_LIKE),
    "electra": EncoderFamily("ELECTRA", positions="absolute", **_BERT_LIKE),
    "distilbert": EncoderFamily(
        "DistilBERT",
        layers="transformer.layer",
        attention="attention",
        injection="interface",
        positions="absolute",
        prebuilt_mask=True,
        token_types=False,
    ),
    "mpnet": EncoderFamily(
        "MPNet",
        layers="encoder.layer",
        attention="attention.attn",
        injection="module",
        positions="padding",
        prebuilt_mask=False,
        token_types=False,
        layer_kwargs=False,  # MPNetModel calls its encoder without the model's kwargs
    ),
    "deberta-v2": EncoderFamily(
        "DeBERTa-v2/v3",
        layers="encoder.layer",
        attention="attention.self",
        injection="module",
        positions="absolute",
        prebuilt_mask=False,
        token_types=True,
        layer_kwargs=False,  # its encoder calls the layers without the model's kwargs
    ),
    "modernbert": EncoderFamily(
        "ModernBERT",
        layers="layers",
        attention="attn",
        injection="interface",
        positions="rotary",
        prebuilt_mask=False,
        token_types=False,
    ),
}
"""Supported `config.model_type`s. Another model type with the BERT layout (embeddings + `encoder.layer`, attention
modules with `layer_idx` and `query` that call the `AttentionInterface`, e.g. CamemBERT) runs as "BERT-like"."""


def _path(module: nn.Module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def _bert_layout_attention(layer: nn.Module) -> nn.Module | None:
    return next((m for m in layer.modules() if hasattr(m, "layer_idx") and hasattr(m, "query")), None)


def encoder_family(backbone: nn.Module) -> EncoderFamily:
    """The `EncoderFamily` of a bare HF encoder; `TypeError` naming the architecture if prompts cannot reach it."""
    model_type = getattr(getattr(backbone, "config", None), "model_type", None)
    family = ENCODER_FAMILIES.get(model_type)
    if family is not None:
        return family
    layers = getattr(getattr(backbone, "encoder", None), "layer", None)
    if (
        hasattr(backbone, "embeddings")
        and layers is not None
        and len(layers)
        and all(_bert_layout_attention(layer) is not None for layer in layers)
    ):
        emb = backbone.embeddings
        return EncoderFamily(
            f"BERT-like ({model_type})",
            positions="padding" if hasattr(emb, "create_position_ids_from_input_ids") else "absolute",
            **{**_BERT_LIKE, "attention": ""},
        )
    supported = ", ".join(f.name for f in ENCODER_FAMILIES.values())
    raise TypeError(
        f"{type(backbone).__name__} (model_type {model_type!r}) is not an encoder family that deep prompts support "
        f"({supported}, or another model type with the BERT layout): its attention code has no place where prefix "
        "keys/values can be prepended here"
    )


def encoder_layers(backbone: nn.Module) -> nn.ModuleList:
    """The transformer layers of a supported bare encoder (`encoder.layer`, DistilBERT's `transformer.layer`,
    ModernBERT's `layers`)."""
    return _path(backbone, encoder_family(backbone).layers)


def _attention_of(family: EncoderFamily, layer: nn.Module) -> nn.Module:
    found = _bert_layout_attention(layer) if family.attention == "" else _path(layer, family.attention)
    if found is None:
        raise TypeError(f"{family.name}: no self-attention module with `layer_idx` found in layer {layer!r}")
    return found


# ============================================================================================== prefixes
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
            self.transform = nn.Sequential(
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
        device = x.device.type
        if torch.is_autocast_enabled(device):  # one cast of the sample, not one per layer and K/V (same values)
            x = x.to(torch.get_autocast_dtype(device))
        kv = x.permute(2, 0, 3, 1, 4).unbind(0)  # unbind: one backward, no zero-filled tensor per slot
        return PrefixKeyValues(tuple((kv[2 * i], kv[2 * i + 1]) for i in range(self.num_layers)), mask)


# ============================================================================================== injection
def _prefix_visibility(prefix: PrefixKeyValues, batch: int, device: torch.device) -> torch.Tensor:
    """`(B', P)` bool: which prefix slots the tokens may attend to (DCPCSE reference prefixes step 5)."""
    if prefix.mask is None:
        return torch.ones(batch, prefix.length, dtype=torch.bool, device=device)
    return prefix.mask.to(device=device, dtype=torch.bool).expand(batch, prefix.length)


def _extend_mask(
    mask: torch.Tensor | None, prefix: PrefixKeyValues, query: torch.Tensor, boolean: bool
) -> torch.Tensor | None:
    """A mask over the T token keys (None, bool, or additive float; `(b, h, T, T)` with b ∈ {1, B'}, h ∈ {1, H})
    with the P prefix columns put in front: visible slots True / 0, hidden slots False / −inf. −inf rather than
    `finfo.min`: with an additive mask, a query row whose token keys are all masked attends exactly as in the plain
    model. `boolean` says the format when `mask` is None; None stays None when every slot is visible."""
    if mask is None and prefix.mask is None:
        return None
    batch, _, length, _ = query.shape
    visible = _prefix_visibility(prefix, batch, query.device)[:, None, None, :]
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


def _eager_attention(module: nn.Module):
    """The eager attention function of the module's own family (BERT's for the BERT-style families)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", _bert_eager_attention)


def _prefix_attention(inner: str):
    """An attention function that prepends this layer's prefix K/V (DCPCSE reference prefixes step 4), then runs `inner`.

    A mask that covers only the token keys (ModernBERT's own global / sliding-window masks, or none) gets the
    prefix columns in front; the BERT-style families receive the `(B', 1, T, P+T)` mask `PromptedBackbone` built.
    """

    def attention(module, query, key, value, attention_mask, **kwargs):
        prefix: PrefixKeyValues | None = kwargs.pop(PREFIX_KWARG, None)
        if prefix is not None:
            k_p, v_p = prefix.layers[module.layer_idx]
            if attention_mask is None or attention_mask.shape[-1] == key.shape[2]:
                attention_mask = _extend_mask(attention_mask, prefix, query, boolean=inner == "sdpa")
            key = torch.cat([k_p.to(key.dtype), key], dim=2)
            value = torch.cat([v_p.to(value.dtype), value], dim=2)
        fn = ALL_ATTENTION_FUNCTIONS["sdpa"] if inner == "sdpa" else _eager_attention(module)
        return fn(module, query, key, value, attention_mask, **kwargs)

    return attention


for _inner, _name in _PREFIX_IMPLEMENTATIONS.items():
    AttentionInterface.register(_name, _prefix_attention(_inner))
    AttentionMaskInterface.register(_name, sdpa_mask if _inner == "sdpa" else eager_mask)


# The "module" route: the prefix of the running `PromptedBackbone.forward`, per attention module (by identity).
_ScopedLayer = tuple[torch.Tensor, torch.Tensor, PrefixKeyValues]
_SCOPE: ContextVar[dict[int, _ScopedLayer] | None] = ContextVar("cse_prefix_scope", default=None)


@contextmanager
def _prefix_scope(modules: list[nn.Module], prefix: PrefixKeyValues | None) -> Iterator[None]:
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
        mask = _extend_mask(attention_mask, prefix, q, boolean=False)
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
            & _prefix_visibility(prefix, token_visible.shape[0], query.device)[:, None, None, :]
        )
        scores = scores.view(-1, heads, length, key.shape[1]).masked_fill(~token_visible, torch.finfo(query.dtype).min)
        prefix_scores = prefix_scores.view(-1, heads, length, prefix.length).masked_fill(~slot_visible, float("-inf"))
        probs = self.dropout(nn.functional.softmax(torch.cat([prefix_scores, scores], dim=-1), dim=-1))
        context = torch.bmm(probs.view(rows, length, -1), torch.cat([v_p, value], dim=1))
        context = context.view(-1, heads, length, head_dim).permute(0, 2, 1, 3).reshape(-1, length, heads * head_dim)
        return (context, probs if output_attentions else None)


_MODULE_ROUTE: dict[type, type] = {
    MPNetSelfAttention: PrefixMPNetSelfAttention,
    DisentangledSelfAttention: PrefixDisentangledSelfAttention,
}


def _with_position0(hidden_states: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """`hidden_states` `(B', T, d)` with position 0 replaced by `vectors` `(B', d)` (DiffCSE step 5)."""
    return torch.cat([vectors.unsqueeze(1).to(hidden_states.dtype), hidden_states[:, 1:]], dim=1)


class _Position0Input:
    """Mixed into the class of every encoder layer of a `PromptedBackbone` whose family passes the model's kwargs to
    its layers (`EncoderFamily.layer_kwargs`): the layer takes the `cse_position0` argument off its kwargs, and the
    first layer (`_cse_first`) replaces position 0 of its input with it. Set once when the backbone is wrapped, so a
    conditioned pass registers nothing per call (a compiled step has no hook to trace). Parameters and state-dict names
    are the layer's own."""

    _cse_first = False

    def forward(self, hidden_states, *args, **kwargs):
        vectors = kwargs.pop(POSITION0_KWARG, None)
        if vectors is not None and self._cse_first:
            hidden_states = _with_position0(hidden_states, vectors)
        return super().forward(hidden_states, *args, **kwargs)


_POSITION0_CLASSES: dict[type, type] = {}


def _position0_class(cls: type) -> type:
    """`cls` with `_Position0Input` mixed in (one class per layer class)."""
    if issubclass(cls, _Position0Input):
        return cls
    if cls not in _POSITION0_CLASSES:
        _POSITION0_CLASSES[cls] = type(cls.__name__, (_Position0Input, cls), {"__module__": cls.__module__})
    return _POSITION0_CLASSES[cls]


@contextmanager
def _replace_position0_output(embeddings: nn.Module, vectors: torch.Tensor) -> Iterator[None]:
    """While active, the embedding module's output at position 0 is `vectors` (B', d) (DiffCSE step 5,
    docs/methods-overview.md): the route of the families whose layers get no kwargs (MPNet, DeBERTa-v2/v3)."""

    def hook(module, args, output):
        return _with_position0(output, vectors)

    handle = embeddings.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _checkpointing(backbone: nn.Module) -> bool:
    """Whether the HF model re-runs layers during backward (activation/gradient checkpointing)."""
    if getattr(type(backbone), "is_activation_checkpointing", None) is not None:  # transformers >= 5.x name
        return bool(backbone.is_activation_checkpointing)
    return bool(getattr(backbone, "is_gradient_checkpointing", False))


class PromptedBackbone(nn.Module):
    """An HF encoder of a supported family whose self-attention layers attend to prefix K/V (DCPCSE reference prefixes steps 4–6).

    `forward(prefix=True)` draws a prefix sample from the owned `PrefixEncoder`, `prefix=False` runs the plain
    model, a `PrefixKeyValues` uses that sample. With a prefix, token positions are shifted by P as HF 4.x
    did (DCPCSE reference prefixes: BERT `P … P+T-1`, RoBERTa from `padding_idx + 1 + P`; the other families in the module
    docstring) unless `shift_positions=False`. The family comes from `encoder_family(backbone)`; an architecture
    prompts cannot reach raises `TypeError` naming it.
    """

    def __init__(self, backbone: nn.Module, prefix_encoder: PrefixEncoder | None = None, shift_positions: bool = True):
        super().__init__()
        family = encoder_family(backbone)
        config = backbone.config
        impl = config._attn_implementation
        if family.injection == "interface":
            inner = next((k for k, v in _PREFIX_IMPLEMENTATIONS.items() if v == impl), impl)
            if inner not in _PREFIX_IMPLEMENTATIONS:
                raise ValueError(
                    f"{family.name}: prefix injection supports the 'sdpa' and 'eager' attention "
                    f"implementations, not {impl!r}"
                )
            if impl != _PREFIX_IMPLEMENTATIONS[inner]:
                backbone.set_attn_implementation(_PREFIX_IMPLEMENTATIONS[inner])
        else:
            inner = "eager"  # the family's own attention code, additive masks
        self.family = family
        self.inner = inner
        self.backbone = backbone
        self.prefix_encoder = prefix_encoder
        self.shift_positions = shift_positions
        self._prepare_attention_modules()
        if prefix_encoder is not None:
            self.check_prefix_shape(prefix_encoder.num_layers, prefix_encoder.num_heads, prefix_encoder.head_dim)

    # ----------------------------------------------------------------------------------------- shapes
    @property
    def config(self):
        return self.backbone.config

    @property
    def layers(self) -> nn.ModuleList:
        return _path(self.backbone, self.family.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def position_kind(self) -> str:
        """ "absolute", "padding", "rotary", or "none" (no position the prefix shift could move; see the module docstring)."""
        return self.family.position_kind(self.config)

    def attention_modules(self) -> list[nn.Module]:
        """The self-attention module of every layer, in order (where layer i's prefix K/V go)."""
        return [_attention_of(self.family, layer) for layer in self.layers]

    def check_prefix_shape(self, num_layers: int, num_heads: int, head_dim: int) -> None:
        want = (self.num_layers, self.num_heads, self.hidden_size // self.num_heads)
        if (num_layers, num_heads, head_dim) != want:
            raise ValueError(
                f"prefix shape (layers, heads, head_dim) = {(num_layers, num_heads, head_dim)} does not fit the backbone's {want}"
            )

    def _prepare_attention_modules(self) -> None:
        """Every self-attention module must know its layer index (the prefix lookup key); the "module" route also
        swaps each module's class for its prefix-aware subclass (same parameters, same state-dict names)."""
        for i, attn in enumerate(self.attention_modules()):
            if getattr(attn, "layer_idx", None) is None:
                attn.layer_idx = i  # DistilBERT, MPNet and DeBERTa attention modules carry no index of their own
            elif attn.layer_idx != i:
                raise ValueError(f"attention module of layer {i} reports layer_idx={attn.layer_idx}")
            head_dim = getattr(attn, "attention_head_size", None) or getattr(attn, "head_dim", None)
            if head_dim is not None and head_dim != self.hidden_size // self.num_heads:
                raise TypeError(
                    f"{self.family.name}: attention head size {head_dim} != hidden_size / heads = "
                    f"{self.hidden_size // self.num_heads}; the prefix layout (H × d/H per layer) cannot fit it"
                )
            if self.family.layer_kwargs:
                layer = self.layers[i]
                layer.__class__ = _position0_class(type(layer))
                layer._cse_first = i == 0
            if self.family.injection == "module":
                swapped = _MODULE_ROUTE.get(type(attn))
                if swapped is not None:
                    attn.__class__ = swapped
                elif type(attn) not in _MODULE_ROUTE.values():
                    raise TypeError(
                        f"{self.family.name}: unexpected self-attention class {type(attn).__name__}; "
                        f"prefix injection knows {[c.__name__ for c in _MODULE_ROUTE]}"
                    )

    # ----------------------------------------------------------------------------------------- inputs
    def position_ids(self, input_ids: torch.Tensor, offset: int) -> torch.Tensor:
        """Positions with the prefix shift `offset` (RoBERTa, XLM-RoBERTa, MPNet: HF's padding-aware numbering;
        ModernBERT: rotary positions). A family without positions ("none") gets `offset …` too, which it ignores."""
        emb = self.backbone.embeddings
        batch, length = input_ids.shape
        kind = self.position_kind
        if kind == "padding" and hasattr(emb, "create_position_ids_from_input_ids"):  # RoBERTa family
            pos = emb.create_position_ids_from_input_ids(input_ids, emb.padding_idx, offset)
            highest = emb.padding_idx + offset + length
        elif kind == "padding":  # MPNet: the same numbering, computed here (its helper takes no offset)
            real = input_ids.ne(emb.padding_idx).int()
            pos = ((torch.cumsum(real, dim=1).type_as(real) + offset) * real).long() + emb.padding_idx
            highest = emb.padding_idx + offset + length
        else:
            pos = torch.arange(offset, offset + length, device=input_ids.device).unsqueeze(0).expand(batch, -1)
            highest = offset + length - 1
        limit = self.config.max_position_embeddings
        if kind != "none" and highest >= limit:
            raise ValueError(
                f"position {highest} exceeds max_position_embeddings={limit} (length {length} + prefix shift {offset})"
            )
        return pos

    def check_position_ids(self, position_ids: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Explicit positions must have the ids' shape and stay inside the position table. The range is read on the
        CPU only: on an accelerator reading it would stall every step, so a caller there checks its positions once
        (DiffAug checks its template positions when it is built)."""
        if position_ids.shape != input_ids.shape:
            raise ValueError(
                f"position_ids {tuple(position_ids.shape)} must have the shape of input_ids {tuple(input_ids.shape)}"
            )
        if position_ids.numel() and position_ids.device.type == "cpu" and not torch.compiler.is_compiling():
            low, high = int(position_ids.min()), int(position_ids.max())
            limit = self.config.max_position_embeddings
            if low < 0 or high >= limit:
                raise ValueError(f"position_ids span [{low}, {high}], outside [0, max_position_embeddings={limit})")

    def attention_mask(self, token_mask: torch.Tensor, prefix: PrefixKeyValues, dtype: torch.dtype) -> torch.Tensor:
        """The 4-D `(B', 1, T, P+T)` mask: prefix slots visible unless `prefix.mask` says otherwise (DCPCSE reference prefixes step 5)."""
        batch, length = token_mask.shape
        if prefix.mask is None:
            prefix_visible = torch.ones(batch, prefix.length, dtype=torch.bool, device=token_mask.device)
        else:
            prefix_visible = prefix.mask.to(device=token_mask.device, dtype=torch.bool).expand(batch, prefix.length)
        visible = torch.cat([prefix_visible, token_mask.bool()], dim=1)[:, None, None, :]
        if self.inner == "sdpa":
            mask = visible
        else:
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
                ~visible, torch.finfo(dtype).min
            )
        return mask.expand(batch, 1, length, prefix.length + length)

    def _position0_module(self) -> nn.Module:
        """The module whose output is the first layer's input (ELECTRA with embedding_size ≠ hidden_size: the projection)."""
        projection = getattr(self.backbone, "embeddings_project", None)
        return projection if projection is not None else self.backbone.embeddings

    # ----------------------------------------------------------------------------------------- forward
    def forward(  # noqa: C901 (one pass with optional inputs per encoder family; split, the hot path would copy tensors)
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        prefix: bool | PrefixKeyValues = True,
        cls_embedding: torch.Tensor | None = None,
        position0_output: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        position_ids: torch.Tensor | None = None,
    ):
        """Run the encoder on `(B', T)` ids; returns the HF output (`last_hidden_state`, `hidden_states`).

        `cls_embedding` (`(d_e,)` or `(B', d_e)`, d_e the word-embedding width) replaces the word embedding at
        position 0 ([CLS] prompt, D2CSE paper); `position0_output` (`(B', d)`) replaces the input of the first layer at
        position 0 — the embedding-layer output after LayerNorm and dropout (ELECTRA: after its projection)
        (conditioning, DiffCSE step 5). `position_ids` (`(B', T)`, optional): explicit positions used as given instead
        of the default (shifted) numbering — DiffAug's template denoising places the template tokens at chosen
        positions (DiffAug); None keeps the default behaviour. `token_type_ids` on a family without token types
        (DistilBERT, MPNet, ModernBERT) must be None or all zero.
        """
        batch, length = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if prefix is True:
            if self.prefix_encoder is None:
                raise ValueError("prefix=True needs a PromptedBackbone built with a prefix_encoder")
            prefix = self.prefix_encoder(batch)
        elif prefix is False:
            prefix = None
        if prefix is not None and prefix.batch_size != batch:
            raise ValueError(f"prefix sample has {prefix.batch_size} rows, the input {batch}")
        if prefix is not None and len(prefix.layers) != self.num_layers:
            raise ValueError(
                f"prefix sample has {len(prefix.layers)} layers, the {self.family.name} backbone {self.num_layers}"
            )

        if position_ids is None:
            shift = prefix is not None and self.shift_positions and self.position_kind != "none"
            position_ids = self.position_ids(input_ids, prefix.length if shift else 0)
        else:
            self.check_position_ids(position_ids, input_ids)
        kwargs = dict(output_hidden_states=output_hidden_states)
        if self.position_kind != "none":
            kwargs["position_ids"] = position_ids
        if self.family.token_types:
            kwargs["token_type_ids"] = token_type_ids
        elif token_type_ids is not None and bool(token_type_ids.any()):
            raise ValueError(f"{self.family.name} has no token types; got non-zero token_type_ids")
        if prefix is not None and self.family.prebuilt_mask:
            kwargs["attention_mask"] = self.attention_mask(attention_mask, prefix, self.backbone.dtype)
        else:
            kwargs["attention_mask"] = attention_mask
        if prefix is not None and self.family.injection == "interface":
            kwargs[PREFIX_KWARG] = prefix
        if prefix is not None and self.family.injection == "module" and self.training and _checkpointing(self.backbone):
            raise ValueError(
                f"{self.family.name}: prefixes reach its attention only inside this forward call, so "
                "gradient checkpointing (which re-runs layers during backward) cannot be used with them"
            )
        if cls_embedding is not None:
            embeds = self.backbone.get_input_embeddings()(input_ids)
            first = cls_embedding.to(embeds.dtype).expand(batch, embeds.shape[-1]).unsqueeze(1)
            kwargs["inputs_embeds"] = torch.cat([first, embeds[:, 1:]], dim=1)
        else:
            kwargs["input_ids"] = input_ids

        if position0_output is not None and position0_output.shape != (batch, self.hidden_size):
            raise ValueError(
                f"position-0 vectors must be {(batch, self.hidden_size)}, got {tuple(position0_output.shape)}"
            )
        if self.family.layer_kwargs:
            if position0_output is not None:
                kwargs[POSITION0_KWARG] = position0_output
            if self.family.injection == "interface":  # no context to enter: nothing per call but the kwargs
                return self.backbone(**kwargs)
        with contextlib.ExitStack() as scope:
            if self.family.injection == "module" and prefix is not None:
                scope.enter_context(_prefix_scope(self.attention_modules(), prefix))
            if position0_output is not None and not self.family.layer_kwargs:
                scope.enter_context(_replace_position0_output(self._position0_module(), position0_output))
            return self.backbone(**kwargs)


def prompted_backbone(
    backbone: nn.Module,
    prefix_len: int,
    dropout: float = 0.1,
    projection: bool = False,
    projection_hidden: int | None = None,
    shift_positions: bool = True,
) -> PromptedBackbone:
    """`backbone` with a fresh `PrefixEncoder` sized for it (N(0, initializer_range) init, DCPCSE reference prefixes)."""
    cfg = backbone.config
    prompts = PrefixEncoder(
        prefix_len,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        dropout=dropout,
        projection=projection,
        projection_hidden=projection_hidden or cfg.hidden_size,
        init_std=getattr(cfg, "initializer_range", 0.02),
    )
    return PromptedBackbone(backbone, prompts, shift_positions=shift_positions)


class PromptedModel:
    """Mixin for methods whose `self.encoder` is a `PromptedBackbone`: the `prompts` and `backbone` accessors."""

    encoder: PromptedBackbone

    def attach_prompted_backbone(self, config, backbone: nn.Module | None, tokenizer):
        """Attach the frozen backbone (`CSEModel.attach_backbone`) and wrap it with the deep prompts of a
        `PromptConfig` as `self.encoder`; returns the backbone's config."""
        backbone = self.attach_backbone(config, backbone, tokenizer, trainable=False)
        self.encoder = prompted_backbone(
            backbone,
            config.prefix_len,
            config.prefix_dropout,
            config.prefix_projection,
            config.prefix_hidden,
            config.shift_positions,
        )
        self.encoder.prefix_encoder.requires_grad_(config.train_prompts)  # False: the prompts-frozen control
        return backbone.config

    @property
    def prompts(self) -> PrefixEncoder:
        return self.encoder.prefix_encoder

    @property
    def backbone(self) -> nn.Module:
        return self.encoder.backbone
