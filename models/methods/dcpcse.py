"""DCPCSE: deep continuous prompts on a frozen PLM, SimCSE loss, optional MLM auxiliary (Jiang & Wang, 2022).

Architecture (DCPCSE, DCPCSE reference prefixes): the pretrained encoder is frozen (`requires_grad=False`) but stays in train mode
during training, so its dropout still makes the two contrastive views (DCPCSE reference prefixes, docs/methods-overview.md). Trainable: the
prefix table (`PrefixEncoder`, no reparametrisation by default, P = 16, prefix dropout 0.1, N(0,
initializer_range) init), SimCSE's `cls` MLP (`Linear(d, d) + tanh`), and — with `mlm=True` — the LM head.
Token positions are shifted by P under the prefix as in the HF 4.x references (DCPCSE reference prefixes;
`shift_positions=False` turns the quirk off).

Per step: one prefix sample (fresh dropout) is drawn for the `B·n` flattened rows; the frozen PLM with that
prefix encodes them; CLS → MLP → contrastive loss (SimCSE: `B×B` unsup, `B×2B` sup with every in-batch hard
negative). With `mlm=True` (DCPCSE, the RoBERTa-unsup setting):

- each flattened row is masked independently (`mask_tokens`: 15 % of the non-special, non-pad tokens; of
  those 80 % → mask token, 10 % → a uniform random id over the whole vocabulary, 10 % unchanged; labels
  −100 elsewhere), so the two views of a sentence get different masks;
- the masked ids run through the same frozen encoder with the SAME prefix sample and the same
  prefix-extended mask; the LM head maps the token outputs to vocabulary logits; the loss is the
  cross-entropy mean over the masked positions;
- `loss = L_CL + λ_t · L_MLM`, `λ_t = mlm_weight · mlm_decay^(step / mlm_decay_steps)` (continuous exponent,
  `step` = completed optimiser steps; `mlm_weight_at`).

The LM head is trainable and not tied to the frozen input embeddings (DCPCSE, docs/methods-overview.md). It is loaded from the
pretrained checkpoint's MLM head (BERT: `cls.predictions`; RoBERTa: `lm_head`) through
`cse.models.loading.load_masked_lm`; a checkpoint without MLM head weights (e.g. the packaged MiniLM, a bare
`BertModel`) is refused unless `mlm_head_random_init=True`.

Evaluation embedding (DCPCSE, SimCSE): prefix always applied (dropout off in eval mode); `mlp_only_train=True`
(unsup) → CLS before the MLP (`cls_before_pooler`), False (sup) → CLS → MLP (`cls`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from cse.models.batching import TrainBatch, check_views
from cse.models.distributed import global_mean
from cse.models.heads import SimCSEPoolerMLP
from cse.models.losses import contrastive_loss
from cse.models.method import (
    METHOD_CONFIG,
    AtLeastOne,
    CSEModel,
    NonNegative,
    Positive,
    PromptConfig,
    StepOutput,
    config_dataclass,
    must_be,
)
from cse.models.prompts.backbone import PromptedModel
from cse.models.prompts.prefixes import PrefixKeyValues

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from cse.models.export.peft_plan import PeftPlan

IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------------------ config
@config_dataclass(frozen=True, config=METHOD_CONFIG)
class DCPCSEConfig(PromptConfig):
    """Model hyperparameters (defaults: DCPCSE unsupervised BERT-base, Jiang & Wang, 2022; YJiangcm/DCPCSE).

    Paper settings (DCPCSE paper): unsup BERT-base P=16, BERT-large P=10, RoBERTa-base P=14 with `mlm=True`;
    supervised runs use `mlp_only_train=False` (evaluate `cls` with the MLP) and P = 10–12.

    `shift_positions`: reproduce the HF 4.x position shift under the prefix (DCPCSE reference prefixes, docs/methods-overview.md).
    `mlm_*`: the MLM auxiliary of DCPCSE (λ_t = `mlm_weight · mlm_decay^(step / mlm_decay_steps)`).
    `mlm_head_random_init`: allow a freshly initialised LM head when `backbone` has no MLM head weights
    (otherwise such a backbone is refused with `mlm=True`); a backbone with a head always loads it.
    """

    temperature: Positive = 0.05
    mlp_only_train: bool = True
    hard_negative_weight: float = 0.0
    mlm: bool = False
    mlm_probability: Annotated[float, must_be("in (0, 1)", lambda v: 0.0 < v < 1.0)] = 0.15
    mlm_weight: NonNegative = 0.1
    mlm_decay: Annotated[float, must_be("in (0, 1]", lambda v: 0.0 < v <= 1.0)] = 0.95
    mlm_decay_steps: AtLeastOne = 100
    mlm_head_random_init: bool = False


# ------------------------------------------------------------------------------------------------ MLM pieces
def mlm_weight_at(
    step: int | torch.Tensor, weight: float = 0.1, decay: float = 0.95, decay_steps: int = 100
) -> float | torch.Tensor:
    """λ_t = weight · decay^(step / decay_steps), continuous exponent; `step` = completed optimiser steps (DCPCSE).

    `step` may be a 0-d tensor (a compiled training step gets it so, on the device, so that one graph serves every
    step); the weight is then a tensor too."""
    if isinstance(step, int) and step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return weight * decay ** (step / decay_steps)


def mask_tokens(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    special_token_ids: torch.Tensor,
    mask_token_id: int,
    vocab_size: int,
    probability: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT-style masking of `(N, T)` rows, each position independently (DCPCSE).

    Candidates are real tokens (`attention_mask == 1`) whose id is not in `special_token_ids`; each is
    selected with `probability`. Of the selected: 80 % → `mask_token_id`, 10 % → a uniform random id in
    `[0, vocab_size)`, 10 % unchanged. Returns `(masked_ids, labels)`, labels = original id at selected
    positions and −100 elsewhere. `generator` must live on the ids' device.
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    device = input_ids.device

    def uniform() -> torch.Tensor:
        return torch.rand(input_ids.shape, generator=generator, device=device)

    special = torch.isin(input_ids, special_token_ids.to(device))
    candidate = attention_mask.bool() & ~special
    selected = candidate & (uniform() < probability)
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    to_mask = selected & (uniform() < 0.8)
    to_random = selected & ~to_mask & (uniform() < 0.5)  # half of the remaining 20 %
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator, device=device, dtype=input_ids.dtype)
    masked = torch.where(to_mask, torch.full_like(input_ids, mask_token_id), input_ids)
    masked = torch.where(to_random, random_ids, masked)
    return masked, labels


class MaskedLMHead(nn.Module):
    """A pretrained PLM's MLM head as one trainable module: dense → activation → LayerNorm → decoder (DCPCSE).

    Same function as BERT's `BertLMPredictionHead` (`cls.predictions`) and RoBERTa's `RobertaLMHead`
    (`lm_head`). The decoder weight is a copy, not tied to the frozen input embeddings (DCPCSE, docs/methods-overview.md), and its
    bias is the checkpoint's output bias, held once (no shared tensors, so checkpoints save it plainly).
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        activation: nn.Module,
        layer_norm_eps: float = 1e-12,
        init_std: float = 0.02,
    ):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.activation = activation
        self.layer_norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.decoder = nn.Linear(hidden_size, vocab_size)
        for linear in (self.dense, self.decoder):  # a fresh head gets the backbone's `_init_weights` init
            nn.init.normal_(linear.weight, mean=0.0, std=init_std)
            nn.init.zeros_(linear.bias)

    @classmethod
    def fresh(cls, config: PretrainedConfig, input_embeddings: torch.Tensor | None = None) -> MaskedLMHead:
        """A newly initialised head for an HF encoder config (only with `mlm_head_random_init=True`).

        Dense/decoder N(0, initializer_range), zero biases, LayerNorm (1, 0). `input_embeddings` (`(V, d)`), when
        given, is copied into the decoder weight: the starting point an HF masked LM built on a head-less
        checkpoint has (its decoder is tied to the input embeddings), here as an untied trainable copy.
        """
        head = cls(
            config.hidden_size,
            config.vocab_size,
            ACT2FN[config.hidden_act],
            layer_norm_eps=getattr(config, "layer_norm_eps", 1e-12),
            init_std=getattr(config, "initializer_range", 0.02),
        )
        if input_embeddings is not None:
            with torch.no_grad():
                head.decoder.weight.copy_(input_embeddings)
        return head

    @classmethod
    def from_hf_head(cls, head: Any) -> MaskedLMHead:
        """Copy the weights of a `BertLMPredictionHead` or a `RobertaLMHead` (checkpoint values preserved); `head`
        is either class (no common type: their submodules are read by name)."""
        if hasattr(head, "transform"):  # BERT family: transform.{dense, transform_act_fn, LayerNorm}
            dense, act, norm = head.transform.dense, head.transform.transform_act_fn, head.transform.LayerNorm
        elif hasattr(head, "dense") and hasattr(head, "layer_norm"):  # RoBERTa family (gelu hard-coded there)
            dense, act, norm = head.dense, ACT2FN["gelu"], head.layer_norm
        else:
            raise TypeError(f"unsupported MLM head {type(head).__name__}: expected a BERT or RoBERTa LM head")
        if isinstance(act, str):
            act = ACT2FN[act]
        bias = head.bias if getattr(head, "bias", None) is not None else head.decoder.bias
        hidden, vocab = dense.in_features, head.decoder.out_features
        new = cls(hidden, vocab, copy.deepcopy(act), layer_norm_eps=norm.eps)
        with torch.no_grad():
            new.dense.weight.copy_(dense.weight)
            new.dense.bias.copy_(dense.bias)
            new.layer_norm.weight.copy_(norm.weight)
            new.layer_norm.bias.copy_(norm.bias)
            new.decoder.weight.copy_(head.decoder.weight)
            new.decoder.bias.copy_(bias)
        return new

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(self.activation(self.dense(hidden_states))))


