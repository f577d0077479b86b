"""Deep continuous prompts (P-tuning v2 prefixes) on a frozen BERT/RoBERTa-family encoder (methods.md §1.4).

`PrefixEncoder` holds the trainable key/value prefixes; `PromptedBackbone` runs a Hugging Face encoder
with those prefixes prepended to every self-attention layer's keys and values.

Injection (transformers 5.x, where tuples as `past_key_values` are gone, methods.md §1.4 note and §10.23):
the backbone's attention implementation is switched to `cse_prefix_sdpa` / `cse_prefix_eager`, registered
below in transformers' `AttentionInterface`. The prefix tensors of one forward call travel as the keyword
argument `cse_prefix` (transformers forwards extra model kwargs down to the attention function), so the
wrapped model keeps no per-call state and two sequential passes cannot see each other's prefixes. The
attention function concatenates the layer's prefix K/V in front of the token K/V and calls the stock
sdpa/eager function. The (B', 1, T, P+T) mask is built once per call by `PromptedBackbone` and handed to
the model as a 4-D mask, which transformers passes through unchanged. Without a prefix the wrapped model
is exactly the plain model (mask creation is registered for the new implementation names as well).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import eager_attention_forward as _bert_eager_attention

PREFIX_KWARG = "cse_prefix"
_PREFIX_IMPLEMENTATIONS = {"sdpa": "cse_prefix_sdpa", "eager": "cse_prefix_eager"}


@dataclass(frozen=True)
class PrefixKeyValues:
    """One sample of prefix keys/values: per layer `(key, value)`, each `(B', H, P, Dh)`.

    `mask` is an optional `(B', P)` (or `(P,)`) visibility mask, 1 = visible; None = all visible (§1.4 step 5).
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
    """Trainable key/value prefixes for every layer (methods.md §1.4, "Parameters" and steps 1–3).

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
        self.prefix_len, self.num_layers, self.hidden_size, self.num_heads = prefix_len, num_layers, hidden_size, num_heads
        self.head_dim = hidden_size // num_heads
        width = 2 * num_layers * hidden_size
        self.register_buffer("prefix_ids", torch.arange(prefix_len), persistent=False)
        if projection:
            self.embedding = nn.Embedding(prefix_len, hidden_size)
            self.transform = nn.Sequential(nn.Linear(hidden_size, projection_hidden), nn.Tanh(), nn.Linear(projection_hidden, width))
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
        """Steps 1–3 of §1.4: expand to `B'` rows, reshape, dropout, permute to `(2L, B', H, P, Dh)`, pair up."""
        x = self.rows().unsqueeze(0).expand(batch_size, -1, -1)
        x = x.view(batch_size, self.prefix_len, 2 * self.num_layers, self.num_heads, self.head_dim)
        x = self.dropout(x)
        kv = x.permute(2, 0, 3, 1, 4).unbind(0)  # unbind: one backward, no zero-filled tensor per slot
        return PrefixKeyValues(tuple((kv[2 * i], kv[2 * i + 1]) for i in range(self.num_layers)), mask)


def _prefix_attention(inner: str):
    """An attention function that prepends this layer's prefix K/V (§1.4 step 4), then runs `inner`."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        prefix: PrefixKeyValues | None = kwargs.pop(PREFIX_KWARG, None)
        if prefix is not None:
            k_p, v_p = prefix.layers[module.layer_idx]
            key = torch.cat([k_p.to(key.dtype), key], dim=2)
            value = torch.cat([v_p.to(value.dtype), value], dim=2)
        fn = ALL_ATTENTION_FUNCTIONS["sdpa"] if inner == "sdpa" else _bert_eager_attention
        return fn(module, query, key, value, attention_mask, **kwargs)

    return attention


for _inner, _name in _PREFIX_IMPLEMENTATIONS.items():
    AttentionInterface.register(_name, _prefix_attention(_inner))
    AttentionMaskInterface.register(_name, sdpa_mask if _inner == "sdpa" else eager_mask)


@contextmanager
def _replace_position0_output(embeddings: nn.Module, vectors: torch.Tensor) -> Iterator[None]:
    """While active, the embedding module's output at position 0 is `vectors` (B', d) (§4 step 5, §10.3)."""

    def hook(module, args, output):
        return torch.cat([vectors.unsqueeze(1).to(output.dtype), output[:, 1:]], dim=1)

    handle = embeddings.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


