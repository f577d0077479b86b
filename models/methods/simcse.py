"""SimCSE: full fine-tuning of the PLM with the in-batch contrastive loss (Gao et al., 2021).

Per step (SimCSE): the `(B, n, T)` rows are flattened row-major to `(B·n, T)` and encoded in one
forward pass of the backbone in train mode (its dropout, p = 0.1, is the only augmentation of the
unsupervised setting: the two copies of a sentence differ only by dropout noise). The last-layer state at
position 0 goes through SimCSE's `cls` MLP (`Linear(d, d) + tanh`, newly initialised; the pretrained pooler
is dropped, SimCSE) and the contrastive loss of SimCSE is taken on the reshaped `(B, n, d)` vectors:
unsupervised `B×B` logits (n = 2), supervised `B×2B` with every in-batch hard negative (n = 3).

Evaluation embedding (SimCSE): `mlp_only_train=True` (unsupervised reference) evaluates the CLS state
before the MLP (`cls_before_pooler`); `mlp_only_train=False` (supervised reference) keeps the MLP (`cls`).

Every backbone tensor is trainable (the optional MLM auxiliary of the SimCSE code is not part of the STS
configurations, SimCSE, and is not implemented here).

`dropout` (default None: the backbone's own rates, 0.1 for BERT) sets every dropout of the backbone — hidden
states, attention probabilities, embeddings — to one probability; 0.0 is the SimCSE paper's "no dropout" row
(Gao et al. 2021, Table 2, p = 0), where the two views of a sentence are identical and the unsupervised objective
has no augmentation left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from pydantic import field_validator, model_validator

from cse.models.batching import TrainBatch, check_views
from cse.models.heads import SimCSEPoolerMLP
from cse.models.losses import contrastive_loss
from cse.models.method import (
    METHOD_CONFIG,
    CSEModel,
    FineTunedModel,
    MethodConfig,
    Positive,
    StepOutput,
    config_dataclass,
    set_backbone_dropout,
)
from cse.models.prompts.backbone import unpad_fine_tuned

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@config_dataclass(frozen=True, config=METHOD_CONFIG)
class SimCSEConfig(MethodConfig):
    """Model hyperparameters (defaults: unsupervised SimCSE, Gao et al., 2021; princeton-nlp/SimCSE).

    `mlp_only_train`: True = MLP in training only, evaluate `cls_before_pooler` (unsup); False = evaluate
    `cls` with the trained MLP (sup). `hard_negative_weight`: added to the logit of each anchor's own hard
    negative (SimCSE; 0 = weight 1, all reported runs).
    """

    temperature: Positive = 0.05
    mlp_only_train: bool = True
    hard_negative_weight: float = 0.0
    # False: no MLP in training either; the loss reads the raw CLS state (sentence-transformers' CLS pooling +
    # MultipleNegativesRankingLoss: the peer cross-check of benchmarks/learning.py). Not a reference setting.
    train_mlp: bool = True
    # None: the backbone's own dropout rates (0.1 for BERT). A float p in [0, 1): every dropout of the backbone (hidden,
    # attention, embeddings) set to p; 0.0 = the SimCSE paper's "no dropout" row (Table 2), the two views identical.
    dropout: float | None = None

    @field_validator("dropout", mode="before")
    @classmethod
    def _a_dropout_rate(cls, value: Any) -> Any:
        """None or a rate in [0, 1); a boolean is refused as given (before pydantic would read True as 1.0)."""
        if value is not None and (isinstance(value, bool) or not 0.0 <= float(value) < 1.0):
            raise ValueError(f"dropout must be None (the backbone's own rates) or in [0, 1), got {value!r}")
        return value

    @model_validator(mode="after")
    def _an_evaluated_mlp_is_trained(self) -> SimCSEConfig:
        if not self.train_mlp and not self.mlp_only_train:
            raise ValueError("train_mlp=False needs mlp_only_train=True (the evaluation would read an untrained MLP)")
        return self


class SimCSE(FineTunedModel, CSEModel):
    """SimCSE: a fully fine-tuned PLM with a `cls` MLP, trained with the in-batch contrastive loss; unsupervised, the
    two views of a sentence differ only by dropout; supervised, NLI entailments are the positives and
    contradictions the hard negatives.

    Paper: Tianyu Gao, Xingcheng Yao and Danqi Chen (2021). SimCSE: Simple Contrastive Learning of Sentence
    Embeddings. EMNLP 2021, pages 6894-6910 (reference code: the SimCSE repository). `embed` is the CLS state
    before the MLP (`mlp_only_train=True`, unsupervised) or after it (supervised).

    Args:
        config: the model hyperparameters (`SimCSEConfig`; defaults: unsupervised SimCSE).
        backbone: an already built HF encoder; None loads `config.backbone`.
        tokenizer: attached for evaluation; loaded from `config.backbone` when the backbone is loaded here.

    Examples:
        >>> from cse.config.methods import build_model
        >>> from cse.models.batching import pad_sequences
        >>> model = build_model("simcse", {"backbone": "packaged:minilm"}).eval()
        >>> ids, mask = pad_sequences(model.token_ids(["A man is playing a guitar."]), model.pad_token_id)
        >>> model.embed(ids, mask).shape
        torch.Size([1, 384])
    """

    method = "simcse"
    title = "SimCSE"
    summary = "dropout views, full fine-tuning (unsup and sup)"
    config_class = SimCSEConfig
    config: SimCSEConfig
    paper = (
        "Tianyu Gao, Xingcheng Yao and Danqi Chen (2021). SimCSE: Simple Contrastive Learning of Sentence "
        "Embeddings. EMNLP 2021, pages 6894-6910."
    )
    bibtex = """@inproceedings{gao2021simcse,
  title     = {{SimCSE}: Simple Contrastive Learning of Sentence Embeddings},
  author    = {Gao, Tianyu and Yao, Xingcheng and Chen, Danqi},
  booktitle = {Proceedings of the 2021 Conference on Empirical Methods in Natural Language Processing},
  pages     = {6894--6910},
  year      = {2021}
}"""

    def __init__(
        self,
        config: SimCSEConfig,
        backbone: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        super().__init__()
        backbone = self.attach_backbone(config, backbone, tokenizer, trainable=True)  # full fine-tuning (SimCSE)
        if config.dropout is not None:
            set_backbone_dropout(backbone, config.dropout)
        self.encoder = backbone
        bcfg = backbone.config
        self.mlp = SimCSEPoolerMLP(bcfg.hidden_size, init_std=getattr(bcfg, "initializer_range", 0.02))

    # --------------------------------------------------------------------------------- properties
    @property
    def evaluation_pooler(self) -> str:
        return "cls_before_pooler" if self.config.mlp_only_train else "cls"

    # --------------------------------------------------------------------------------- passes
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Contrastive loss of `(B, n, T)` rows (n = 2 unsup, 3 sup) and the `(B, n, d)` MLP outputs (SimCSE)."""
        check_views(input_ids, attention_mask)
        batch, n, length = input_ids.shape
        # the encoder pass is per row: in cached chunks under grad_cache (models/grad_cache.py); the MLP and the loss
        # run on all B·n vectors
        cls = self.row_chunks.map(self.encode_cls, input_ids.reshape(-1, length), attention_mask.reshape(-1, length))
        z = (self.mlp(cls) if self.config.train_mlp else cls).view(batch, n, -1)
        loss = contrastive_loss(
            *z.unbind(1), temperature=self.config.temperature, hard_negative_weight=self.config.hard_negative_weight
        )
        return loss, z

    def training_step(self, batch: TrainBatch, step: int | torch.Tensor = 0, phase: str = "main") -> StepOutput:
        loss, _ = self(batch.input_ids, batch.attention_mask)
        return StepOutput(loss, {"loss_contrastive": loss.detach()})

    def use_unpadded(self, fill: float | None) -> None:
        """`CSEModel.use_unpadded`, the fine-tuned encoder's CLS pass included (`unpad_fine_tuned`)."""
        unpad_fine_tuned(self, self.encoder, fill)

    def embed(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Evaluation embedding `(B, d)`: CLS before the MLP (unsup) or CLS → MLP (sup) (SimCSE)."""
        cls = self.encode_cls(input_ids, attention_mask, token_type_ids)
        return cls if self.config.mlp_only_train else self.mlp(cls)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "mlp_only_train": self.config.mlp_only_train,
            "temperature": self.config.temperature,
            "dropout": self.config.dropout,
            "trainable_parameters": self.trainable_parameter_count(),
        }
