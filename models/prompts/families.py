"""Encoder families: where a Hugging Face encoder keeps its layers and self-attention, how it numbers positions and
which route a prefix takes into its attention (`EncoderFamily`, looked up from `config.model_type` by
`encoder_family`; the per-family choices are in `cse.models.prompts`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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

    def position_kind(self, config: PretrainedConfig) -> str:
        """`positions`, or "none" for DeBERTa-v2/v3 without absolute position embeddings (`position_biased_input`)."""
        if self.positions == "absolute" and not getattr(config, "position_biased_input", True):
            return "none"
        return self.positions


_BERT_LIKE: dict[str, Any] = dict(
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


def _bert_layout_attention(layer: nn.Module) -> nn.Module | None:
    return next((m for m in layer.modules() if hasattr(m, "layer_idx") and hasattr(m, "query")), None)


def encoder_family(backbone: nn.Module) -> EncoderFamily:
    """The `EncoderFamily` of a bare HF encoder; `TypeError` naming the architecture if prompts cannot reach it."""
    model_type = getattr(getattr(backbone, "config", None), "model_type", None)
    family = ENCODER_FAMILIES.get(model_type) if isinstance(model_type, str) else None
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
    return cast(nn.ModuleList, backbone.get_submodule(encoder_family(backbone).layers))  # the family's layer list


def attention_of(family: EncoderFamily, layer: nn.Module) -> nn.Module:
    found = _bert_layout_attention(layer) if family.attention == "" else layer.get_submodule(family.attention)
    if found is None:
        raise TypeError(f"{family.name}: no self-attention module with `layer_idx` found in layer {layer!r}")
    return found
