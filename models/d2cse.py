"""D2CSE: shared deep prompts on a frozen PLM that is both sentence encoder and conditional discriminator (methods.md §5).

Per step (§5 "Concrete reading"): the frozen PLM with prompts encodes the `(B·n, T)` rows; CLS → BN-MLP → `h`
(contrastive vector and conditioning vector, not detached). The same PLM with the same prompt module then runs
on the corrupted ids with the embedding-layer output at position 0 replaced by `h`; an RTD head on its last
hidden states gives `L_CRTD`. `L = L_CL + λ·L_CRTD`. Evaluation embedding: CLS before the pooler, prompts on.

Ablations of §5 (Fig. 3 / Table 6) are configuration switches:
(a) `discriminator_prompts=False` — the frozen PLM without prompts as discriminator (a separate frozen copy
    computes exactly the same function, so the shared frozen module is reused), conditioned on `h`;
(b) as (a) plus `train_discriminator=True` — a trainable copy of the PLM as discriminator;
(c) `condition_discriminator=False` — shared prompts, the discriminator sees its ordinary [CLS] input;
(d) defaults — shared prompts + conditioning = D2CSE.

The objective shared with DiffCSE (models/diffcse.py) lives here too: `ConditionalRTDModel` is the base of
both (shape checks, RTD label defaulting, contrastive + conditional-RTD loss, `training_step`); a subclass
only says how the training rows are encoded and how its discriminator reads the corrupted rows.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.batching import TrainBatch
from models.heads import ProjectionMLP, RTDHead
from models.losses import contrastive_loss, rtd_accuracy, rtd_loss
from models.method import CSEModel, MethodConfig, StepOutput, drop_pooler, load_backbone
from models.prefix import PrefixEncoder, PrefixKeyValues, PromptedBackbone


def check_objective(temperature: float, rtd_weight: float) -> None:
    """Validation of the hyperparameters every contrastive + conditional-RTD config has (τ, λ)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if rtd_weight < 0:
        raise ValueError(f"rtd_weight must be >= 0, got {rtd_weight}")


