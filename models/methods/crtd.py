"""The objective D2CSE and DiffCSE share: contrastive loss on `h` + λ · conditional replaced-token detection.

`ConditionalRTDModel` does the shape checks, RTD label defaulting (`corrupted != original` on real tokens), the
contrastive loss, the RTD loss and `training_step`; a subclass says how the rows are encoded (`encode_cls`, and
`encode_rows` in the training pass) and how its discriminator reads the corrupted rows conditioned on `h`
(`discriminate`, and `discriminate_rows` in the training pass). `rtd_h_probe` measures whether the discriminator uses which sentence `h`
describes: its loss with the true `h`, with another row's and with none (the training job logs it at every
evaluation, training/job.py).

References: Chuang et al. (2022), *DiffCSE: Difference-based Contrastive Learning for Sentence Embeddings*
(conditional replaced-token detection with a separate discriminator; `voidism/DiffCSE`); Lee (2023), *D2CSE:
Difference-aware Deep continuous prompts for Contrastive Sentence Embeddings* (the same objective with the prompted
encoder as its own discriminator).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F

from cse.models import distributed
from cse.models.batching import TrainBatch, check_views
from cse.models.heads import ProjectionMLP, RTDHead
from cse.models.losses import contrastive_loss, rtd_accuracy, rtd_loss
from cse.models.method import CSEModel, StepOutput

# The metric names of `ConditionalRTDModel.rtd_h_probe`'s figures, as a training run logs them (training/job.py) and its
# description shows them (cse.tracking.run_pages); `rtd_h_gap` = rolled − true.
PROBE_METRICS = {
    "true_h": "rtd_loss_true_h",
    "rolled_h": "rtd_loss_rolled_h",
    "no_h": "rtd_loss_no_h",
    "gap": "rtd_h_gap",
}
# The trainable groups `ConditionalRTDModel.rtd_grad_share` measures (`grad_group`). The contrastive loss reaches
# the first three; the discriminator's own copy (DiffCSE's, D2CSE's with `train_discriminator`) and the RTD head only
# the RTD loss.
GRAD_GROUPS = ("prompts", "mlp", "encoder", "discriminator", "rtd_head")
RTD_ONLY_GROUPS = ("discriminator", "rtd_head")


def grad_group(name: str) -> str:
    """The `GRAD_GROUPS` entry of a parameter by its name: deep or [CLS] prompts, the BN-MLP (`projection.`), the
    discriminator's own copy, the RTD head, else the encoder.

    Examples:
        >>> from cse.models.methods.crtd import grad_group
        >>> [grad_group(n) for n in ("encoder.prefix_encoder.embedding.weight", "projection.net.0.weight",
        ...                          "encoder.encoder.layer.0.output.dense.bias", "rtd_head.classifier.weight")]
        ['prompts', 'mlp', 'encoder', 'rtd_head']
    """
    if "prefix" in name or "prompt" in name:
        return "prompts"
    return {"projection": "mlp", "discriminator": "discriminator", "rtd_head": "rtd_head"}.get(
        name.split(".")[0], "encoder"
    )


def check_objective(temperature: float, rtd_weight: float) -> None:
    """Check the hyperparameters every contrastive + conditional-RTD config has.

    Args:
        temperature: τ of the contrastive loss; must be positive.
        rtd_weight: λ, the RTD loss weight; must be >= 0 (0 gives exactly the contrastive-only gradients).

    Raises:
        ValueError: a value out of range, naming it.

    Examples:
        >>> from cse.models.methods.crtd import check_objective
        >>> check_objective(temperature=0.05, rtd_weight=0.005)  # the D2CSE paper's values
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if rtd_weight < 0:
        raise ValueError(f"rtd_weight must be >= 0, got {rtd_weight}")


