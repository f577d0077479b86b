"""`PromptedBackbone`: a Hugging Face encoder of a supported family whose self-attention layers attend to the prefix
K/V of a `PrefixEncoder` (through the family's route: `cse.models.prompts.interface` or
`cse.models.prompts.module_route`), with the position shift and the position-0 input; `PromptedModel`, the mixin of
the methods built on one."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from cse.models.loading import word_embeddings
from cse.models.prompts.families import attention_of, encoder_family, encoder_layers
from cse.models.prompts.interface import PREFIX_IMPLEMENTATIONS, PREFIX_KWARG
from cse.models.prompts.module_route import MODULE_ROUTE, prefix_scope
from cse.models.prompts.packing import PACKED_KWARG, PackedPosition0, PackedRows, packed_index
from cse.models.prompts.position0 import POSITION0_KWARG, position0_class, replace_position0_output
from cse.models.prompts.prefixes import PrefixEncoder, PrefixKeyValues, prefix_visibility

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from cse.models.method import MethodConfig, PromptConfig


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

    `unpad(fill)` makes its training-mode passes unpadded (`cse.models.prompts.packing`: the real tokens packed at a
    fixed budget of `fill` × rows × length slots; BERT, RoBERTa, XLM-RoBERTa and ELECTRA with SDPA attention); a call
    with `unpadded=False` stays padded (a pass whose loss reads pad positions).
    """

    def __init__(
        self, backbone: PreTrainedModel, prefix_encoder: PrefixEncoder | None = None, shift_positions: bool = True
    ) -> None:
        super().__init__()
        family = encoder_family(backbone)
        config = backbone.config
        impl = config._attn_implementation
        if family.injection == "interface":
            inner = next((k for k, v in PREFIX_IMPLEMENTATIONS.items() if v == impl), impl)
            if inner not in PREFIX_IMPLEMENTATIONS:
                raise ValueError(
                    f"{family.name}: prefix injection supports the 'sdpa' and 'eager' attention "
                    f"implementations, not {impl!r}"
                )
            if impl != PREFIX_IMPLEMENTATIONS[inner]:
                backbone.set_attn_implementation(PREFIX_IMPLEMENTATIONS[inner])
        else:
            inner = "eager"  # the family's own attention code, additive masks
        self.family = family
        self.inner = inner
        self.backbone = backbone
        self.prefix_encoder = prefix_encoder
        self.shift_positions = shift_positions
        self.unpadded_fill: float | None = None
        self._prepare_attention_modules()
        if prefix_encoder is not None:
            got = (prefix_encoder.num_layers, prefix_encoder.num_heads, prefix_encoder.head_dim)
            want = (self.num_layers, self.num_heads, self.hidden_size // self.num_heads)
            if got != want:
                raise ValueError(f"prefix shape (layers, heads, head_dim) = {got} does not fit the backbone's {want}")

    # ----------------------------------------------------------------------------------------- shapes
    @property
    def config(self) -> PretrainedConfig:
        return self.backbone.config

    @property
    def layers(self) -> nn.ModuleList:
        return cast(nn.ModuleList, self.backbone.get_submodule(self.family.layers))  # the family's layer list

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
        """One of "absolute", "padding", "rotary", "none" (no position the prefix shift could move; see the module docstring)."""
        return self.family.position_kind(self.config)

    def attention_modules(self) -> list[nn.Module]:
        """The self-attention module of every layer, in order (where layer i's prefix K/V go)."""
        return [attention_of(self.family, layer) for layer in self.layers]

    def _prepare_attention_modules(self) -> None:
        """Every self-attention module must know its layer index (the prefix lookup key); the "module" route also
        swaps each module's class for its prefix-aware subclass (same parameters, same state-dict names)."""
        for i, attn in enumerate(self.attention_modules()):
            if getattr(attn, "layer_idx", None) is None:
                # DistilBERT, MPNet and DeBERTa attention modules carry no index of their own
                attn.layer_idx = i  # type: ignore[assignment]  # torch's __setattr__ stub takes tensors and modules only
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
                layer.__class__ = position0_class(type(layer))
                layer._cse_first = i == 0  # type: ignore[assignment]  # as layer_idx above
            if self.family.injection == "module":
                swapped = MODULE_ROUTE.get(type(attn))
                if swapped is not None:
                    attn.__class__ = swapped
                elif type(attn) not in MODULE_ROUTE.values():
                    raise TypeError(
                        f"{self.family.name}: unexpected self-attention class {type(attn).__name__}; "
                        f"prefix injection knows {[c.__name__ for c in MODULE_ROUTE]}"
                    )

    def unpad(self, fill: float | None) -> None:
        """Training-mode passes over the real tokens only, at a budget of `fill` × rows × length slots (None: padded).

        Raises:
            TypeError: the family's attention is not reached through the interface route with SDPA and a prebuilt
                mask (MPNet, DeBERTa, DistilBERT, ModernBERT, or eager attention).
        """
        family = self.family
        packable = family.injection == "interface" and family.prebuilt_mask and family.token_types
        if fill is not None and not (packable and family.layer_kwargs and self.inner == "sdpa"):
            raise TypeError(
                f"{family.name} ({self.inner} attention): unpadded passes need a BERT-style family (BERT, RoBERTa, "
                "XLM-RoBERTa, ELECTRA) with SDPA attention"
            )
        self.unpadded_fill = fill

    # ----------------------------------------------------------------------------------------- inputs
    def position_ids(self, input_ids: torch.Tensor, offset: int) -> torch.Tensor:
        """Positions with the prefix shift `offset` (RoBERTa, XLM-RoBERTa, MPNet: HF's padding-aware numbering;
        ModernBERT: rotary positions). A family without positions ("none") gets `offset …` too, which it ignores."""
        emb: Any = self.backbone.embeddings  # the family's own embeddings class (padding_idx, position helper)
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
        visible = torch.cat([prefix_visibility(prefix, batch, token_mask.device), token_mask.bool()], dim=1)
        visible = visible[:, None, None, :]
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
        return projection if projection is not None else self.backbone.get_submodule("embeddings")

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
        unpadded: bool = True,
    ) -> Any:
        """Run the encoder on `(B', T)` ids; returns the HF output (`last_hidden_state`, `hidden_states`).

        `cls_embedding` (`(d_e,)` or `(B', d_e)`, d_e the word-embedding width) replaces the word embedding at
        position 0 ([CLS] prompt, D2CSE paper); `position0_output` (`(B', d)`) replaces the input of the first layer at
        position 0 — the embedding-layer output after LayerNorm and dropout (ELECTRA: after its projection)
        (conditioning, DiffCSE step 5). `position_ids` (`(B', T)`, optional): explicit positions used as given instead
        of the default (shifted) numbering — DiffAug's template denoising places the template tokens at chosen
        positions (DiffAug); None keeps the default behaviour. `token_type_ids` on a family without token types
        (DistilBERT, MPNet, ModernBERT) must be None or all zero. `unpadded` (default True): after `unpad(fill)`, a
        training-mode call (the backbone's mode) runs packed (`packed_call`); False keeps this call padded.
        """
        batch = input_ids.shape[0]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        sample = self.resolve_prefix(prefix, batch)
        kwargs = self.backbone_kwargs(
            input_ids, attention_mask, token_type_ids, sample, cls_embedding, output_hidden_states, position_ids
        )
        if position0_output is not None and position0_output.shape != (batch, self.hidden_size):
            raise ValueError(
                f"position-0 vectors must be {(batch, self.hidden_size)}, got {tuple(position0_output.shape)}"
            )
        if unpadded and self.unpadded_fill is not None and self.backbone.training:
            return self.packed_call(kwargs, attention_mask, sample, position0_output, self.unpadded_fill)
        if self.family.layer_kwargs:
            if position0_output is not None:
                kwargs[POSITION0_KWARG] = position0_output
            if self.family.injection == "interface":  # no context to enter: nothing per call but the kwargs
                return self.backbone(**kwargs)
        with contextlib.ExitStack() as scope:
            if self.family.injection == "module" and sample is not None:
                scope.enter_context(prefix_scope(self.attention_modules(), sample))
            if position0_output is not None and not self.family.layer_kwargs:
                scope.enter_context(replace_position0_output(self._position0_module(), position0_output))
            return self.backbone(**kwargs)

    def packed_call(
        self,
        kwargs: dict[str, Any],
        token_mask: torch.Tensor,
        prefix: PrefixKeyValues | None,
        position0_output: torch.Tensor | None,
        fill: float,
    ) -> BaseModelOutput:
        """The backbone's call of `forward` on the real tokens only (`cse.models.prompts.packing`): the padded-layout
        keyword arguments `kwargs` packed into `(1, N)` slots, each row's positions and token types kept, the attention
        per row with its own prefix; the last (and, when asked, every) hidden state back in the `(B', T, d)` layout.

        Args:
            kwargs: `backbone_kwargs`' arguments of the padded call.
            token_mask: `(B', T)` token mask.
            prefix: the pass's prefix sample, or None.
            position0_output: `(B', d)` position-0 vectors, or None.
            fill: the budget's share of the padded positions.
        """
        rows, length = token_mask.shape
        if prefix is not None:
            mask = self.attention_mask(token_mask, prefix, self.backbone.dtype)
        else:
            mask = token_mask.bool()[:, None, None, :].expand(rows, 1, length, length)
        packed = PackedRows(packed_index(token_mask, fill), rows, length, mask)
        call = dict(kwargs, attention_mask=None)
        for name in ("input_ids", "inputs_embeds", "position_ids", "token_type_ids"):
            if call.get(name) is not None:
                call[name] = packed.gather(call[name])
        if call.get("token_type_ids") is None:  # the model's own zeros are sliced from a buffer of max_position rows
            call["token_type_ids"] = torch.zeros_like(packed.index).unsqueeze(0)
        call[PACKED_KWARG] = packed
        if position0_output is not None:
            values = position0_output.index_select(0, packed.slot_rows()).unsqueeze(0)
            call[POSITION0_KWARG] = PackedPosition0(packed.first_positions(), values)
        out = self.backbone(**call)
        hidden = out.hidden_states
        return BaseModelOutput(
            last_hidden_state=packed.scatter(out.last_hidden_state),
            hidden_states=None if hidden is None else tuple(packed.scatter(h) for h in hidden),
        )

    def resolve_prefix(self, prefix: bool | PrefixKeyValues, batch: int) -> PrefixKeyValues | None:
        """The prefix sample `forward` runs with: a fresh one from the owned `PrefixEncoder` (True), none (False) or
        the given one, checked against the batch and the backbone's layers."""
        sample: PrefixKeyValues | None
        if prefix is True:
            if self.prefix_encoder is None:
                raise ValueError("prefix=True needs a PromptedBackbone built with a prefix_encoder")
            sample = self.prefix_encoder(batch)
        elif prefix is False:
            sample = None
        else:
            sample = prefix
        if sample is not None and sample.batch_size != batch:
            raise ValueError(f"prefix sample has {sample.batch_size} rows, the input {batch}")
        if sample is not None and len(sample.layers) != self.num_layers:
            raise ValueError(
                f"prefix sample has {len(sample.layers)} layers, the {self.family.name} backbone {self.num_layers}"
            )
        return sample

    def backbone_kwargs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        prefix: PrefixKeyValues | None,
        cls_embedding: torch.Tensor | None,
        output_hidden_states: bool,
        position_ids: torch.Tensor | None,
    ) -> dict[str, Any]:
        """The keyword arguments of the backbone's call in `forward` (its arguments as documented there; `prefix`:
        the sample, or None): positions (shifted by the prefix, or checked when given), token types, the attention
        mask (prebuilt with the prefix columns where the family needs it), the prefix kwarg of the interface route,
        and the ids or, with `cls_embedding`, the input embeddings."""
        batch = input_ids.shape[0]
        if position_ids is None:
            shift = prefix is not None and self.shift_positions and self.position_kind != "none"
            position_ids = self.position_ids(input_ids, prefix.length if prefix is not None and shift else 0)
        else:
            self.check_position_ids(position_ids, input_ids)
        kwargs: dict[str, Any] = dict(output_hidden_states=output_hidden_states)
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
            embeds = word_embeddings(self.backbone)(input_ids)
            first = cls_embedding.to(embeds.dtype).expand(batch, embeds.shape[-1]).unsqueeze(1)
            kwargs["inputs_embeds"] = torch.cat([first, embeds[:, 1:]], dim=1)
        else:
            kwargs["input_ids"] = input_ids
        return kwargs


