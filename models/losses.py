"""Training objectives: the in-batch contrastive loss and replaced-token detection.

The contrastive loss is SimCSE's (Gao et al., 2021, *SimCSE: Simple Contrastive Learning of Sentence Embeddings*;
reference code `princeton-nlp/SimCSE`); replaced-token detection is ELECTRA's discriminator objective as DiffCSE
conditions it on the sentence embedding (Chuang et al., 2022, *DiffCSE: Difference-based Contrastive Learning for
Sentence Embeddings*; reference code `voidism/DiffCSE`). Every loss here is distributed-aware: under
`torch.distributed` with more than one rank it equals the single-process loss of the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cse.models import distributed


def cosine_logits(a: torch.Tensor, b: torch.Tensor, temperature: float) -> torch.Tensor:
    """The temperature-scaled cosine-similarity matrix `S[i, j] = cos(a_i, b_j) / τ`.

    Computed in float32 (eps 1e-8, as `nn.CosineSimilarity`), as SimCSE's `Similarity` module.

    Args:
        a: `(N, d)` embeddings, the rows of `S`.
        b: `(M, d)` embeddings, the columns of `S`.
        temperature: τ; SimCSE and its successors use 0.05.

    Returns:
        The `(N, M)` float32 logits.

    Examples:
        >>> import torch
        >>> from cse.models.losses import cosine_logits
        >>> x = torch.eye(2)
        >>> cosine_logits(x, x, temperature=0.5)
        tensor([[2., 0.],
                [0., 2.]])
    """
    return F.cosine_similarity(a.float().unsqueeze(1), b.float().unsqueeze(0), dim=-1, eps=1e-8) / temperature


def contrastive_loss(
    z1: torch.Tensor,
    z2: torch.Tensor,
    z3: torch.Tensor | None = None,
    *,
    temperature: float = 0.05,
    hard_negative_weight: float = 0.0,
) -> torch.Tensor:
    """SimCSE's in-batch contrastive loss (InfoNCE): the mean cross-entropy of `z1_i` against its positive `z2_i`.

    Every other `z2_j` of the batch is a negative. Unsupervised (SimCSE's two dropout views of one sentence): the
    logits are `B×B`. Supervised (`z3` = the NLI contradictions as hard negatives): `B×2B`, every hard negative of
    the batch is a negative for every anchor, and `hard_negative_weight` is added to the logit at `(i, B+i)` only
    (0 means weight 1, SimCSE's default).

    Distributed training (torch.distributed initialised, world > 1): `z1`/`z2`/`z3` are the rank's slice; they are
    all-gathered (the local slice keeps its gradient) and every rank computes the loss of the global batch with
    global targets, so its backward gives the full gradient of its own rows (`cse.models.distributed`).

    Reference: Gao, Yao, Chen (2021), *SimCSE: Simple Contrastive Learning of Sentence Embeddings*, equations 1
    and 5; `princeton-nlp/SimCSE`, `cl_forward`.

    Args:
        z1: `(B, d)` anchors.
        z2: `(B, d)` positives; `z2[i]` is the target of `z1[i]`.
        z3: `(B, d)` hard negatives, or None (unsupervised).
        temperature: τ of the cosine logits.
        hard_negative_weight: added to each anchor's own hard-negative logit (SimCSE's `hard_negative_weight`).

    Returns:
        The scalar loss.

    Examples:
        >>> import torch
        >>> from cse.models.losses import contrastive_loss
        >>> z = torch.nn.functional.one_hot(torch.arange(4)).float()
        >>> round(contrastive_loss(z, z, temperature=0.05).item(), 6)  # every positive far above the negatives
        0.0
        >>> round(contrastive_loss(z, z.roll(1, 0), temperature=0.05).item(), 1)  # every positive is wrong
        20.0
    """
    if distributed.is_distributed():
        views = [z1, z2] if z3 is None else [z1, z2, z3]
        gathered = distributed.gather_with_local_grad(torch.stack(views, dim=1)).unbind(1)
        z1, z2, z3 = gathered[0], gathered[1], (gathered[2] if z3 is not None else None)
    logits = cosine_logits(z1, z2, temperature)
    if z3 is not None:
        hard = cosine_logits(z1, z3, temperature)
        if hard_negative_weight != 0.0:
            hard = hard + hard_negative_weight * torch.eye(
                hard.shape[0], hard.shape[1], device=hard.device, dtype=hard.dtype
            )
        logits = torch.cat([logits, hard], dim=1)
    targets = torch.arange(logits.shape[0], device=logits.device)
    return F.cross_entropy(logits, targets)


def rtd_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor,
    mean_over_padding: bool = True,
) -> torch.Tensor:
    """Replaced-token detection: the 2-class cross-entropy of `(N, T, 2)` logits against `(N, T)` labels.

    Label 1 means the generator replaced the token, 0 that it is the original. DiffCSE's reference code averages
    over all N·T positions of the batch padded to its longest row, padding included (pads carry label 0): that is
    `mean_over_padding=True`, the default (positions past the longest row of a batch padded further do not count);
    `False` averages over the non-pad positions only. Distributed training: the mean over the positions of the
    global batch (`cse.models.distributed.global_mean`).

    Reference: Chuang et al. (2022), *DiffCSE: Difference-based Contrastive Learning for Sentence Embeddings*,
    equation 3; `voidism/DiffCSE`. Lee (2023), *D2CSE*, uses the same term.

    Args:
        logits: `(N, T, 2)` discriminator logits.
        labels: `(N, T)`, 1 where the token was replaced; positions outside `attention_mask` count as 0.
        attention_mask: `(N, T)`, 1 on real tokens.
        mean_over_padding: average over every position (the reference code) or over real tokens only.

    Returns:
        The scalar loss (float32).

    Examples:
        >>> import torch
        >>> from cse.models.losses import rtd_loss
        >>> labels = torch.tensor([[0, 1, 0]])
        >>> confident = torch.nn.functional.one_hot(labels, 2).float() * 20
        >>> rtd_loss(confident, labels, torch.ones(1, 3)).item() < 1e-6
        True
    """
    labels = labels.long() * attention_mask.long()
    per_token = F.cross_entropy(logits.reshape(-1, 2).float(), labels.reshape(-1), reduction="none")
    if mean_over_padding:
        # The reference pads every batch to its longest row, so its positions are rows × that length. Columns past
        # it (a batch padded to a fixed length, training/rows.py) are left out, which keeps the mean the reference's
        # whatever the padding; nothing is read on the host.
        rows, length = attention_mask.shape
        longest = distributed.global_max(attention_mask.sum(-1).max())
        window = (torch.arange(length, device=per_token.device) < longest).to(per_token.dtype)
        total = (per_token.view(rows, length) * window).sum()
        return distributed.global_mean(total, rows * longest)
    keep = attention_mask.reshape(-1).to(per_token.dtype)
    return distributed.global_mean((per_token * keep).sum(), keep.sum())


def rtd_accuracy(logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The share of non-pad positions whose argmax matches the label (DiffCSE's `electra_acc`, `voidism/DiffCSE`).

    Args:
        logits: `(N, T, 2)` discriminator logits.
        labels: `(N, T)`, 1 where the token was replaced.
        attention_mask: `(N, T)`, 1 on the positions that count.

    Returns:
        A scalar float tensor in [0, 1] (over the global batch under distributed training).

    Examples:
        >>> import torch
        >>> from cse.models.losses import rtd_accuracy
        >>> logits = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]])
        >>> rtd_accuracy(logits, torch.tensor([[0, 1, 0]]), torch.tensor([[1, 1, 0]])).item()
        1.0
    """
    keep = attention_mask.bool()
    correct = (logits.argmax(-1) == labels.long()) & keep
    return distributed.global_ratio(correct.sum(), keep.sum())


def cross_entropy_mean(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), labels)`, the mean over the labelled rows; no rows give a zero loss on the graph.

    For an auxiliary classification term of a new method, of the kind of DiffAug's NLI cross-entropy (Wang and Lu,
    2022, *Differentiable Data Augmentation for Contrastive Sentence Representation Learning*) and DCPCSE's MLM loss
    (Jiang and Wang, 2022, *Deep Continuous Prompt for Contrastive Learning of Sentence Embeddings*), which those two
    methods compute in place (DCPCSE as a sum over its masked positions through `global_mean`). Distributed training:
    the mean over the labelled rows of the global batch (`cse.models.distributed.global_mean`), so the term equals the
    single-process one. Every rank must call it, also one without labelled rows.

    Args:
        logits: `(N, C)` class logits.
        labels: `(N,)` class ids; `ignore_index` marks rows that do not count.
        ignore_index: the label of rows left out of the mean.

    Returns:
        The scalar loss (float32).

    Examples:
        >>> import torch
        >>> from cse.models.losses import cross_entropy_mean
        >>> cross_entropy_mean(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)).item()
        0.0
        >>> round(cross_entropy_mean(torch.zeros(2, 4), torch.tensor([1, -100])).item(), 4)  # ln 4 over one row
        1.3863
    """
    if not distributed.is_distributed():
        if logits.shape[0] == 0:
            return logits.sum() * 0.0
        return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index)
    per_row = F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="none")
    return distributed.global_mean(per_row.sum(), (labels != ignore_index).sum())
