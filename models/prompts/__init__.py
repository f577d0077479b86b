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

One module per mechanism: `families.py` (the encoder-family table, `encoder_family`, `encoder_layers`),
`prefixes.py` (`PrefixEncoder`, `PrefixKeyValues`, the prefix's mask columns), `interface.py` (the interface route),
`module_route.py` (the module route), `position0.py` (the position-0 input of DiffCSE/D2CSE's conditioning and the
[CLS] prompt), `backbone.py` (`PromptedBackbone`, `prompted_backbone`, the `PromptedModel` mixin). This package
module itself imports none of them.
"""
