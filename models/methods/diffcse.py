"""DiffCSE: SimCSE + conditional replaced-token detection with a trainable encoder and discriminator (DiffCSE paper).

Per step on `(B, n, T)` rows flattened to `(B·n, T)` (the shared skeleton is `cse.models.methods.crtd.ConditionalRTDModel`):
1. the trainable encoder f (the full backbone, no prompts, pretrained pooler removed) encodes the rows;
   CLS → BN-MLP → `h`, the contrastive vector and, not detached, the conditioning vector (`before_mlp` = false);
2. contrastive loss on `h` (SimCSE; with the contradiction column as hard negatives when n = 3);
3. the discriminator D — a second, trainable copy of the pretrained backbone made when the model is built —
   reads the corrupted ids with its embedding-layer output at position 0 replaced by `h` (DiffCSE step 5, docs/methods-overview.md);
   `RTDHead` on D's last hidden states gives the RTD logits; the loss is the mean over all positions,
   padding included (docs/methods-overview.md), or over real tokens with `rtd_mean_over_padding=False`;
4. `L = L_CL + λ·L_RTD`, λ = 0.005, τ = 0.05.

The corrupted ids and their labels come precomputed from the corruption stage (`TrainBatch.corrupted_ids` /
`rtd_labels`; the fixed DistilBERT generator of DiffCSE steps 2–4 runs offline, not in this model).

Supervised DiffCSE (D2CSE's Table 8 construction, DiffCSE): `(B, 3, T)` rows, hard-negative
contrastive loss, conditional RTD on all three sentences.

Evaluation embedding: CLS before the pooler of the encoder (SimCSE); D, the RTD head and the BN-MLP are unused.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from pydantic import model_validator

from cse.models.heads import ProjectionMLP, RTDHead
from cse.models.method import METHOD_CONFIG, FineTunedModel, MethodConfig, config_dataclass
from cse.models.methods.crtd import ConditionalRTDModel, check_objective
from cse.models.prompts.backbone import PromptedBackbone, unpad_fine_tuned

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@config_dataclass(frozen=True, config=METHOD_CONFIG)
class DiffCSEConfig(MethodConfig):
    """Model hyperparameters (defaults: DiffCSE BERT-base for STS, Chuang et al., 2022, Table 12).

    The learning rate (7e-6) and masking ratio (0.30) belong to the training and corruption stages.
    """

    temperature: float = 0.05
    rtd_weight: float = 0.005
    hard_negative_weight: float = 0.0
    rtd_mean_over_padding: bool = True
    # The discriminator D and the RTD head train at the job's learning rate, the paper's single rate (the reference
    # code has one optimizer group); a value here puts them in an AdamW group of their own. A proxy knob of the
    # evidence benchmark's protocol 2 (benchmarks/evidence_v2.py: the rate at which the RTD side can learn to read h
    # within a short CPU run), not a setting of any preset.
    discriminator_learning_rate: float | None = None

    @model_validator(mode="after")
    def _check(self) -> DiffCSEConfig:
        check_objective(self.temperature, self.rtd_weight)
        if self.discriminator_learning_rate is not None and not self.discriminator_learning_rate > 0:
            raise ValueError(
                "discriminator_learning_rate must be positive (or None: the job's rate), got "
                f"{self.discriminator_learning_rate}"
            )
        return self


class DiffCSE(FineTunedModel, ConditionalRTDModel):
    """DiffCSE: a fully fine-tuned encoder with a BN-MLP, trained with SimCSE's contrastive loss plus conditional
    replaced-token detection: a trainable discriminator (a copy of the pretrained backbone) with an RTD head finds
    the tokens a fixed masked-LM generator replaced (the corruption stage), conditioned on the sentence vector.

    Paper: Yung-Sung Chuang, Rumen Dangovski, Hongyin Luo, Yang Zhang, Shiyu Chang, Marin Soljačić, Shang-Wen Li,
    Wen-tau Yih, Yoon Kim and James Glass (2022). DiffCSE: Difference-based Contrastive Learning for Sentence
    Embeddings. arXiv:2204.10298 (reference code: the DiffCSE repository). `embed` is the CLS state
    before the pooler; the discriminator and heads are training-only (left out of checkpoints).

    Args:
        config: the model hyperparameters (`DiffCSEConfig`; defaults: unsupervised BERT-base).
        backbone: an already built HF encoder; None loads `config.backbone`. It becomes the encoder and is
            fine-tuned in place.
        tokenizer: attached for evaluation; loaded from `config.backbone` when the backbone is loaded here.

    Examples:
        >>> from cse.config.methods import build_model
        >>> from cse.models.batching import pad_sequences
        >>> model = build_model("diffcse", {"backbone": "packaged:minilm"}).eval()
        >>> ids, mask = pad_sequences(model.token_ids(["A man is playing a guitar."]), model.pad_token_id)
        >>> model.embed(ids, mask).shape
        torch.Size([1, 384])
    """

    method = "diffcse"
    title = "DiffCSE"
    summary = "trainable encoder + trainable discriminator, fixed DistilBERT generator"
    config_class = DiffCSEConfig
    config: DiffCSEConfig
    paper = (
        "Yung-Sung Chuang, Rumen Dangovski, Hongyin Luo, Yang Zhang, Shiyu Chang, Marin Soljačić, Shang-Wen Li, "
        "Wen-tau Yih, Yoon Kim and James Glass (2022). DiffCSE: Difference-based Contrastive Learning for "
        "Sentence Embeddings. arXiv:2204.10298."
    )
    bibtex = """@article{chuang2022diffcse,
  title   = {{DiffCSE}: Difference-based Contrastive Learning for Sentence Embeddings},
  author  = {Chuang, Yung-Sung and Dangovski, Rumen and Luo, Hongyin and Zhang, Yang and Chang, Shiyu and
             Solja{\\v{c}}i{\\'c}, Marin and Li, Shang-Wen and Yih, Wen-tau and Kim, Yoon and Glass, James},
  journal = {arXiv preprint arXiv:2204.10298},
  year    = {2022}
}"""
    builds_on = ("simcse",)

    def __init__(
        self,
        config: DiffCSEConfig,
        backbone: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        super().__init__()
        backbone = self.attach_backbone(config, backbone, tokenizer, trainable=True)
        bcfg = backbone.config
        d = bcfg.hidden_size
        init_std = getattr(bcfg, "initializer_range", 0.02)

        self.encoder = backbone
        self.projection = ProjectionMLP(d, init_std=init_std)
        # D: the pretrained weights as loaded (before any update), in storage of its own; without prompts the
        # wrapper runs the plain model and provides the position-0 conditioning.
        self.discriminator = PromptedBackbone(copy.deepcopy(backbone), None, shift_positions=False)
        self.rtd_head = RTDHead(d)

    # --------------------------------------------------------------------------------- passes
    def discriminate(
        self,
        corrupted_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        h: torch.Tensor | None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RTD logits `(B', T, 2)` of D on corrupted ids; D's embedding output at position 0 is `h` if given."""
        out = self.discriminator(
            corrupted_ids,
            attention_mask,
            token_type_ids,
            prefix=False,
            position0_output=h,
            unpadded=not self.config.rtd_mean_over_padding,  # the RTD mean over padding reads every pad position
        )
        return self.rtd_head(out.last_hidden_state)

    def parameter_groups(self, phase: str) -> list[dict]:
        """Every trainable tensor at the job's rate; with `discriminator_learning_rate` set, D and the RTD head in a
        group of their own at that rate."""
        rate = self.config.discriminator_learning_rate
        return self.rate_groups(
            phase, [] if rate is None else [("discriminator", [self.discriminator, self.rtd_head], rate)]
        )

    def use_unpadded(self, fill: float | None) -> None:
        """`CSEModel.use_unpadded`, the fine-tuned encoder's CLS pass included (`unpad_fine_tuned`)."""
        unpad_fine_tuned(self, self.encoder, fill)

    def embed(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Evaluation embedding `(B, d)`: the encoder's CLS state before any pooler (SimCSE, DiffCSE)."""
        return self.encode_cls(input_ids, attention_mask, token_type_ids)

    def describe(self) -> dict:
        return {**super().describe(), "rtd_weight": self.config.rtd_weight, "temperature": self.config.temperature}