def unpad_fine_tuned(model: nn.Module, encoder: PreTrainedModel, fill: float | None) -> None:
    """`use_unpadded` of a fine-tuned method (SimCSE, DiffCSE: `FineTunedModel`): every prompted backbone of `model`
    unpadded, and its plain `encoder`'s CLS pass too, through a `PromptedBackbone` without prompts over the same
    encoder held outside the module tree (`_unpadded_encoder`; None when `fill` is None).

    Args:
        model: the method's model.
        encoder: its fine-tuned encoder (`model.encoder`).
        fill: the budget's share of a pass's padded positions, or None (padded).
    """
    from cse.models.method import unpad_prompted

    unpad_prompted(model, fill)
    view = None
    if fill is not None:
        view = PromptedBackbone(encoder, None, shift_positions=False)
        view.unpad(fill)
    model.__dict__["_unpadded_encoder"] = view  # not a submodule: the encoder stays where it is


def prompted_backbone(
    backbone: PreTrainedModel,
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


def end_token_prefix_rows(backbone: PreTrainedModel, ids: list[int], prefix_len: int) -> torch.Tensor:
    """The `(P, 2·L·d)` prefix table whose every row is the backbone's own key and value of the last token of `ids`
    at each layer, in `PrefixEncoder`'s layout `[k_0 | v_0 | k_1 | v_1 | …]` (`PromptConfig.prefix_init` "sep").

    Args:
        backbone: a bare encoder whose self-attention has `key` and `value` projections (the BERT layout: BERT,
            RoBERTa, ELECTRA, …); run once in eval mode without gradients, its mode restored after.
        ids: the token ids of the sentence to read, ending with the token to copy (the empty sentence: `[CLS] [SEP]`).
        prefix_len: P, the number of rows (all equal).

    Returns:
        `(P, 2·L·d)` float32 tensor on the backbone's device.

    Raises:
        TypeError: the family's attention has no `key`/`value` projections (e.g. DistilBERT's `k_lin`).

    Example:
        >>> from transformers import BertConfig, BertModel
        >>> bert = BertModel(BertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16))
        >>> end_token_prefix_rows(bert, [101, 102], 3).shape
        torch.Size([3, 32])
    """
    family = encoder_family(backbone)
    captured: list[torch.Tensor] = []
    hooks = []
    for layer in encoder_layers(backbone):
        attention = attention_of(family, layer)
        for name in ("key", "value"):
            projection = getattr(attention, name, None)
            if not isinstance(projection, nn.Linear):
                raise TypeError(f"prefix_init 'sep' needs attention key/value projections; {family.name} has none")
            hooks.append(projection.register_forward_hook(lambda _m, _i, out: captured.append(out[0, -1])))
    was_training = backbone.training
    try:
        backbone.eval()
        device = next(backbone.parameters()).device
        with torch.no_grad():
            backbone(
                input_ids=torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), device=device)
            )
    finally:
        backbone.train(was_training)
        for hook in hooks:
            hook.remove()
    return torch.cat(captured).float().unsqueeze(0).repeat(prefix_len, 1)


