"""D2CSE: shared deep prompts on a frozen PLM that is both sentence encoder and conditional discriminator (Lee, 2023).

Per step (D2CSE paper): the frozen PLM with prompts encodes the `(B·n, T)` rows; CLS → BN-MLP → `h`
(contrastive vector and conditioning vector, not detached). The same PLM with the same prompt module then runs
on the corrupted ids with the embedding-layer output at position 0 replaced by `h`; an RTD head on its last
hidden states gives `L_CRTD`. `L = L_CL + λ·L_CRTD`. Evaluation embedding: CLS before the pooler, prompts on.

Ablations of the D2CSE paper (Fig. 3 / Table 6) are configuration switches:
(a) `discriminator_prompts=False` — the frozen PLM without prompts as discriminator (a separate frozen copy
    computes exactly the same function, so the shared frozen module is reused), conditioned on `h`;
(b) as (a) plus `train_discriminator=True` — a trainable copy of the PLM as discriminator, in its own AdamW group at
    `discriminator_learning_rate` (default 7e-6, DiffCSE's discriminator LR; the paper states none);
(c) `condition_discriminator=False` — shared prompts, the discriminator sees its ordinary [CLS] input;
(d) defaults — shared prompts + conditioning = D2CSE.

The objective shared with DiffCSE is `cse.models.methods.crtd.ConditionalRTDModel`; this module says how D2CSE encodes the
rows (frozen PLM + prompts) and how its discriminator (the same PLM, by default with the same prompts) reads them.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, cast

import torch
from pydantic import model_validator
from torch import nn

from cse.models.heads import ProjectionMLP, RTDHead
from cse.models.loading import word_embeddings
from cse.models.method import METHOD_CONFIG, MethodConfig, PromptConfig, config_dataclass
from cse.models.methods.crtd import ConditionalRTDModel, check_objective
from cse.models.prompts.backbone import PromptedBackbone, PromptedModel
from cse.models.prompts.prefixes import PrefixKeyValues

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from cse.models.export.peft_plan import PeftPlan


@config_dataclass(frozen=True, config=METHOD_CONFIG)
class D2CSEModelConfig(PromptConfig):
    """Model hyperparameters (defaults: D2CSE unsupervised BERT-base, Lee, 2023, Table 7)."""

    cls_prompt: bool = False
    temperature: float = 0.05
    rtd_weight: float = 0.005
    rtd_mean_over_padding: bool = True
    hard_negative_weight: float = 0.0
    discriminator_prompts: bool = True
    condition_discriminator: bool = True
    train_discriminator: bool = False
    # Ablation (b) only: the trainable discriminator's own AdamW learning rate. The D2CSE paper gives none; DiffCSE
    # trains the same kind of discriminator (a full BERT-base copy) at its encoder LR, 7e-6 (DiffCSE paper), whereas
    # the prompt LR (0.021 / 0.055) would be ~3,000x that.
    discriminator_learning_rate: float = 7e-6
    discriminator_reuses_prefix_sample: bool = False
    # The BN-MLP and RTD head train at the job's (prompt) learning rate, the paper's single LR; a value here puts them
    # in an AdamW group of their own (a sensitivity knob: at 0.021 the first Adam steps re-randomise the fresh head).
    head_learning_rate: float | None = None

    @model_validator(mode="after")
    def _check(self) -> D2CSEModelConfig:
        check_objective(self.temperature, self.rtd_weight)
        if self.discriminator_learning_rate <= 0:
            raise ValueError(f"discriminator_learning_rate must be positive, got {self.discriminator_learning_rate}")
        if self.head_learning_rate is not None and not self.head_learning_rate > 0:
            raise ValueError(
                f"head_learning_rate must be positive (or None: the job's rate), got {self.head_learning_rate}"
            )
        if self.discriminator_reuses_prefix_sample and not self.discriminator_prompts:
            raise ValueError("discriminator_reuses_prefix_sample needs discriminator_prompts=True")
        return self


class D2CSE(PromptedModel, ConditionalRTDModel):
    """D2CSE: a frozen PLM with one shared deep-prompt module that is both the sentence encoder and the conditional
    replaced-token discriminator, plus a BN-MLP and an RTD head (and an optional trainable [CLS] prompt).

    Paper: Hyunjae Lee (2023). D2CSE: Difference-aware Deep continuous prompts for Contrastive Sentence Embeddings.
    arXiv:2304.08991. It builds on DCPCSE's deep prompts, DiffCSE's conditional replaced-token detection and
    SimCSE's contrastive objective. The loss is `L_CL + rtd_weight · L_CRTD` on the corruption stage's replaced
    tokens; `embed` (the evaluation embedding) is the CLS state before the pooler, prompts on.

    Args:
        config: the model hyperparameters (`D2CSEModelConfig`; defaults: unsupervised BERT-base, paper Table 7).
        backbone: an already built HF encoder; None loads `config.backbone`.
        tokenizer: attached for evaluation; loaded from `config.backbone` when the backbone is loaded here.
        cls_token_id: the embedding row that initialises the [CLS] prompt (default: the tokenizer's [CLS]).

    Examples:
        >>> from cse.config.methods import build_model
        >>> from cse.models.batching import pad_sequences
        >>> model = build_model("d2cse", {"backbone": "packaged:minilm", "prefix_len": 16}).eval()
        >>> ids, mask = pad_sequences(model.token_ids(["A man is playing a guitar."]), model.pad_token_id)
        >>> model.embed(ids, mask).shape
        torch.Size([1, 384])
    """

    def __init__(
        self,
        config: D2CSEModelConfig,
        backbone: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        cls_token_id: int | None = None,
    ) -> None:
        super().__init__()
        bcfg = self.attach_prompted_backbone(config, backbone, tokenizer)
        d = bcfg.hidden_size
        init_std = getattr(bcfg, "initializer_range", 0.02)

        if config.cls_prompt:
            if cls_token_id is None:
                cls_token_id = getattr(self.tokenizer, "cls_token_id", None)
            if cls_token_id is None:
                raise ValueError("cls_prompt=True needs the [CLS] id (pass a tokenizer or cls_token_id)")
            row = word_embeddings(self.backbone).weight[cls_token_id]
            self.cls_prompt = nn.Parameter(row.detach().clone().float(), requires_grad=config.train_prompts)

        self.projection = ProjectionMLP(d, init_std=init_std)
        self.rtd_head = RTDHead(d)

        self.discriminator: PromptedBackbone | None = None
        if config.train_discriminator:
            copy_ = copy.deepcopy(self.backbone).requires_grad_(True)
            self.discriminator = PromptedBackbone(copy_, None, shift_positions=config.shift_positions)

    method = "d2cse"
    title = "D2CSE"
    summary = "deep prompts on a frozen PLM that is also the CRTD discriminator (optional [CLS] prompt)"
    config_class = D2CSEModelConfig
    config: D2CSEModelConfig
    paper = (
        "Hyunjae Lee (2023). D2CSE: Difference-aware Deep continuous prompts for Contrastive Sentence "
        "Embeddings. arXiv:2304.08991."
    )
    bibtex = """@article{lee2023d2cse,
  title   = {{D2CSE}: Difference-aware Deep continuous prompts for Contrastive Sentence Embeddings},
  author  = {Lee, Hyunjae},
  journal = {arXiv preprint arXiv:2304.08991},
  year    = {2023}
}"""
    builds_on = ("dcpcse", "diffcse", "simcse")  # deep prompts, conditional RTD, the contrastive framework
    # The paper's ablation (Table 6, Fig. 3): variant → model fields; flows/ablate.py runs each with the [CLS] prompt
    # on and off. (a) prompts on the encoder only, the frozen PLM conditioned on h as discriminator; (b) as (a) with
    # a trainable copy of the PLM as discriminator; (c) shared prompts, no conditional input; (d) both = D2CSE.
    ablations = {
        "a": {"discriminator_prompts": False, "condition_discriminator": True, "train_discriminator": False},
        "b": {"discriminator_prompts": False, "condition_discriminator": True, "train_discriminator": True},
        "c": {"discriminator_prompts": True, "condition_discriminator": False, "train_discriminator": False},
        "d": {"discriminator_prompts": True, "condition_discriminator": True, "train_discriminator": False},
    }

    # --------------------------------------------------------------------------------- passes
    def discriminate(
        self,
        corrupted_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        h: torch.Tensor | None,
        token_type_ids: torch.Tensor | None = None,
        prefix: PrefixKeyValues | None = None,
    ) -> torch.Tensor:
        """RTD logits `(B', T, 2)` of the discriminator on corrupted ids, position 0 conditioned on `h` if given."""
        use_prompts = self.config.discriminator_prompts
        if use_prompts and prefix is None:
            prefix = self.prompts(corrupted_ids.shape[0])
        body = self.discriminator if self.discriminator is not None else self.encoder
        out = body(
            corrupted_ids,
            attention_mask,
            token_type_ids,
            prefix=prefix if use_prompts else False,
            cls_embedding=self.cls_prompt if use_prompts else None,
            position0_output=h,
            unpadded=not self.config.rtd_mean_over_padding,  # the RTD mean over padding reads every pad position
        )
        return self.rtd_head(out.last_hidden_state)

    def encode_rows(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, PrefixKeyValues]:
        """Training encoder pass with one prefix sample for all rows; the sample is the context."""
        prefix = self.prompts(input_ids.shape[0])
        return self.encode_cls(input_ids, attention_mask, token_type_ids, prefix=prefix), prefix

    def discriminate_rows(
        self,
        corrupted_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        h: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        context: PrefixKeyValues,
    ) -> torch.Tensor:
        """Conditioned on `h` unless ablation (c); a fresh prefix sample unless `discriminator_reuses_prefix_sample`."""
        return self.discriminate(
            corrupted_ids,
            attention_mask,
            h if self.config.condition_discriminator else None,
            token_type_ids,
            prefix=context if self.config.discriminator_reuses_prefix_sample else None,
        )

    @classmethod
    def grad_cache_refusal(cls, config: MethodConfig) -> str | None:
        """`discriminator_reuses_prefix_sample` hands the encoder pass's prefix sample of every row to the
        discriminator pass; the cached chunks draw and drop their samples one chunk at a time."""
        if cast(D2CSEModelConfig, config).discriminator_reuses_prefix_sample:  # D2CSE's own config
            return (
                "discriminator_reuses_prefix_sample=True reuses the encoder pass's prefix sample of the whole batch in "
                "the discriminator pass, and cached chunks keep no sample beyond their own pass (the default, a fresh "
                "prefix sample for the discriminator pass, is cached exactly)"
            )
        return None

    def parameter_groups(self, phase: str) -> list[dict]:
        """Prompts, [CLS] prompt, BN-MLP and RTD head at the job's LR; ablation (b)'s trainable discriminator in a group of
        its own at `discriminator_learning_rate`; the BN-MLP and RTD head in one at `head_learning_rate` when set."""
        cfg, own = self.config, []
        if cfg.head_learning_rate is not None:
            own.append(("head", [self.projection, self.rtd_head], cfg.head_learning_rate))
        if self.discriminator is not None:
            own.append(("discriminator", [self.discriminator], cfg.discriminator_learning_rate))
        return self.rate_groups(phase, own)

    def embed(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Evaluation embedding `(B, d)`: CLS before the pooler with prompts active (SimCSE, D2CSE paper)."""
        return self.encode_cls(input_ids, attention_mask, token_type_ids)

    def peft_plan(self, plan: PeftPlan) -> PeftPlan:
        """The PEFT adapter: CLS pooling; the [CLS] prompt, if any, folded into a position-embedding row."""
        plan.notes.append(
            "training-heads: D2CSE's BN-MLP, RTD head and discriminator are training-only and not "
            "exported (evaluation uses the CLS state before the pooler)"
        )
        if self.cls_prompt is not None:
            self._fold_cls_prompt(plan)
        return plan

    def _fold_cls_prompt(self, plan: PeftPlan) -> None:
        """Fold the [CLS] prompt into the position-embedding row that only position 0 reads under PEFT's prefix shift
        (models/export/peft_export.py's module docstring)."""
        enc, backbone = self.encoder, self.backbone
        embeddings = backbone.get_submodule("embeddings")
        position_embeddings = getattr(embeddings, "position_embeddings", None)
        cls_id = getattr(self.tokenizer, "cls_token_id", None)
        absolute = getattr(backbone.config, "position_embedding_type", "absolute") == "absolute"
        if cls_id is None or not absolute or not isinstance(position_embeddings, nn.Embedding):
            plan.inexact.append(
                "cls-prompt: the [CLS] prompt cannot be folded into an absolute position-embedding row "
                f"of {type(backbone).__name__}; the adapter would use the static [CLS] embedding"
            )
            return
        probe = torch.tensor([[cls_id, cls_id]], device=position_embeddings.weight.device)
        row = int(enc.position_ids(probe, self.prompts.prefix_len)[0, 0])  # PEFT always shifts by P
        plan.cls_fold = (row, int(cls_id))
        plan.modules_to_save.append("embeddings.position_embeddings")
        plan.notes.append(
            f"cls-prompt: the [CLS] prompt is folded into position-embedding row {row}, which only position 0 reads "
            "under the prefix shift (modules_to_save=['embeddings.position_embeddings'], + max_position_embeddings x d "
            "floats); exact for right-padded input that starts with the tokenizer's [CLS] (add_special_tokens=True)"
            + (
                "; RoBERTa numbers positions by non-pad tokens, so left padding would move the fold off column 0"
                if hasattr(embeddings, "create_position_ids_from_input_ids")
                else ""
            )
        )

    def describe(self) -> dict:
        return {
            **super().describe(),
            "prefix_len": self.config.prefix_len,
            "cls_prompt": self.config.cls_prompt,
            "rtd_weight": self.config.rtd_weight,
            "train_prompts": self.config.train_prompts,
        }
