"""DiffAug: two prefix modules as a differentiable augmentation, two-stage training (Wang & Lu, 2022).

Model (BERT family; the LM is fully fine-tuned in the joint stage, so this is not a frozen-backbone method):

- Hard prompt (PromptBERT template "00", DiffAug): training rows arrive from the tokenisation stage as
  `[CLS] sentence [SEP]`; `wrap_rows` strips the special tokens, cuts the sentence to `max_sentence_tokens`
  (32) and wraps it in the template ids `enc_bs = [CLS] this sentence of "` and `enc_es = " means [MASK] . [SEP]`
  (5 + 5 ids for BERT). Evaluation (`token_ids`) tokenises the string `This sentence of "<s>" means[MASK].`
  normally, with special tokens and without truncation, as the reference `evaluation.py` does.
- Sentence vector = last hidden state at the template's `[MASK]` token (SimCSE).
- Prefixes (DCPCSE reference prefixes, DiffAug, docs/methods-overview.md): ONE `PrefixEncoder` with `prefix_len = 16` slots and reparametrisation
  (`Embedding(16, d) → Linear(d, h_p = d) → tanh → Linear(d, 2·L·d)`), prefix dropout 0.1. The "two prefix
  modules" are its halves: module A = slots 0–7, module B = slots 8–15; they have their own embedding rows
  but share the reparametrisation MLP [code]. All 16 K/V slots are passed to every layer; a per-row
  visibility mask selects the module (A rows `[1×8, 0×8]`, B rows `[0×8, 1×8]`). Since 16 slots are passed,
  token positions are shifted by 16, not 8 (DCPCSE reference prefixes, docs/methods-overview.md; `shift_positions`).
  Roles: anchor / premise / first view → A; positive / entailment / contradiction / second view → B.
  Inference: all 16 slots visible.
- SimCSE MLP `Linear(d, d) + tanh` on the (denoised) `[MASK]` vector in training, in both stages
  (`mlp_train` of the reference); never at evaluation (`mlp_eval` false).
- NLI classifier `Linear(3d, 2)` on `[u, v, |u − v|]` (`sup_label_num = 2`).

Phases (`phases = ("prefix", "joint")`):

- "prefix" (stage 1): `(B, 3, T)` NLI triplets. (premise, entailment) → label 1, (premise, contradiction) →
  label 0; cross-entropy averaged over the 2B rows; no template denoising. Only the prefix encoder and the
  classifier are stepped (`phase_parameters("prefix")`). The reference lets the LM (and the MLP) receive
  gradients it never steps (DiffAug, docs/methods-overview.md); those gradients influence nothing but the reference's fp16 clipping
  quirk, which the trainer here does not reproduce (it clips over the phase's parameters only), so this
  implementation does not compute them: during the stage-1 forward every parameter outside the phase is
  temporarily excluded from autograd. The LM still runs in train mode (its dropout is active).
- "joint" (stage 2): everything (LM, prefix encoder, MLP, classifier) is stepped.
  `(B, 2, T)` unsupervised rows (Wiki sentence twice; view 1 with A, view 2 with B, plus dropout): contrastive
  loss SimCSE without hard negatives, plus — when `aux_weight` α > 0 — the stage-1 cross-entropy on the NLI
  batch `batch.aux` (`(B', 3, T')`, same A/B assignment): `L = L_CL + α·L_CE`. The reference encodes the
  auxiliary rows in the same forward pass as the main rows, and so does this implementation. With α = 0 an
  attached `aux` batch is ignored (the reference's `use_aux_loss` off).
  `(B, 3, T)` supervised triplets: anchor with A, positive and hard negative with B; contrastive loss with
  every in-batch hard negative, no hard-negative weight (DiffAug has none, SimCSE).

Template denoising (PromptBERT; joint stage only, `denoise`, DiffAug, docs/methods-overview.md): for each module the bare
template (`enc_bs + enc_es`, 10 ids) is encoded `denoise_copies` (128) times with explicit position ids —
`base + j` for the `enc_bs` ids and `base + j + i` for the `enc_es` ids of copy `i` (a simulated sentence of
`i` tokens), `base` = the first position of a prefixed row (16 for BERT with the shift) — and `δ[i]` is the
`[MASK]` state of copy `i`. The reference passes only the module's 8 slots there; here all 16 slots are
passed with the module's half-mask, which is the same computation (masked slots get exactly zero attention
weight). δ is computed with gradients and with dropout active (train mode), and each training vector of the
main batch subtracts `δ_A[k]` (first view / anchor) or `δ_B[k]` (second view, positive, hard negative)
before the MLP. Index quirk [code]: the reference takes `k = (attended slots incl. the visible prefix half) −
template length = sentence_length + prefix_len/2` (off by 8, the prefix mask is counted as tokens);
`denoise_index_quirk=True` (default) reproduces it, False uses the intended `k = sentence_length`. The
auxiliary NLI rows are not denoised (the reference splits them off before the subtraction). At inference
there is neither denoising nor MLP.

Ablation "same prefix" (`shared_prefix=True`; DiffAug paper, Table 3 "Prefix (same)": STS-B dev 85.7 against 86.2 for
"Prefix (different, ours)", semi-supervised BERT-base, l = 8): "two identical prefixes" for the positives of
contrastive learning. In the joint stage every row — both views (anchor, positive and hard negative when supervised)
and the auxiliary NLI rows — sees module A, so the two views of a sentence differ by dropout only; denoising then
subtracts δ_A from every row. The paper leaves the rest of the variant unspecified; here it is kept as in DiffAug,
so the control differs from the method in the stage-2 views only: stage 1 still trains modules A and B on NLI, and
inference still sees all 16 slots (checkpoints and exports are unchanged).

Not reproduced (trainer matters, see DiffAug): the stage-1 clipping over all parameters, the
stage-1 scheduler sized by stage 2, multi-GPU gathering of negatives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, cast

import torch
import torch.nn.functional as F
from pydantic import field_validator, model_validator
from torch import nn
from torch.func import functional_call

from cse.models.batching import TrainBatch, check_views
from cse.models.heads import SimCSEPoolerMLP
from cse.models.losses import contrastive_loss
from cse.models.method import (
    METHOD_CONFIG,
    AtLeastOne,
    CSEModel,
    DropoutRate,
    MethodConfig,
    NonNegative,
    Positive,
    StepOutput,
    config_dataclass,
    must_be,
)
from cse.models.prompts.backbone import PromptedModel, prompted_backbone
from cse.models.prompts.prefixes import PrefixKeyValues

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from cse.models.export.peft_plan import PeftPlan

SENTENCE_PLACEHOLDER = "{sentence}"
MASK_PLACEHOLDER = "[MASK]"


@config_dataclass(frozen=True, config=METHOD_CONFIG)
class DiffAugConfig(MethodConfig):
    """Model hyperparameters (defaults: DiffAug BERT-base, Wang & Lu, 2022; TianduoWang/DiffAug).

    `template`: the hard prompt with a `{sentence}` placeholder and a literal `[MASK]` (replaced by the
    tokenizer's mask token); the default is PromptBERT's template "00" as DiffAug uses it.
    `prefix_hidden`: `h_p` of the reparametrisation MLP; None = the hidden size d (DiffAug always uses d).
    `aux_weight`: α of the joint-stage auxiliary NLI cross-entropy (0 = off; the "semi w/ aux" preset uses 1e-3).
    `denoise_index_quirk`: reproduce the reference's off-by-`prefix_len/2` δ index (docs/methods-overview.md).
    `shared_prefix`: the paper's "same prefix" ablation (Table 3): every joint-stage row uses module A, so both
    views share one prefix module (stage 1 and inference unchanged; see the module docstring).
    """

    prefix_len: Annotated[
        int, must_be("an even number >= 2 (two modules = two halves)", lambda v: v >= 2 and v % 2 == 0)
    ] = 16
    prefix_dropout: DropoutRate = 0.1
    prefix_hidden: Annotated[int | None, must_be(">= 1 or None (= hidden size)", lambda v: v is None or v >= 1)] = None
    template: str = 'This sentence of "{sentence}" means[MASK].'
    max_sentence_tokens: AtLeastOne = 32
    temperature: Positive = 0.05
    aux_weight: NonNegative = 0.0
    denoise: bool = True
    denoise_copies: AtLeastOne = 128
    denoise_index_quirk: bool = True
    shift_positions: bool = True
    shared_prefix: bool = False

    @field_validator("template")
    @classmethod
    def _one_sentence_one_mask(cls, value: str) -> str:
        for placeholder in (SENTENCE_PLACEHOLDER, MASK_PLACEHOLDER):
            if value.count(placeholder) != 1:
                raise ValueError(f"template {value!r} must contain {placeholder!r} exactly once")
        return value

    @model_validator(mode="after")
    def _enough_denoise_copies(self) -> DiffAugConfig:
        if self.denoise and self.denoise_copies <= self.max_denoise_index:
            raise ValueError(
                f"denoise_copies={self.denoise_copies} is too small: the δ index reaches {self.max_denoise_index} "
                f"(max_sentence_tokens {self.max_sentence_tokens}"
                + (
                    f" + prefix_len/2 = {self.prefix_len // 2} from the index quirk)"
                    if self.denoise_index_quirk
                    else ")"
                )
            )
        return self

    @property
    def module_len(self) -> int:
        """Slots per prefix module (the paper's l = 8)."""
        return self.prefix_len // 2

    @property
    def max_denoise_index(self) -> int:
        return self.max_sentence_tokens + (self.module_len if self.denoise_index_quirk else 0)


class DiffAug(PromptedModel, CSEModel):
    """DiffAug: a 16-slot reparametrised prefix encoder whose two halves are two prefix modules, a differentiable
    augmentation trained first on NLI ("prefix" phase), then jointly with the fine-tuned PLM under a contrastive loss
    on a prompt template's [MASK] state ("joint" phase); plus SimCSE's MLP and an NLI classifier.

    Paper: Tianduo Wang and Wei Lu (2022). Differentiable Data Augmentation for Contrastive Sentence Representation
    Learning. EMNLP 2022, pages 7640-7653 (reference code: the DiffAug repository). See the module docstring for the
    template, the per-row module masks and what is not reproduced. `embed` reads the template's [MASK] state with all
    16 slots visible.

    Args:
        config: the model hyperparameters (`DiffAugConfig`; defaults: DiffAug BERT-base).
        backbone: an already built HF encoder; None loads `config.backbone`.
        tokenizer: needed for the template ids; loaded from `config.backbone` when not given.

    Examples:
        >>> from cse.config.methods import build_model
        >>> from cse.models.batching import pad_sequences
        >>> model = build_model("diffaug", {"backbone": "packaged:minilm"}).eval()
        >>> ids, mask = pad_sequences(model.token_ids(["A man is playing a guitar."]), model.pad_token_id)
        >>> model.embed(ids, mask).shape  # the template's [MASK] state
        torch.Size([1, 384])
    """

    method = "diffaug"
    title = "DiffAug"
    summary = "two prefix modules: NLI prefix tuning, then joint contrastive tuning"
    config_class = DiffAugConfig
    config: DiffAugConfig
    # constant template ids (_build_template), buffers
    bs_ids: torch.Tensor
    es_ids: torch.Tensor
    denoise_ids: torch.Tensor
    denoise_positions: torch.Tensor
    phases = ("prefix", "joint")
    accepts_aux_nli = True  # semi-supervised "w/ aux": NLI rows batched beside each Wiki1M batch
    paper = (
        "Tianduo Wang and Wei Lu (2022). Differentiable Data Augmentation for Contrastive Sentence "
        "Representation Learning. EMNLP 2022, pages 7640-7653."
    )
    bibtex = """@inproceedings{wang2022diffaug,
  title     = {Differentiable Data Augmentation for Contrastive Sentence Representation Learning},
  author    = {Wang, Tianduo and Lu, Wei},
  booktitle = {Proceedings of the 2022 Conference on Empirical Methods in Natural Language Processing},
  pages     = {7640--7653},
  year      = {2022},
  doi       = {10.18653/v1/2022.emnlp-main.520}
}"""
    builds_on = ("simcse",)
    evaluation_pooler = "mask"

    @classmethod
    def backbone_pooling(cls, config: MethodConfig) -> tuple[str, str | None]:
        """The backbone before training reads the template's mask token, as the trained model does."""
        return "mask", cast(DiffAugConfig, config).template  # DiffAug's own config

    def __init__(
        self,
        config: DiffAugConfig,
        backbone: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        super().__init__()
        if tokenizer is None:  # the template ids need it even when a backbone is passed in
            from cse.models.loading import load_tokenizer

            tokenizer = load_tokenizer(config.backbone)
        # DiffAug fine-tunes the whole LM in the joint stage (DiffAug)
        backbone = self.attach_backbone(config, backbone, tokenizer, trainable=True)
        bcfg = backbone.config
        d = bcfg.hidden_size
        init_std = getattr(bcfg, "initializer_range", 0.02)

        self.encoder = prompted_backbone(
            backbone,
            config.prefix_len,
            config.prefix_dropout,
            projection=True,
            projection_hidden=config.prefix_hidden or d,
            shift_positions=config.shift_positions,
        )
        self.mlp = SimCSEPoolerMLP(d, init_std=init_std)
        # The reference creates `sup_classifier` before `init_weights()`: N(0, initializer_range), zero bias.
        self.classifier = nn.Linear(3 * d, 2)
        nn.init.normal_(self.classifier.weight, mean=0.0, std=init_std)
        nn.init.zeros_(self.classifier.bias)

        self._build_template(tokenizer)

    # --------------------------------------------------------------------------------- template
    def _build_template(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Template ids (`enc_bs`, `enc_es`), the evaluation strings and the constant denoising inputs."""
        for name in ("cls_token_id", "sep_token_id", "mask_token_id"):
            if getattr(tokenizer, name, None) is None:
                raise ValueError(f"DiffAug's prompt template needs a tokenizer with a {name[:-3]} (got none)")
        self.cls_token_id, self.sep_token_id = int(tokenizer.cls_token_id), int(tokenizer.sep_token_id)
        self.mask_token_id = int(tokenizer.mask_token_id)
        # the pad id of templated rows, read once (the tokenizer is not called inside a training step)
        self.template_pad_id = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0
        head, tail = self.config.template.replace(MASK_PLACEHOLDER, tokenizer.mask_token).split(SENTENCE_PLACEHOLDER)
        self.eval_head, self.eval_tail = head, tail
        # Reference `get_encoded_bs_and_es`: both halves tokenised without special tokens, [CLS] / [SEP] added
        enc_bs = [self.cls_token_id] + tokenizer.encode(head, add_special_tokens=False)
        enc_es = tokenizer.encode(tail, add_special_tokens=False) + [self.sep_token_id]
        in_bs, in_es = enc_bs.count(self.mask_token_id), enc_es.count(self.mask_token_id)
        if in_bs + in_es != 1:
            raise ValueError(f"template {self.config.template!r} tokenises to {in_bs + in_es} mask tokens, expected 1")
        # [MASK] index: fixed inside enc_bs, or `len(enc_bs) + sentence_length + j` inside enc_es
        self.mask_in_head = in_bs == 1
        self.mask_offset = enc_bs.index(self.mask_token_id) if self.mask_in_head else enc_es.index(self.mask_token_id)
        self.enc_bs, self.enc_es = enc_bs, enc_es
        self.register_buffer("bs_ids", torch.tensor(enc_bs, dtype=torch.long), persistent=False)
        self.register_buffer("es_ids", torch.tensor(enc_es, dtype=torch.long), persistent=False)

        limit = self.encoder.config.max_position_embeddings
        shift = self.config.prefix_len if self.config.shift_positions else 0
        longest = len(enc_bs) + self.config.max_sentence_tokens + len(enc_es)
        self.encoder.position_ids(
            torch.full((1, longest), self.cls_token_id), shift
        )  # raises if the longest row does not fit
        # Denoising inputs (DiffAug): the bare template repeated `denoise_copies` times; copy i places enc_es as if
        # a sentence of i tokens stood between enc_bs and enc_es.
        copies = self.config.denoise_copies
        template = torch.tensor(enc_bs + enc_es, dtype=torch.long).unsqueeze(0).repeat(copies, 1)
        positions = self.encoder.position_ids(template, shift).clone()
        positions[:, len(enc_bs) :] += torch.arange(copies).unsqueeze(1)
        if self.config.denoise and int(positions.max()) >= limit:
            raise ValueError(
                f"template denoising with {copies} copies reaches position {int(positions.max())} >= "
                f"max_position_embeddings={limit}; lower denoise_copies"
            )
        self.register_buffer("denoise_ids", template, persistent=False)
        self.register_buffer("denoise_positions", positions, persistent=False)
        self.denoise_mask_index = self.mask_offset if self.mask_in_head else len(enc_bs) + self.mask_offset

    def token_ids(self, sentences: Sequence[str]) -> list[list[int]]:
        """Evaluation input: `This sentence of "<s>" means[MASK].` tokenised normally, no truncation (DiffAug)."""
        texts = [(self.eval_head + s + self.eval_tail).strip() for s in sentences]
        return self.tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]

    def check_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Refuse rows that are not `[CLS] sentence [SEP]` (right-padded, as the tokenisation stage writes them).

        Reads the values, so the trainer calls it on the host batch (`check_batch`), never inside a step.

        Args:
            input_ids: `(R, T)` token ids.
            attention_mask: `(R, T)` token mask.

        Raises:
            ValueError: a row shorter than two tokens, or one that does not start with [CLS] and end with [SEP].
        """
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"rows must be (R, T) ids and mask of equal shape, got {tuple(input_ids.shape)} / "
                f"{tuple(attention_mask.shape)}"
            )
        if not input_ids.shape[0]:
            return
        n_tokens = attention_mask.long().sum(-1)
        if bool((n_tokens < 2).any()):
            raise ValueError("every training row must hold at least [CLS] and [SEP]")
        last = input_ids.gather(1, (n_tokens - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
        if bool((input_ids[:, 0] != self.cls_token_id).any()) or bool((last != self.sep_token_id).any()):
            raise ValueError(
                f"training rows must be `[CLS] sentence [SEP]` (ids {self.cls_token_id} … {self.sep_token_id}) "
                "as the tokenisation stage writes them"
            )

    def check_batch(self, batch: TrainBatch) -> None:
        """`check_rows` on every view of a host batch and of its NLI batch (the trainer's host-side check)."""
        for part in (batch, batch.aux):
            if part is not None:
                self.check_rows(part.flat(part.input_ids), part.flat(part.attention_mask))

    def wrap_rows(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, check: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(R, T)` rows `[CLS] sentence [SEP]` (right-padded) → templated training rows (DiffAug).

        Returns `(ids, mask, lengths, mask_positions)`: the `(R, W)` ids `enc_bs + sentence[:max_sentence_tokens]
        + enc_es` right-padded with the tokenizer's pad id, their mask, the kept sentence lengths `(R,)` and the
        index of the template's [MASK] in every row `(R,)`. The width `W = |enc_bs| + min(T − 2, max_sentence_tokens)
        + |enc_es|` depends on the input's shape only (no value is read): for rows padded to their longest, as the
        reference pads them, it is the reference's width; wider input only adds masked pad columns.

        Args:
            input_ids: `(R, T)` token ids.
            attention_mask: `(R, T)` token mask.
            check: `check_rows` first (reads the values; the training step passes False, the trainer having
                checked the host batch).
        """
        if check:
            self.check_rows(input_ids, attention_mask)
        rows, width = input_ids.shape
        device = input_ids.device
        n_tokens = attention_mask.long().sum(-1)
        lengths = (n_tokens - 2).clamp(min=0, max=self.config.max_sentence_tokens)
        nb, ne = len(self.enc_bs), len(self.enc_es)
        out_width = nb + max(0, min(width - 2, self.config.max_sentence_tokens)) + ne
        pos = torch.arange(out_width, device=device).unsqueeze(0)
        k = lengths.unsqueeze(1)
        sentence = input_ids.gather(1, (pos - nb + 1).clamp(0, width - 1).expand(rows, out_width))
        head = self.bs_ids[pos.clamp(max=nb - 1)].expand(rows, out_width)
        tail = self.es_ids[(pos - nb - k).clamp(0, ne - 1)]
        pad = self.template_pad_id
        ids = torch.where(
            pos < nb, head, torch.where(pos < nb + k, sentence, torch.where(pos < nb + k + ne, tail, pad))
        )
        mask = (pos < nb + k + ne).long().expand(rows, out_width).contiguous()
        mask_positions = (
            torch.full_like(lengths, self.mask_offset) if self.mask_in_head else nb + lengths + self.mask_offset
        )
        return ids, mask, lengths, mask_positions

    # --------------------------------------------------------------------------------- prefixes

    def module_visibility(self, modules: torch.Tensor) -> torch.Tensor:
        """`(R,)` module per row (0 = A, 1 = B) → `(R, P)` prefix visibility: A `[1×P/2, 0×P/2]`, B the reverse."""
        half = (torch.arange(self.config.prefix_len, device=modules.device) >= self.config.module_len).long()
        # (integers compared, not booleans: inductor's value-range analysis fails on a bool == bool, torch 2.13)
        return (half.unsqueeze(0) == (modules != 0).long().unsqueeze(1)).long()

    def prefix_sample(self, modules: torch.Tensor | None, rows: int) -> PrefixKeyValues:
        """A prefix sample for `rows` rows; `modules` None = all slots visible (inference)."""
        return self.prompts(rows, mask=None if modules is None else self.module_visibility(modules))

    @staticmethod
    def view_modules(batch: int, n_views: int, device: torch.device) -> torch.Tensor:
        """Module of every row of a flattened `(B, n)` batch: view 0 → A (0), the others → B (1)."""
        return (torch.arange(n_views, device=device) > 0).long().repeat(batch)

    def joint_modules(self, batch: int, n_views: int, device: torch.device) -> torch.Tensor:
        """Module of every joint-stage row: `view_modules`, or A (0) for every row with `shared_prefix` (Table 3 "same")."""
        if self.config.shared_prefix:
            return torch.zeros(batch * n_views, dtype=torch.long, device=device)
        return self.view_modules(batch, n_views, device)

    # --------------------------------------------------------------------------------- passes
    def mask_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        modules: torch.Tensor,
        encoder: Callable[..., Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(R, T)` tokenisation-stage rows → (`(R, d)` [MASK] states with each row's module, `(R,)` sentence lengths).
        `encoder`: what runs the prompted encoder (default `self.encoder`; stage 1 passes it with frozen weights)."""
        ids, mask, lengths, mask_pos = self.wrap_rows(input_ids, attention_mask, check=False)
        encoder = self.encoder if encoder is None else encoder  # (`or` would ask a function's truth: a graph break)
        out = encoder(ids, mask, prefix=self.prefix_sample(modules, ids.shape[0]))
        states = out.last_hidden_state[torch.arange(ids.shape[0], device=ids.device), mask_pos]
        return states, lengths

    def template_deltas(self) -> torch.Tensor:
        """`(2, denoise_copies, d)`: δ_A and δ_B, the [MASK] states of the bare template per module (DiffAug)."""
        copies = self.config.denoise_copies
        ids = self.denoise_ids.repeat(2, 1)
        modules = torch.arange(2, device=ids.device).repeat_interleave(copies)
        out = self.encoder(
            ids,
            torch.ones_like(ids),
            prefix=self.prefix_sample(modules, ids.shape[0]),
            position_ids=self.denoise_positions.repeat(2, 1),
            unpadded=False,  # the bare template: every position real, nothing to leave out
        )
        return out.last_hidden_state[:, self.denoise_mask_index].view(2, copies, -1)

    def denoise(self, states: torch.Tensor, lengths: torch.Tensor, modules: torch.Tensor) -> torch.Tensor:
        """Subtract `δ_module[k]` from every row, `k` = sentence length (+ prefix_len/2 with the index quirk)."""
        index = lengths + (self.config.module_len if self.config.denoise_index_quirk else 0)
        deltas = self.template_deltas()
        return states - deltas[modules, index].to(states.dtype)

    def nli_loss(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(B, 3, d)` (premise, entailment, contradiction) → (CE over the 2B pairs, accuracy) (DiffAug stage 1)."""
        u, pos, neg = z[:, 0], z[:, 1], z[:, 2]
        feats = torch.cat(
            [torch.cat([u, pos, (u - pos).abs()], dim=1), torch.cat([u, neg, (u - neg).abs()], dim=1)], dim=0
        )
        batch = z.shape[0]
        labels = torch.cat([z.new_ones(batch, dtype=torch.long), z.new_zeros(batch, dtype=torch.long)])
        logits = self.classifier(feats)
        loss = F.cross_entropy(logits.float(), labels)
        with torch.no_grad():
            accuracy = (logits.argmax(-1) == labels).float().mean()
        return loss, accuracy

    def _outside_the_prefix_phase(self, module: nn.Module) -> Callable[..., Any]:
        """`module` as a function whose parameters outside the prefix phase are detached (stage 1, module docstring):
        autograd computes no gradient for them, and nothing is switched on the live parameters, so the step has no
        state to restore and compiles as one graph."""
        keep = {id(p) for p in self.phase_parameters("prefix")}
        detached = {n: p.detach() for n, p in module.named_parameters() if id(p) not in keep}

        def run(*args: Any, **kwargs: Any) -> Any:
            return functional_call(module, detached, args, kwargs, strict=False)

        return run

    def phase_parameters(self, phase: str) -> list[nn.Parameter]:
        """Phase "prefix": the prefix encoder and the NLI classifier; phase "joint": every parameter (DiffAug)."""
        params = super().phase_parameters(phase)
        if phase == "prefix":
            return [*self.prompts.parameters(), *self.classifier.parameters()]
        return params

    def prefix_stage_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, modules: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`mask_states` with gradients for the prefix stage's parameters only: the per-row pass of stage 1. The
        exclusion is taken here too because a cached chunk (grad_cache) re-runs this pass during the backward,
        outside `prefix_stage_step`."""
        return self.mask_states(input_ids, attention_mask, modules, self._outside_the_prefix_phase(self.encoder))

    def prefix_stage_step(self, batch: TrainBatch) -> StepOutput:
        """Stage 1: NLI cross-entropy with the MLP, no denoising; gradients only for prefix encoder + classifier."""
        check_views(batch.input_ids, batch.attention_mask, (3,), "stage-1 (prefix) input_ids")
        if batch.aux is not None:
            raise ValueError("the prefix stage takes NLI triplets as its main batch, not an aux batch")
        b, n, _ = batch.input_ids.shape
        modules = self.view_modules(b, n, batch.input_ids.device)
        states, _ = self.row_chunks.map(
            self.prefix_stage_states, batch.flat(batch.input_ids), batch.flat(batch.attention_mask), modules
        )
        loss, accuracy = self.nli_loss(self._outside_the_prefix_phase(self.mlp)(states).view(b, n, -1))
        return StepOutput(loss, {"loss_nli": loss.detach(), "nli_accuracy": accuracy})

    def joint_stage_step(self, batch: TrainBatch) -> StepOutput:
        """Stage 2: contrastive loss (+ α·NLI CE on `batch.aux` when α > 0), template denoising on the main rows."""
        check_views(batch.input_ids, batch.attention_mask, (2, 3), "joint-stage input_ids")
        b, n, t = batch.input_ids.shape
        device = batch.input_ids.device
        ids, mask = batch.flat(batch.input_ids), batch.flat(batch.attention_mask)
        modules = self.joint_modules(b, n, device)
        aux = batch.aux if self.config.aux_weight > 0 else None
        if self.config.aux_weight > 0 and aux is None:
            raise ValueError(f"aux_weight={self.config.aux_weight} needs an NLI batch in `batch.aux`")
        if aux is not None:
            # one forward for main and auxiliary rows, as the reference (rows are right-padded to one length)
            check_views(aux.input_ids, aux.attention_mask, (3,), "aux input_ids")
            ab, an, at = aux.input_ids.shape
            width = max(t, at)
            pad = self.template_pad_id
            ids = torch.cat(
                [F.pad(ids, (0, width - t), value=pad), F.pad(aux.flat(aux.input_ids), (0, width - at), value=pad)]
            )
            mask = torch.cat([F.pad(mask, (0, width - t)), F.pad(aux.flat(aux.attention_mask), (0, width - at))])
            modules = torch.cat([modules, self.joint_modules(ab, an, device)])
        # whole, or in cached chunks of rows under grad_cache (models/grad_cache.py); denoising, the MLP and both
        # losses run on all rows' states
        states, lengths = self.row_chunks.map(self.mask_states, ids, mask, modules)
        rows = b * n
        main = states[:rows]
        if self.config.denoise:
            main = self.denoise(main, lengths[:rows], modules[:rows])
        z = self.mlp(main).view(b, n, -1)
        l_cl = contrastive_loss(*z.unbind(1), temperature=self.config.temperature)
        metrics = {"loss_contrastive": l_cl.detach()}
        loss = l_cl
        if aux is not None:
            l_nli, accuracy = self.nli_loss(self.mlp(states[rows:]).view(ab, an, -1))
            loss = l_cl + self.config.aux_weight * l_nli
            metrics.update(loss_nli=l_nli.detach(), nli_accuracy=accuracy)
        return StepOutput(loss, metrics)

    def training_step(self, batch: TrainBatch, step: int | torch.Tensor = 0, phase: str = "joint") -> StepOutput:
        if phase == "prefix":
            return self.prefix_stage_step(batch)
        if phase == "joint":
            return self.joint_stage_step(batch)
        raise ValueError(f"{self.method} has phases {self.phases}, not {phase!r}")

    def embed(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Evaluation embedding `(B, d)`: raw [MASK] state with all 16 prefix slots visible, no MLP, no denoising.

        Rows come from `token_ids` (the evaluation template); the state is read at the last attended mask token
        of each row (the template's, even if a sentence spells out a mask token itself).
        """
        out = self.encoder(
            input_ids, attention_mask, token_type_ids, prefix=self.prefix_sample(None, input_ids.shape[0])
        )
        is_mask = (input_ids == self.mask_token_id) & attention_mask.bool()
        has = is_mask.any(dim=1)
        if not bool(has.all()):
            raise ValueError(
                f"{int((~has).sum())} of {len(has)} rows contain no mask token (id {self.mask_token_id}); "
                "DiffAug rows must be made by `token_ids` (the prompt template)"
            )
        last = input_ids.shape[1] - 1 - is_mask.flip(1).to(torch.int8).argmax(dim=1)
        return out.last_hidden_state[torch.arange(input_ids.shape[0], device=input_ids.device), last]

    def peft_plan(self, plan: PeftPlan) -> PeftPlan:
        """The PEFT adapter: [MASK] pooling of the evaluation template, all 16 slots visible (the inference form)."""
        from cse.models.export import peft_loader

        template = self.eval_head + peft_loader.SENTENCE_PLACEHOLDER + self.eval_tail
        plan.pooling = {"kind": "mask", "template": template, "mask_token_id": int(self.mask_token_id)}
        plan.notes.append(
            f"template: DiffAug embeds the prompt {template!r} and reads the last [MASK] state; neither "
            "PEFT nor sentence-transformers' Pooling applies a template, peft_embed.py and "
            "cse_peft.json do"
        )
        half = self.config.module_len
        plan.notes.append(
            f"diffaug-two-modules: the two prefix modules (slots 0-{half - 1} / {half}-{2 * half - 1}, "
            "selected per row by half masks) are training-only; PEFT has no per-slot visibility mask, so "
            "the adapter is the inference form (all slots visible) and the modules cannot be used "
            "separately"
        )
        plan.notes.append("training-heads: DiffAug's MLP, NLI classifier and template denoising are training-only")
        return plan

    def describe(self) -> dict:
        return {
            **super().describe(),
            "prefix_len": self.config.prefix_len,
            "template": self.config.template,
            "denoise": self.config.denoise,
            "denoise_index_quirk": self.config.denoise_index_quirk,
            "aux_weight": self.config.aux_weight,
            "shared_prefix": self.config.shared_prefix,
        }

    # --- for the benchmarks (benchmarks/dry_run.py) ---
    def dry_run_batch_independent_forward(self) -> Callable[[], torch.Tensor] | None:
        """The batch-independent part of a joint step that benchmarks/dry_run.py times on its own: a function
        returning a scalar of the template denoising to backpropagate (None without denoising)."""
        return (lambda: self.template_deltas().float().sum()) if self.config.denoise else None