def _hf_mlm_head(masked_lm: nn.Module) -> tuple[nn.Module, str]:
    """The MLM head submodule of an HF masked LM and its state-dict prefix."""
    if hasattr(masked_lm, "cls") and hasattr(masked_lm.cls, "predictions"):
        return masked_lm.get_submodule("cls.predictions"), "cls.predictions."
    if hasattr(masked_lm, "lm_head"):
        return masked_lm.get_submodule("lm_head"), "lm_head."
    raise TypeError(f"{type(masked_lm).__name__} has no BERT (`cls.predictions`) or RoBERTa (`lm_head`) MLM head")


def mlm_head_from_masked_lm(masked_lm: nn.Module, missing_keys: Iterable[str] = ()) -> MaskedLMHead:
    """The trainable copy of a masked LM's head. `missing_keys` (from `output_loading_info`) naming head
    weights other than the (tied) decoder means the checkpoint had no MLM head: `ValueError`."""
    head, prefix = _hf_mlm_head(masked_lm)
    tied = (prefix + "decoder.weight", prefix + "decoder.bias")
    absent = sorted(k for k in missing_keys if k.startswith(prefix) and k not in tied)
    if absent:
        raise ValueError(
            f"the checkpoint has no MLM head weights (missing {absent}); DCPCSE's MLM auxiliary "
            "loads the pretrained head (YJiangcm/DCPCSE). Use a checkpoint with its MLM head "
            "(e.g. bert-base-uncased, roberta-base) or set mlm_head_random_init=True for a fresh head"
        )
    return MaskedLMHead.from_hf_head(head)