class PromptedBackbone(nn.Module):
    """A BERT/RoBERTa-family HF encoder whose self-attention layers attend to prefix K/V (§1.4 steps 4–6).

    `forward(prefix=True)` draws a prefix sample from the owned `PrefixEncoder`, `prefix=False` runs the plain
    model, a `PrefixKeyValues` uses that sample. With a prefix, token positions are shifted by P as HF 4.x
    did (§1.4 item 6: BERT `P … P+T-1`, RoBERTa from `padding_idx + 1 + P`) unless `shift_positions=False`.
    """

    def __init__(self, backbone: nn.Module, prefix_encoder: PrefixEncoder | None = None, shift_positions: bool = True):
        super().__init__()
        config = backbone.config
        impl = config._attn_implementation
        inner = next((k for k, v in _PREFIX_IMPLEMENTATIONS.items() if v == impl), impl)
        if inner not in _PREFIX_IMPLEMENTATIONS:
            raise ValueError(f"prefix injection supports the 'sdpa' and 'eager' attention implementations, not {impl!r}")
        if not (hasattr(backbone, "embeddings") and hasattr(backbone, "encoder") and hasattr(backbone.encoder, "layer")):
            raise TypeError(f"{type(backbone).__name__} is not a BERT/RoBERTa-family encoder (embeddings + encoder.layer)")
        if impl != _PREFIX_IMPLEMENTATIONS[inner]:
            backbone.set_attn_implementation(_PREFIX_IMPLEMENTATIONS[inner])
        self.inner = inner
        self.backbone = backbone
        self.prefix_encoder = prefix_encoder
        self.shift_positions = shift_positions
        self._assign_layer_indices()
        if prefix_encoder is not None:
            self.check_prefix_shape(prefix_encoder.num_layers, prefix_encoder.num_heads, prefix_encoder.head_dim)

    # ----------------------------------------------------------------------------------------- shapes
    @property
    def config(self):
        return self.backbone.config

    @property
    def num_layers(self) -> int:
        return len(self.backbone.encoder.layer)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    def check_prefix_shape(self, num_layers: int, num_heads: int, head_dim: int) -> None:
        want = (self.num_layers, self.num_heads, self.hidden_size // self.num_heads)
        if (num_layers, num_heads, head_dim) != want:
            raise ValueError(f"prefix shape (layers, heads, head_dim) = {(num_layers, num_heads, head_dim)} does not fit the backbone's {want}")

    def _assign_layer_indices(self) -> None:
        """Every self-attention module must know its layer index (the prefix lookup key)."""
        for i, layer in enumerate(self.backbone.encoder.layer):
            found = False
            for m in layer.modules():
                if hasattr(m, "layer_idx") and hasattr(m, "query"):
                    if m.layer_idx is None:
                        m.layer_idx = i
                    elif m.layer_idx != i:
                        raise ValueError(f"attention module of layer {i} reports layer_idx={m.layer_idx}")
                    found = True
            if not found:
                raise TypeError(f"no self-attention module with `layer_idx` found in layer {i}")

    # ----------------------------------------------------------------------------------------- inputs
    def position_ids(self, input_ids: torch.Tensor, offset: int) -> torch.Tensor:
        """Absolute positions with the prefix shift `offset` (RoBERTa: HF's padding-aware numbering)."""
        emb = self.backbone.embeddings
        batch, length = input_ids.shape
        if hasattr(emb, "create_position_ids_from_input_ids"):  # RoBERTa family
            pos = emb.create_position_ids_from_input_ids(input_ids, emb.padding_idx, offset)
            highest = emb.padding_idx + offset + length
        else:
            pos = torch.arange(offset, offset + length, device=input_ids.device).unsqueeze(0).expand(batch, -1)
            highest = offset + length - 1
        limit = self.config.max_position_embeddings
        if highest >= limit:
            raise ValueError(f"position {highest} exceeds max_position_embeddings={limit} (length {length} + prefix shift {offset})")
        return pos

    def check_position_ids(self, position_ids: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Explicit positions must have the ids' shape and stay inside the position table."""
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
        if position_ids.numel():
            low, high = int(position_ids.min()), int(position_ids.max())
            limit = self.config.max_position_embeddings
            if low < 0 or high >= limit:
                raise ValueError(f"position_ids span [{low}, {high}], outside [0, max_position_embeddings={limit})")

    def attention_mask(self, token_mask: torch.Tensor, prefix: PrefixKeyValues, dtype: torch.dtype) -> torch.Tensor:
        """The 4-D `(B', 1, T, P+T)` mask: prefix slots visible unless `prefix.mask` says otherwise (§1.4 step 5)."""
        batch, length = token_mask.shape
        if prefix.mask is None:
            prefix_visible = torch.ones(batch, prefix.length, dtype=torch.bool, device=token_mask.device)
        else:
            prefix_visible = prefix.mask.to(device=token_mask.device, dtype=torch.bool).expand(batch, prefix.length)
        visible = torch.cat([prefix_visible, token_mask.bool()], dim=1)[:, None, None, :]
        if self.inner == "sdpa":
            mask = visible
        else:
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)
        return mask.expand(batch, 1, length, prefix.length + length)

    # ----------------------------------------------------------------------------------------- forward
    def forward(
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

        `cls_embedding` (`(d,)` or `(B', d)`) replaces the word embedding at position 0 ([CLS] prompt, §5);
        `position0_output` (`(B', d)`) replaces the embedding-layer output (after LayerNorm and dropout) at
        position 0 (conditioning, §4 step 5). `position_ids` (`(B', T)`, optional): explicit absolute positions
        used as given instead of the default (shifted) numbering — DiffAug's template denoising places the
        template tokens at chosen positions (§6); None keeps the default behaviour.
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

        if position_ids is None:
            offset = prefix.length if (prefix is not None and self.shift_positions) else 0
            position_ids = self.position_ids(input_ids, offset)
        else:
            self.check_position_ids(position_ids, input_ids)
        kwargs = dict(position_ids=position_ids, token_type_ids=token_type_ids,
                      output_hidden_states=output_hidden_states)
        if prefix is not None:
            kwargs["attention_mask"] = self.attention_mask(attention_mask, prefix, self.backbone.dtype)
            kwargs[PREFIX_KWARG] = prefix
        else:
            kwargs["attention_mask"] = attention_mask
        if cls_embedding is not None:
            embeds = self.backbone.embeddings.word_embeddings(input_ids)
            first = cls_embedding.to(embeds.dtype).expand(batch, embeds.shape[-1]).unsqueeze(1)
            kwargs["inputs_embeds"] = torch.cat([first, embeds[:, 1:]], dim=1)
        else:
            kwargs["input_ids"] = input_ids

        if position0_output is None:
            return self.backbone(**kwargs)
        if position0_output.shape != (batch, self.hidden_size):
            raise ValueError(f"position-0 vectors must be {(batch, self.hidden_size)}, got {tuple(position0_output.shape)}")
        with _replace_position0_output(self.backbone.embeddings, position0_output):
            return self.backbone(**kwargs)


def prompted_backbone(backbone: nn.Module, prefix_len: int, dropout: float = 0.1, projection: bool = False,
                      projection_hidden: int | None = None, shift_positions: bool = True) -> PromptedBackbone:
    """`backbone` with a fresh `PrefixEncoder` sized for it (N(0, initializer_range) init, §1.4)."""
    cfg = backbone.config
    prompts = PrefixEncoder(prefix_len, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, dropout=dropout,
                            projection=projection, projection_hidden=projection_hidden or cfg.hidden_size,
                            init_std=getattr(cfg, "initializer_range", 0.02))
    return PromptedBackbone(backbone, prompts, shift_positions=shift_positions)


class PromptedModel:
    """Mixin for methods whose `self.encoder` is a `PromptedBackbone`: the `prompts` and `backbone` accessors."""

    encoder: PromptedBackbone

    def attach_prompted_backbone(self, config, backbone: nn.Module | None, tokenizer):
        """Attach the frozen backbone (`CSEModel.attach_backbone`) and wrap it with the deep prompts of a
        `PromptConfig` as `self.encoder`; returns the backbone's config."""
        backbone = self.attach_backbone(config, backbone, tokenizer, trainable=False)
        self.encoder = prompted_backbone(backbone, config.prefix_len, config.prefix_dropout, config.prefix_projection,
                                         config.prefix_hidden, config.shift_positions)
        return backbone.config

    @property
    def prompts(self) -> PrefixEncoder:
        return self.encoder.prefix_encoder

    @property
    def backbone(self) -> nn.Module:
        return self.encoder.backbone