def align_corruption(input_ids: torch.Tensor, attention_mask: torch.Tensor, corrupted_ids: torch.Tensor,
                     rtd_labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked `(B, n, T)` corrupted ids and RTD labels for `(B, n, T)` rows, n = 2 (unsup) or 3 (sup).

    `corrupted_ids` / `rtd_labels` may be `(B, n, T)` or `(B, 1, T)` (one corruption shared by every view).
    Labels default to `corrupted != original` on non-pad positions (§4 step 4).
    """
    if input_ids.dim() != 3 or input_ids.shape[1] not in (2, 3):
        raise ValueError(f"input_ids must be (B, 2|3, T), got {tuple(input_ids.shape)}")
    batch, n, length = input_ids.shape
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if corrupted_ids is None:
        raise ValueError("corrupted_ids are required (the corruption stage's output)")
    if corrupted_ids.dim() != 3 or corrupted_ids.shape[0] != batch or corrupted_ids.shape[1] not in (1, n) \
            or corrupted_ids.shape[2] != length:
        raise ValueError(f"corrupted_ids must be (B, {n}|1, T) = ({batch}, {n}|1, {length}), got {tuple(corrupted_ids.shape)}")
    corrupted_ids = corrupted_ids.expand(batch, n, length)
    if rtd_labels is None:
        rtd_labels = (corrupted_ids != input_ids) & attention_mask.bool()
    elif rtd_labels.shape not in (corrupted_ids.shape, (batch, 1, length)):
        raise ValueError(f"rtd_labels must be (B, {n}|1, T), got {tuple(rtd_labels.shape)}")
    return corrupted_ids, rtd_labels.expand(batch, n, length)


@dataclass
class CRTDOutput:
    """Losses of one training forward; `h` is the `(B, n, d)` BN-MLP output."""

    loss: torch.Tensor
    contrastive_loss: torch.Tensor
    rtd_loss: torch.Tensor
    rtd_accuracy: torch.Tensor
    h: torch.Tensor


D2CSEOutput = CRTDOutput  # the name D2CSE's callers know


class ConditionalRTDModel(CSEModel):
    """Contrastive loss on the BN-MLP output `h` plus conditional RTD on precomputed corruptions (§4, §5).

    Per step on `(B, n, T)` rows flattened to `(B·n, T)`: `encode_rows` → CLS states → `self.projection`
    (BN-MLP over all B·n rows together) → `h` (contrastive vector and conditioning vector, not detached);
    contrastive loss on `h` (hard negatives when n = 3); `discriminate_rows` → RTD logits `(B·n, T, 2)` on
    the corrupted rows; `L = L_CL + λ·L_RTD` with the RTD mean over all positions (padding included) unless
    `rtd_mean_over_padding=False`. The config must carry `temperature`, `rtd_weight`,
    `hard_negative_weight` and `rtd_mean_over_padding`; subclasses set `projection` and `rtd_head`.
    """

    uses_corruption = True
    evaluation_pooler = "cls_before_pooler"
    projection: ProjectionMLP
    rtd_head: RTDHead

    @abstractmethod
    def encode_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_type_ids: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """Last-layer CLS states `(B', d)` of the training pass, and a context handed to `discriminate_rows`."""

    @abstractmethod
    def discriminate_rows(self, corrupted_ids: torch.Tensor, attention_mask: torch.Tensor, h: torch.Tensor,
                          token_type_ids: torch.Tensor | None, context: Any) -> torch.Tensor:
        """RTD logits `(B', T, 2)` of the training pass's discriminator on `(B', T)` corrupted rows given `h`."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, corrupted_ids: torch.Tensor,
                rtd_labels: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None) -> CRTDOutput:
        """One training forward on `(B, n, T)` rows, n = 2 (unsup, two dropout views) or 3 (sup, with hard negative).

        `corrupted_ids` / `rtd_labels`: `(B, n, T)`, or `(B, 1, T)` for one corruption shared by every view.
        Labels default to `corrupted != original` on non-pad positions (§4 step 4).
        """
        corrupted_ids, rtd_labels = align_corruption(input_ids, attention_mask, corrupted_ids, rtd_labels)
        batch, n, length = input_ids.shape
        rows = batch * n
        flat = lambda t: None if t is None else t.reshape(rows, length)  # noqa: E731
        ids, mask, types = flat(input_ids), flat(attention_mask), flat(token_type_ids)

        cls, context = self.encode_rows(ids, mask, types)
        h = self.projection(cls)
        z = h.view(batch, n, -1)
        cfg = self.config
        l_cl = contrastive_loss(z[:, 0], z[:, 1], z[:, 2] if n == 3 else None,
                                temperature=cfg.temperature, hard_negative_weight=cfg.hard_negative_weight)

        logits = self.discriminate_rows(flat(corrupted_ids), mask, h, types, context)
        labels = flat(rtd_labels)
        l_rtd = rtd_loss(logits, labels, mask, mean_over_padding=cfg.rtd_mean_over_padding)
        with torch.no_grad():
            acc = rtd_accuracy(logits, labels, mask)
        return CRTDOutput(loss=l_cl + cfg.rtd_weight * l_rtd, contrastive_loss=l_cl, rtd_loss=l_rtd,
                          rtd_accuracy=acc, h=z)

    def training_step(self, batch: TrainBatch, step: int = 0, phase: str = "main") -> StepOutput:
        out = self(batch.input_ids, batch.attention_mask, batch.corrupted_ids, batch.rtd_labels)
        return StepOutput(out.loss, {"loss_contrastive": out.contrastive_loss.detach(), "loss_rtd": out.rtd_loss.detach(),
                                     "rtd_accuracy": out.rtd_accuracy})


@dataclass(frozen=True)
class D2CSEModelConfig(MethodConfig):
    """Model hyperparameters (defaults: D2CSE unsupervised BERT-base, methods.md §5 Table 7 and §1.4)."""

    prefix_len: int = 16
    prefix_dropout: float = 0.1
    prefix_projection: bool = False
    prefix_hidden: int = 512
    cls_prompt: bool = False
    temperature: float = 0.05
    rtd_weight: float = 0.005
    shift_positions: bool = True
    rtd_mean_over_padding: bool = True
    hard_negative_weight: float = 0.0
    discriminator_prompts: bool = True
    condition_discriminator: bool = True
    train_discriminator: bool = False
    discriminator_reuses_prefix_sample: bool = False

    def __post_init__(self):
        if self.prefix_len < 1:
            raise ValueError(f"prefix_len must be >= 1, got {self.prefix_len}")
        if not 0.0 <= self.prefix_dropout < 1.0:
            raise ValueError(f"prefix_dropout must be in [0, 1), got {self.prefix_dropout}")
        check_objective(self.temperature, self.rtd_weight)
        if self.discriminator_reuses_prefix_sample and not self.discriminator_prompts:
            raise ValueError("discriminator_reuses_prefix_sample needs discriminator_prompts=True")




class D2CSE(ConditionalRTDModel):
    """Frozen PLM + shared prompt module + BN-MLP + RTD head (+ optional [CLS] prompt) (methods.md §5).

    A `models.embedder.SentenceEmbedder`: `embed` is the evaluation embedding, `tokenizer` its tokenizer.

    `backbone`: an already built HF encoder (else loaded from `config.backbone`); `tokenizer`: attached for
    evaluation (loaded from `config.backbone` when the backbone is loaded here); `cls_token_id`: the row that
    initialises the [CLS] prompt (default: the tokenizer's).
    """

    def __init__(self, config: D2CSEModelConfig, backbone: nn.Module | None = None, tokenizer=None,
                 cls_token_id: int | None = None):
        super().__init__()
        backbone, tokenizer = load_backbone(config, backbone, tokenizer)
        self.config = config
        self.tokenizer = tokenizer
        self.remember_backbone(backbone)
        drop_pooler(backbone)
        backbone.requires_grad_(False)
        bcfg = backbone.config
        d = bcfg.hidden_size
        init_std = getattr(bcfg, "initializer_range", 0.02)

        prompts = PrefixEncoder(config.prefix_len, bcfg.num_hidden_layers, d, bcfg.num_attention_heads,
                                dropout=config.prefix_dropout, projection=config.prefix_projection,
                                projection_hidden=config.prefix_hidden, init_std=init_std)
        self.encoder = PromptedBackbone(backbone, prompts, shift_positions=config.shift_positions)

        self.cls_prompt: nn.Parameter | None = None
        if config.cls_prompt:
            if cls_token_id is None:
                cls_token_id = getattr(tokenizer, "cls_token_id", None)
            if cls_token_id is None:
                raise ValueError("cls_prompt=True needs the [CLS] id (pass a tokenizer or cls_token_id)")
            row = backbone.embeddings.word_embeddings.weight[cls_token_id]
            self.cls_prompt = nn.Parameter(row.detach().clone().float())

        self.projection = ProjectionMLP(d, init_std=init_std)
        self.rtd_head = RTDHead(d)

        self.discriminator: PromptedBackbone | None = None
        if config.train_discriminator:
            copy_ = copy.deepcopy(backbone).requires_grad_(True)
            self.discriminator = PromptedBackbone(copy_, None, shift_positions=config.shift_positions)

    method = "d2cse"
    config_class = D2CSEModelConfig

    # --------------------------------------------------------------------------------- properties
    @property
    def prompts(self) -> PrefixEncoder:
        return self.encoder.prefix_encoder

    @property
    def backbone(self) -> nn.Module:
        return self.encoder.backbone

    # --------------------------------------------------------------------------------- passes
    def encode_cls(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                   prefix: PrefixKeyValues | None = None) -> torch.Tensor:
        """Last-layer CLS state of `(B', T)` rows with prompts (and the [CLS] prompt if on): `(B', d)`."""
        if prefix is None:
            prefix = self.prompts(input_ids.shape[0])
        out = self.encoder(input_ids, attention_mask, token_type_ids, prefix=prefix, cls_embedding=self.cls_prompt)
        return out.last_hidden_state[:, 0]

    def discriminate(self, corrupted_ids: torch.Tensor, attention_mask: torch.Tensor, h: torch.Tensor | None,
                     token_type_ids: torch.Tensor | None = None, prefix: PrefixKeyValues | None = None) -> torch.Tensor:
        """RTD logits `(B', T, 2)` of the discriminator on corrupted ids, position 0 conditioned on `h` if given."""
        use_prompts = self.config.discriminator_prompts
        if use_prompts and prefix is None:
            prefix = self.prompts(corrupted_ids.shape[0])
        body = self.discriminator if self.discriminator is not None else self.encoder
        out = body(corrupted_ids, attention_mask, token_type_ids,
                   prefix=prefix if use_prompts else False,
                   cls_embedding=self.cls_prompt if use_prompts else None,
                   position0_output=h)
        return self.rtd_head(out.last_hidden_state)

    def encode_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_type_ids: torch.Tensor | None) -> tuple[torch.Tensor, PrefixKeyValues]:
        """Training encoder pass with one prefix sample for all rows; the sample is the context."""
        prefix = self.prompts(input_ids.shape[0])
        return self.encode_cls(input_ids, attention_mask, token_type_ids, prefix=prefix), prefix

    def discriminate_rows(self, corrupted_ids: torch.Tensor, attention_mask: torch.Tensor, h: torch.Tensor,
                          token_type_ids: torch.Tensor | None, context: PrefixKeyValues) -> torch.Tensor:
        """Conditioned on `h` unless ablation (c); a fresh prefix sample unless `discriminator_reuses_prefix_sample`."""
        return self.discriminate(corrupted_ids, attention_mask, h if self.config.condition_discriminator else None,
                                 token_type_ids, prefix=context if self.config.discriminator_reuses_prefix_sample else None)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Evaluation embedding `(B, d)`: CLS before the pooler with prompts active (§1.3, §5)."""
        return self.encode_cls(input_ids, attention_mask, token_type_ids)

    def describe(self) -> dict:
        return {**super().describe(), "prefix_len": self.config.prefix_len, "cls_prompt": self.config.cls_prompt}