def _word_embeddings(backbone: PreTrainedModel) -> nn.Embedding:
    """`backbone.embeddings.word_embeddings`, the word-embedding table of the families with an MLM head here."""
    return cast(nn.Embedding, backbone.get_submodule("embeddings.word_embeddings"))


def load_mlm_head(config: DCPCSEConfig, backbone: PreTrainedModel) -> MaskedLMHead:
    """The pretrained MLM head of `config.backbone` (DCPCSE), or — if it has none and `mlm_head_random_init` allows
    it — a fresh head whose decoder starts from a copy of `backbone`'s input embeddings (`MaskedLMHead.fresh`)."""
    from cse.models.loading import load_masked_lm

    backbone_config = backbone.config

    loaded = load_masked_lm(config.backbone, output_loading_info=True)
    masked_lm, info = cast("tuple[PreTrainedModel, dict[str, list[str]]]", loaded)  # with output_loading_info
    try:
        head = mlm_head_from_masked_lm(masked_lm, info.get("missing_keys", ()))
    except ValueError as e:
        if not config.mlm_head_random_init:
            raise ValueError(f"{config.backbone!r}: {e}") from e
        return MaskedLMHead.fresh(backbone_config, _word_embeddings(backbone).weight.detach())
    if head.decoder.out_features != backbone_config.vocab_size or head.dense.in_features != backbone_config.hidden_size:
        raise ValueError(
            f"{config.backbone!r}: MLM head shape (d={head.dense.in_features}, V={head.decoder.out_features}) "
            f"does not fit the backbone (d={backbone_config.hidden_size}, V={backbone_config.vocab_size})"
        )
    return head