def align_corruption(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, corrupted_ids: torch.Tensor, rtd_labels: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked `(B, n, T)` corrupted ids and RTD labels for `(B, n, T)` rows, n = 2 (unsup) or 3 (sup).

    Labels default to `corrupted != original` on non-pad positions, as DiffCSE's reference code derives them.

    Args:
        input_ids: `(B, n, T)` original token ids.
        attention_mask: `(B, n, T)`, 1 on real tokens.
        corrupted_ids: `(B, n, T)`, or `(B, 1, T)` for one corruption shared by every view.
        rtd_labels: `(B, n, T)` or `(B, 1, T)` labels (1 = replaced), or None to derive them.

    Returns:
        `(corrupted_ids, rtd_labels)`, both `(B, n, T)`.

    Raises:
        ValueError: a shape that does not fit, naming both shapes.

    Examples:
        >>> import torch
        >>> from cse.models.methods.crtd import align_corruption
        >>> ids = torch.tensor([[[101, 7, 8, 102], [101, 7, 8, 102]]])
        >>> mask = torch.ones_like(ids)
        >>> corrupted, labels = align_corruption(ids, mask, torch.tensor([[[101, 9, 8, 102]]]), None)
        >>> labels.long().tolist()
        [[[0, 1, 0, 0], [0, 1, 0, 0]]]
    """
    check_views(input_ids, attention_mask)
    batch, n, length = input_ids.shape
    if corrupted_ids is None:
        raise ValueError("corrupted_ids are required (the corruption stage's output)")
    if (
        corrupted_ids.dim() != 3
        or corrupted_ids.shape[0] != batch
        or corrupted_ids.shape[1] not in (1, n)
        or corrupted_ids.shape[2] != length
    ):
        raise ValueError(
            f"corrupted_ids must be (B, {n}|1, T) = ({batch}, {n}|1, {length}), got {tuple(corrupted_ids.shape)}"
        )
    corrupted_ids = corrupted_ids.expand(batch, n, length)
    if rtd_labels is None:
        rtd_labels = (corrupted_ids != input_ids) & attention_mask.bool()
    elif rtd_labels.shape not in (corrupted_ids.shape, (batch, 1, length)):
        raise ValueError(f"rtd_labels must be (B, {n}|1, T), got {tuple(rtd_labels.shape)}")
    return corrupted_ids, rtd_labels.expand(batch, n, length)


class CRTDConfig(Protocol):
    """The fields of the objective a `ConditionalRTDModel`'s config carries (DiffCSE's, D2CSE's)."""

    temperature: float
    rtd_weight: float
    hard_negative_weight: float
    rtd_mean_over_padding: bool


@dataclass
class CRTDOutput:
    """The losses of one training forward.

    Attributes:
        loss: `L_CL + λ·L_RTD`.
        contrastive_loss: `L_CL` on `h`.
        rtd_loss: `L_RTD` of the discriminator.
        rtd_accuracy: the discriminator's accuracy on real tokens (no gradient).
        h: the `(B, n, d)` BN-MLP output.
    """

    loss: torch.Tensor
    contrastive_loss: torch.Tensor
    rtd_loss: torch.Tensor
    rtd_accuracy: torch.Tensor
    h: torch.Tensor


class ConditionalRTDModel(CSEModel):
    """Contrastive loss on the BN-MLP output `h` plus conditional replaced-token detection on precomputed corruptions.

    Per step on `(B, n, T)` rows flattened to `(B·n, T)`: `encode_rows` → CLS states → `self.projection`
    (BN-MLP over all B·n rows together) → `h` (contrastive vector and conditioning vector, not detached);
    contrastive loss on `h` (hard negatives when n = 3); `discriminate_rows` → RTD logits `(B·n, T, 2)` on
    the corrupted rows; `L = L_CL + λ·L_RTD` with the RTD mean over all positions (padding included) unless
    `rtd_mean_over_padding=False`. The config must carry `temperature`, `rtd_weight`,
    `hard_negative_weight` and `rtd_mean_over_padding`; subclasses set `projection` and `rtd_head`.

    References: Chuang et al. (2022), *DiffCSE*, equation 4 (`L = L_contrast + λ·L_RTD`); Lee (2023), *D2CSE*.

    Examples:
        A method that shares the objective implements `encode_cls` and `discriminate`; `encode_rows` and
        `discriminate_rows` default to those two with no context (`cse.models.methods.diffcse.DiffCSE` in full;
        `cse.models.methods.d2cse.D2CSE` overrides them to hand a prefix sample on):

        ```python
        class MyCRTD(ConditionalRTDModel):
            def encode_cls(self, input_ids, attention_mask, token_type_ids=None):
                return self.encoder(input_ids, attention_mask, token_type_ids).last_hidden_state[:, 0]

            def discriminate(self, corrupted_ids, attention_mask, h, token_type_ids=None):
                out = self.discriminator(corrupted_ids, attention_mask, token_type_ids, position0_output=h)
                return self.rtd_head(out.last_hidden_state)
        ```
    """

    uses_corruption = True
    evaluation_pooler = "cls_before_pooler"
    not_for_inference = ("discriminator.", "rtd_head.")
    projection: ProjectionMLP
    rtd_head: RTDHead

    if TYPE_CHECKING:  # every subclass defines it (the class docstring), a mixin's or its own

        def encode_cls(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
        ) -> torch.Tensor: ...

    def encode_rows(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, Any]:
        """Last-layer CLS states `(B', d)` of the training pass, and a context handed to `discriminate_rows`
        (default: the subclass's `encode_cls`, no context).

        Args:
            input_ids: `(B', T)` token ids, the views flattened.
            attention_mask: `(B', T)` token mask.
            token_type_ids: `(B', T)` segment ids, or None.
        """
        return self.encode_cls(input_ids, attention_mask, token_type_ids), None

    def discriminate_rows(
        self,
        corrupted_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        h: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        context: Any,
    ) -> torch.Tensor:
        """RTD logits `(B', T, 2)` of the training pass's discriminator on `(B', T)` corrupted rows given `h`
        (default: `discriminate` conditioned on `h`, the context unused).

        Args:
            corrupted_ids: `(B', T)` corrupted token ids.
            attention_mask: `(B', T)` token mask.
            h: `(B', d)` conditioning vectors (the BN-MLP output, not detached).
            token_type_ids: `(B', T)` segment ids, or None.
            context: what `encode_rows` returned beside the CLS states.
        """
        return self.discriminate(corrupted_ids, attention_mask, h, token_type_ids)

    @abstractmethod
    def discriminate(
        self,
        corrupted_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        h: torch.Tensor | None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RTD logits `(B', T, 2)` of the discriminator on `(B', T)` corrupted rows, its embedding output at position 0
        replaced by `h`, or its own [CLS] input when `h` is None, whatever the config says about conditioning (the
        mechanism probe, `rtd_h_probe`, calls it with the true, a rolled and no `h`).

        Args:
            corrupted_ids: `(B', T)` corrupted token ids.
            attention_mask: `(B', T)` token mask.
            h: `(B', d)` conditioning vectors, or None.
            token_type_ids: `(B', T)` segment ids, or None.
        """

    def encode_cls_rows(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """The CLS states of `encode_rows` without its context: the per-row pass grad_cache chunks."""
        return self.encode_rows(input_ids, attention_mask, token_type_ids)[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        corrupted_ids: torch.Tensor,
        rtd_labels: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> CRTDOutput:
        """One training forward on `(B, n, T)` rows, n = 2 (unsup, two dropout views) or 3 (sup, with hard negative).

        Args:
            input_ids: `(B, n, T)` token ids.
            attention_mask: `(B, n, T)` token mask.
            corrupted_ids: `(B, n, T)`, or `(B, 1, T)` for one corruption shared by every view.
            rtd_labels: labels of the same shape (1 = replaced), or None: `corrupted != original` on real tokens.
            token_type_ids: `(B, n, T)` segment ids, or None.

        Returns:
            The losses and `h`.
        """
        corrupted_ids, rtd_labels = align_corruption(input_ids, attention_mask, corrupted_ids, rtd_labels)
        batch, n, length = input_ids.shape
        rows = batch * n
        flat = lambda t: t.reshape(rows, length)
        ids, mask = flat(input_ids), flat(attention_mask)
        types = None if token_type_ids is None else flat(token_type_ids)

        chunks = self.row_chunks  # whole, or cached chunks of rows under grad_cache (models/grad_cache.py)
        if chunks.enabled:
            cls, context = chunks.map(self.encode_cls_rows, ids, mask, types), None
        else:
            cls, context = self.encode_rows(ids, mask, types)
        h = self.projection(cls)  # the BN-MLP over all B·n rows, as without the cache
        z = h.view(batch, n, -1)
        cfg = cast(CRTDConfig, self.config)  # every subclass's config carries the objective's fields
        l_cl = contrastive_loss(
            *z.unbind(1), temperature=cfg.temperature, hard_negative_weight=cfg.hard_negative_weight
        )

        # per row: chunk i of the discriminator pass reads chunk i of h, whose gradient flows back to the BN-MLP
        logits = chunks.map(self.discriminate_rows, flat(corrupted_ids), mask, h, types, context=context)
        labels = flat(rtd_labels)
        l_rtd = rtd_loss(logits, labels, mask, mean_over_padding=cfg.rtd_mean_over_padding)
        with torch.no_grad():
            acc = rtd_accuracy(logits, labels, mask)
        return CRTDOutput(
            loss=l_cl + cfg.rtd_weight * l_rtd, contrastive_loss=l_cl, rtd_loss=l_rtd, rtd_accuracy=acc, h=z
        )

    @torch.no_grad()
    def rtd_h_probe(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        corrupted_ids: torch.Tensor,
        rtd_labels: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        shift: int = 1,
    ) -> dict[str, float]:
        """Does the discriminator use which sentence `h` describes? Its RTD loss on `(B, T)` rows (one view each, every
        row a different sentence) conditioned on the true `h`, on `h` rolled by `shift` rows (another sentence's), and
        on no `h`, in eval mode (the mode the model was in is restored).

        A discriminator that reads the sentence in `h` has a lower loss with the true `h` than with the rolled one:
        `gap = rolled_h − true_h` > 0. One that ignores `h`, or whose conditioning is misaligned with the rows, gives
        `gap` ≈ 0; `no_h` tells whether it uses an `h`-like input at position 0 at all. The loss is the 2-class
        cross-entropy averaged over real tokens (the special tokens included), computed locally: the probe runs on one
        process (rank 0's evaluation) and makes no collective call.

        Args:
            input_ids: `(B, T)` original token ids, B >= 2.
            attention_mask: `(B, T)` token mask.
            corrupted_ids: `(B, T)` corrupted ids.
            rtd_labels: `(B, T)` labels (1 = replaced), or None: `corrupted != original` on real tokens.
            token_type_ids: `(B, T)` segment ids, or None.
            shift: rows to roll `h` by (1: the next row's sentence).

        Returns:
            `{"true_h", "rolled_h", "no_h", "gap"}` (floats).
        """
        if input_ids.dim() != 2 or input_ids.shape[0] < 2:
            raise ValueError(f"the probe needs (B, T) rows with B >= 2, got {tuple(input_ids.shape)}")
        if corrupted_ids.shape != input_ids.shape or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)}, attention_mask {tuple(attention_mask.shape)} and corrupted_ids "
                f"{tuple(corrupted_ids.shape)} must have one shape"
            )
        if rtd_labels is None:
            rtd_labels = (corrupted_ids != input_ids) & attention_mask.bool()
        was_training = self.training
        self.eval()
        try:
            h = self.projection(self.encode_cls_rows(input_ids, attention_mask, token_type_ids))
            keep = attention_mask.reshape(-1).float()
            labels = (rtd_labels.long() * attention_mask.long()).reshape(-1)
            out = {}
            for name, cond in (("true_h", h), ("rolled_h", h.roll(shift, dims=0)), ("no_h", None)):
                logits = self.discriminate(corrupted_ids, attention_mask, cond, token_type_ids)
                per_token = F.cross_entropy(logits.reshape(-1, 2).float(), labels, reduction="none")
                out[name] = float((per_token * keep).sum() / keep.sum().clamp_min(1.0))
        finally:
            self.train(was_training)
        out["gap"] = out["rolled_h"] - out["true_h"]
        return out

    def rtd_grad_share(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        corrupted_ids: torch.Tensor,
        rtd_labels: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Can the RTD term move anything? On `(B, T)` rows taken as one training batch (two dropout views of each
        row, the corruption shared by both), the norm of λ·∇L_RTD over the norm of ∇L_CL in each trainable group
        (`GRAD_GROUPS`, `grad_group`); for a group only the RTD loss reaches (`RTD_ONLY_GROUPS`) the share has no
        denominator, and ‖λ·∇L_RTD‖ itself is returned.

        It leaves the training as it was: the gradients come from `torch.autograd.grad` (no parameter's `.grad` is
        touched), the forward runs in train mode (dropout, BatchNorm on batch statistics, as a training step) under
        a forked random state (the CPU's and the rows' CUDA device's generators are restored), every buffer
        (BatchNorm's running statistics) is put back, and the mode the model was in is restored. Its losses are this
        process's (`distributed.local_only`): it issues no collective call, like the probe.

        Args:
            input_ids: `(B, T)` original token ids, B >= 2.
            attention_mask: `(B, T)` token mask.
            corrupted_ids: `(B, T)` corrupted ids.
            rtd_labels: `(B, T)` labels (1 = replaced), or None: `corrupted != original` on real tokens.

        Returns:
            `{"share_<group>": ‖λ∇L_RTD‖ / ‖∇L_CL‖}` for each group with trainable parameters that the contrastive
            loss reaches, and `{"norm_<group>": ‖λ∇L_RTD‖}` for each of `RTD_ONLY_GROUPS` with trainable parameters.
        """
        if input_ids.dim() != 2 or input_ids.shape[0] < 2:
            raise ValueError(f"the gradient share needs (B, T) rows with B >= 2, got {tuple(input_ids.shape)}")
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        saved = {n: b.detach().clone() for n, b in self.named_buffers()}
        cuda = [input_ids.device] if input_ids.device.type == "cuda" else []
        was_training = self.training
        self.train()
        try:
            with torch.random.fork_rng(devices=cuda), torch.enable_grad(), distributed.local_only():
                views = (t.unsqueeze(1).expand(-1, 2, -1) for t in (input_ids, attention_mask))  # two dropout views
                labels = None if rtd_labels is None else rtd_labels.unsqueeze(1)
                out = self(*views, corrupted_ids.unsqueeze(1), labels)
                g_cl = torch.autograd.grad(out.contrastive_loss, params, retain_graph=True, allow_unused=True)
                g_rtd = torch.autograd.grad(out.rtd_loss, params, allow_unused=True)
        finally:
            with torch.no_grad():
                for n, b in self.named_buffers():
                    b.copy_(saved[n])
            self.train(was_training)
        sq: dict[str, list[float]] = {}
        for (name, _), cl, rtd in zip(named, g_cl, g_rtd):
            acc = sq.setdefault(grad_group(name), [0.0, 0.0])
            acc[0] += 0.0 if cl is None else float(cl.float().pow(2).sum())
            acc[1] += 0.0 if rtd is None else float(rtd.float().pow(2).sum())
        weight = cast(CRTDConfig, self.config).rtd_weight
        shares: dict[str, float] = {}
        for group in (g for g in GRAD_GROUPS if g in sq):
            cl_norm, rtd_norm = sq[group][0] ** 0.5, weight * sq[group][1] ** 0.5
            if group in RTD_ONLY_GROUPS or cl_norm == 0.0:
                shares[f"norm_{group}"] = rtd_norm
            else:
                shares[f"share_{group}"] = rtd_norm / cl_norm
        return shares

    def training_step(self, batch: TrainBatch, step: int | torch.Tensor = 0, phase: str = "main") -> StepOutput:
        """The loss of one batch and its logged terms (`loss_contrastive`, `loss_rtd`, `rtd_accuracy`).

        Args:
            batch: the training rows with their corruptions.
            step: the optimiser step (unused: the objective has no schedule).
            phase: the training phase (these methods have one, `main`).
        """
        out = self(batch.input_ids, batch.attention_mask, batch.corrupted_ids, batch.rtd_labels)
        return StepOutput(
            out.loss,
            {
                "loss_contrastive": out.contrastive_loss.detach(),
                "loss_rtd": out.rtd_loss.detach(),
                "rtd_accuracy": out.rtd_accuracy,
            },
        )