class PromptedModel:
    """Mixin for methods whose `self.encoder` is a `PromptedBackbone`: the `prompts` and `backbone` accessors, and for
    those attached by `attach_prompted_backbone` the CLS pass with prompts (`encode_cls`)."""

    encoder: PromptedBackbone

    if TYPE_CHECKING:  # the method class's own (CSEModel), which this mixin is always combined with
        tokenizer: PreTrainedTokenizerBase

        def attach_backbone(
            self,
            config: MethodConfig,
            backbone: PreTrainedModel | None,
            tokenizer: PreTrainedTokenizerBase | None,
            trainable: bool,
        ) -> PreTrainedModel: ...

    def attach_prompted_backbone(
        self,
        config: PromptConfig,
        backbone: PreTrainedModel | None,
        tokenizer: PreTrainedTokenizerBase | None,
    ) -> PretrainedConfig:
        """Attach the frozen backbone (`CSEModel.attach_backbone`) and wrap it with the deep prompts of a
        `PromptConfig` as `self.encoder`; returns the backbone's config. `self.cls_prompt`, the word embedding that
        replaces [CLS] in `encode_cls` (the [CLS] prompt, D2CSE paper), starts as None: a method sets its own."""
        backbone = self.attach_backbone(config, backbone, tokenizer, trainable=False)
        self.encoder = prompted_backbone(
            backbone,
            config.prefix_len,
            config.prefix_dropout,
            config.prefix_projection,
            config.prefix_hidden,
            config.shift_positions,
        )
        if config.prefix_init == "sep":  # (not with prefix_projection: PromptConfig refuses it)
            rows = end_token_prefix_rows(backbone, self.tokenizer("")["input_ids"], config.prefix_len)
            with torch.no_grad():
                self.prompts.embedding.weight.copy_(rows)
        self.prompts.requires_grad_(config.train_prompts)  # False: the prompts-frozen control
        self.cls_prompt: nn.Parameter | None = None
        return backbone.config

    @property
    def prompts(self) -> PrefixEncoder:
        return cast(PrefixEncoder, self.encoder.prefix_encoder)  # attach_prompted_backbone always builds one

    @property
    def backbone(self) -> PreTrainedModel:
        return self.encoder.backbone

    def encode_cls(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        prefix: PrefixKeyValues | None = None,
    ) -> torch.Tensor:
        """Last-layer CLS state of `(B', T)` rows with prompts (a fresh prefix sample unless given) and the [CLS]
        prompt if the method has one: `(B', d)`."""
        if prefix is None:
            prefix = self.prompts(input_ids.shape[0])
        out = self.encoder(input_ids, attention_mask, token_type_ids, prefix=prefix, cls_embedding=self.cls_prompt)
        return out.last_hidden_state[:, 0]