# ------------------------------------------------------------------------------------------------ model
@dataclass
class DCPCSEOutput:
    """Losses of one training forward; `z` is the `(B, n, d)` MLP output."""

    loss: torch.Tensor
    contrastive_loss: torch.Tensor
    mlm_loss: torch.Tensor | None
    mlm_weight: float | torch.Tensor
    z: torch.Tensor


class DCPCSE(PromptedModel, CSEModel):
    """DCPCSE: deep continuous prompts (a trainable prefix at every layer) on a frozen PLM, trained with SimCSE's
    contrastive loss through its `cls` MLP, with an optional MLM auxiliary loss (a trainable LM head, `mlm=True`).

    Paper: Yuxin Jiang and Wei Wang (2022). Deep Continuous Prompt for Contrastive Learning of Sentence Embeddings.
    arXiv:2203.06875 (reference code: the DCPCSE repository). Only the prompts (0.1 % of BERT-base's parameters)
    and the MLP train; `embed` is the CLS state (unsupervised, `mlp_only_train=True`) or CLS → MLP (supervised).

    Args:
        config: the model hyperparameters (`DCPCSEConfig`; defaults: unsupervised BERT-base).
        backbone: an already built HF encoder; None loads `config.backbone`.
        tokenizer: attached for evaluation and needed for MLM masking (special and mask ids).
        mlm_head: an already built module mapping `(N, T, d)` token states to `(N, T, V)` logits, used instead of
            loading the pretrained head (tests).

    Examples:
        >>> from cse.config.methods import build_model
        >>> from cse.models.batching import pad_sequences
        >>> model = build_model("dcpcse", {"backbone": "packaged:minilm", "prefix_len": 16}).eval()
        >>> ids, mask = pad_sequences(model.token_ids(["A man is playing a guitar."]), model.pad_token_id)
        >>> model.embed(ids, mask).shape
        torch.Size([1, 384])
    """

    method = "dcpcse"
    title = "DCPCSE"
    summary = "deep prompts on a frozen PLM (optional MLM auxiliary loss)"
    config_class = DCPCSEConfig
    config: DCPCSEConfig
    special_token_ids: torch.Tensor  # a buffer
    paper = (
        "Yuxin Jiang and Wei Wang (2022). Deep Continuous Prompt for Contrastive Learning of Sentence "
        "Embeddings. arXiv:2203.06875."
    )
    bibtex = """@article{jiang2022dcpcse,
  title   = {Deep Continuous Prompt for Contrastive Learning of Sentence Embeddings},
  author  = {Jiang, Yuxin and Wang, Wei},
  journal = {arXiv preprint arXiv:2203.06875},
  year    = {2022}
}"""
    builds_on = ("simcse",)

    def __init__(
        self,
        config: DCPCSEConfig,
        backbone: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        mlm_head: nn.Module | None = None,
    ) -> None:
        super().__init__()
        bcfg = self.attach_prompted_backbone(config, backbone, tokenizer)
        d = bcfg.hidden_size
        init_std = getattr(bcfg, "initializer_range", 0.02)
        self.mlp = SimCSEPoolerMLP(d, init_std=init_std)

        self.lm_head: nn.Module | None = None
        self.mask_token_id: int | None = None
        self.register_buffer("special_token_ids", torch.zeros(0, dtype=torch.long), persistent=False)
        if config.mlm:
            self.lm_head = mlm_head if mlm_head is not None else load_mlm_head(config, self.backbone)
            self.lm_head.requires_grad_(True)
            if self.tokenizer is not None:
                self.mask_token_id = self.tokenizer.mask_token_id
                specials = sorted(
                    set(self.tokenizer.all_special_ids) | {i for i in (self.tokenizer.pad_token_id,) if i is not None}
                )
                self.special_token_ids = torch.tensor(specials, dtype=torch.long)

    # --------------------------------------------------------------------------------- properties

    @property
    def evaluation_pooler(self) -> str:
        return "cls_before_pooler" if self.config.mlp_only_train else "cls"

    # --------------------------------------------------------------------------------- passes
    def mask_for_mlm(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(masked_ids, labels)` of `(N, T)` rows, each row masked independently (DCPCSE; see `mask_tokens`).

        Excluded: padding and the tokenizer's special ids; random replacements are uniform over the backbone's
        `vocab_size` (= `len(tokenizer)` of the reference collator for the paper's backbones).
        """
        if self.mask_token_id is None:
            raise ValueError(
                "MLM masking needs the tokenizer's mask and special-token ids: build DCPCSE with a tokenizer"
            )
        return mask_tokens(
            input_ids,
            attention_mask,
            self.special_token_ids,
            self.mask_token_id,
            self.backbone.config.vocab_size,
            self.config.mlm_probability,
            generator=generator,
        )

    def mlm_terms(
        self,
        masked_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        prefix: PrefixKeyValues,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(Σ cross-entropy, count)` over the masked positions of the LM head on the prompted encoder's token states.

        Only the masked positions go through the head (the same loss and gradients as running it on every
        token, without the `(N, T, V)` logits). The MLM loss is the sum over the count (`mlm_loss`); the two parts
        let a chunked step (grad_cache) add the chunks' sums before dividing by the batch's count.
        """
        if self.lm_head is None:
            raise ValueError("this DCPCSE model was built with mlm=False")
        states = self.encoder(masked_ids, attention_mask, token_type_ids, prefix=prefix).last_hidden_state
        selected = labels != IGNORE_INDEX
        logits = self.lm_head(states[selected].unsqueeze(0)).squeeze(0)  # heads expect (N, T, d)
        total = F.cross_entropy(logits.float(), labels[selected], reduction="sum")
        return total, selected.sum()

    def mlm_loss(
        self,
        masked_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        prefix: PrefixKeyValues,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Cross-entropy mean over the masked positions (of the global batch under distributed training); no masked
        position at all → a zero loss on the graph."""
        return global_mean(*self.mlm_terms(masked_ids, attention_mask, labels, prefix, token_type_ids))

    def encode_rows(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The per-row pass of a training step on `(B', T)` rows: CLS states, and with `mlm` the MLM sum and count.

        One prefix sample (fresh dropout) serves the contrastive pass and the MLM pass of the same rows, and every row
        is masked independently, so the rows can be encoded in chunks (grad_cache) with the same objective.
        """
        prefix = self.prompts(input_ids.shape[0])
        cls = self.encode_cls(input_ids, attention_mask, token_type_ids, prefix=prefix)
        if not self.config.mlm:
            return cls, None, None
        masked_ids, labels = self.mask_for_mlm(input_ids, attention_mask)
        total, count = self.mlm_terms(masked_ids, attention_mask, labels, prefix, token_type_ids)
        return cls, total, count

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        step: int | torch.Tensor = 0,
        token_type_ids: torch.Tensor | None = None,
    ) -> DCPCSEOutput:
        """One training forward on `(B, n, T)` rows, n = 2 (unsup, two dropout views) or 3 (sup, hard negative)."""
        check_views(input_ids, attention_mask)
        batch, n, length = input_ids.shape
        rows = batch * n
        ids, mask = input_ids.reshape(rows, length), attention_mask.reshape(rows, length)
        types = None if token_type_ids is None else token_type_ids.reshape(rows, length)

        # whole, or in cached chunks of rows under grad_cache (models/grad_cache.py); MLM sums and counts add up
        cls, mlm_total, mlm_count = self.row_chunks.map(self.encode_rows, ids, mask, types)
        z = self.mlp(cls).view(batch, n, -1)
        l_cl = contrastive_loss(
            *z.unbind(1), temperature=self.config.temperature, hard_negative_weight=self.config.hard_negative_weight
        )
        if not self.config.mlm:
            return DCPCSEOutput(loss=l_cl, contrastive_loss=l_cl, mlm_loss=None, mlm_weight=0.0, z=z)

        l_mlm = global_mean(mlm_total, mlm_count)
        weight = mlm_weight_at(step, self.config.mlm_weight, self.config.mlm_decay, self.config.mlm_decay_steps)
        return DCPCSEOutput(loss=l_cl + weight * l_mlm, contrastive_loss=l_cl, mlm_loss=l_mlm, mlm_weight=weight, z=z)

    def training_step(self, batch: TrainBatch, step: int | torch.Tensor = 0, phase: str = "main") -> StepOutput:
        out = self(batch.input_ids, batch.attention_mask, step=step)
        metrics = {"loss_contrastive": out.contrastive_loss.detach()}
        if out.mlm_loss is not None:
            metrics["loss_mlm"] = out.mlm_loss.detach()
            metrics["mlm_weight"] = torch.as_tensor(out.mlm_weight, dtype=torch.float32, device=out.loss.device)
        return StepOutput(out.loss, metrics)

    def embed(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Evaluation embedding `(B, d)` with prompts on: CLS (unsup) or CLS → MLP (sup) (SimCSE, DCPCSE)."""
        cls = self.encode_cls(input_ids, attention_mask, token_type_ids)
        return cls if self.config.mlp_only_train else self.mlp(cls)

    def peft_plan(self, plan: PeftPlan) -> PeftPlan:
        """The PEFT adapter: CLS pooling (unsupervised), or the supervised `cls` MLP carried as the base's pooler."""
        cfg = self.config
        if cfg.mlp_only_train:
            plan.notes.append(
                "training-heads: DCPCSE's cls MLP"
                + (" and LM head are" if cfg.mlm else " is")
                + " training-only (mlp_only_train) and not exported"
            )
            return plan
        plan.pooling = {"kind": "pooler_output"}
        plan.modules_to_save.append("pooler")
        plan.pooler_mlp = self.mlp
        plan.notes.append(
            "pooler-mlp: the supervised cls MLP (Linear + tanh on the first token) is carried as "
            "the base model's pooler (modules_to_save=['pooler']); embed with pooler_output, which "
            "needs the base loaded with its pooling layer (AutoModel's default)"
        )
        if cfg.mlm:
            plan.notes.append("training-heads: the MLM LM head is training-only and not exported")
        return plan

    def describe(self) -> dict:
        return {
            **super().describe(),
            "prefix_len": self.config.prefix_len,
            "prefix_projection": self.config.prefix_projection,
            "mlp_only_train": self.config.mlp_only_train,
            "mlm": self.config.mlm,
            "train_prompts": self.config.train_prompts,
            "trainable_parameters": self.trainable_parameter_count(),
        }

    # --- for the benchmarks (benchmarks/dry_run.py, gpu_check.py) ---
    @classmethod
    def random_backbone_kwargs(cls, config: DCPCSEConfig, backbone: PreTrainedModel) -> dict:
        """Constructor arguments for a random-initialised backbone (benchmarks/dry_run.py, gpu_check.py): with `mlm`,
        a fresh LM head of the pretrained head's shape and parameter count (there is no pretrained head to load)."""
        if not config.mlm:
            return {}
        return {"mlm_head": MaskedLMHead.fresh(backbone.config, _word_embeddings(backbone).weight.detach())}
