"""SentEval's logistic-regression probe, trained for many (fold, L2 penalty) jobs at once.

One fit = one SentEval `MLP(nhid=0)` fit: a `Linear(d, C)` on frozen features, cross-entropy (mean over the
batch), Adam or RMSprop with PyTorch's defaults (lr 1e-3 / 1e-2) and the L2 penalty as the optimiser's
(coupled) `weight_decay` on weight and bias, mini-batches of `batch_size` in a fresh shuffle per epoch,
`epoch_size` epochs between two validation scores, early stopping with `tenacity`, at most `max_epoch`
epochs, the weights of the best validation accuracy kept. What SentEval's code does and its description
leaves open, reproduced here:

* the early-stopping counter is never reset: training stops at the (tenacity + 1)-th validation score that
  does not beat the best so far, counted over the whole fit, not consecutively;
* the loop runs while `epochs done <= max_epoch`, so a fit can train up to `max_epoch + epoch_size` epochs;
* every fit starts from the same state: the generators are seeded with `seed` (1111) when the classifier is
  built, so the initial weights are `nn.Linear`'s default init drawn from `torch.manual_seed(seed)` and
  the shuffles are `numpy.random.RandomState(seed)` permutations (the first one splits off the validation
  fraction when a fit has no validation set of its own). Both are reproduced per job, so a job sees the
  initial weights and the shuffles SentEval's fit would see;
* SentEval sets `loss_fn.size_average = False` after building the loss, which PyTorch >= 0.4 (what SimCSE
  and DiffCSE ran) ignores: the loss is the batch mean, as here.

The fits run side by side as one batched model (`torch.bmm`), on the device of the features. Fits that differ
only in their penalty share their mini-batches (a `Group`: SentEval re-seeds every fit, so they see the same
shuffles); each fit keeps its own weights, optimiser state and early stopping, and a group leaves the batch when all
its fits have stopped. Gradients are computed in closed form (softmax − one-hot), which is what autograd
computes for this model. Results equal SentEval's up to floating-point summation order.

Reference: Conneau and Kiela (2018), *SentEval: An Evaluation Toolkit for Universal Sentence Representations*
(`facebookresearch/SentEval`, `senteval/tools/classifier.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

OPTIMIZERS = ("adam", "rmsprop")


@dataclass(frozen=True)
class ClassifierSettings:
    """SentEval's classifier parameters (`params['classifier']`) plus `kfold`, the seed and the penalty grid.

    `TEST` and `FASTTEST` are the two settings SimCSE's and DiffCSE's `evaluation.py` use.

    Attributes:
        optim: `adam` or `rmsprop`.
        batch_size: rows per mini-batch.
        tenacity: validation scores without improvement before a fit stops (counted over the whole fit).
        epoch_size: epochs between two validation scores.
        max_epoch: the epoch limit.
        kfold: folds of the cross-validations.
        seed: the seed of every fit's initial weights and shuffles.
        regs: the L2 penalties searched.
        validation_split: the held-out fraction of a final fit that has no validation set.

    Examples:
        >>> from cse.evaluation.classifier import SETTINGS
        >>> SETTINGS["fasttest"].optim, SETTINGS["fasttest"].kfold
        ('rmsprop', 5)
    """

    optim: str = "adam"
    batch_size: int = 64
    tenacity: int = 5
    epoch_size: int = 4
    max_epoch: int = 200
    kfold: int = 10
    seed: int = 1111
    regs: tuple[float, ...] = tuple(10.0**t for t in range(-5, -1))  # SentEval with usepytorch: 1e-5 … 1e-2
    validation_split: float = 0.05  # the held-out fraction of a final fit that has no validation set

    def __post_init__(self):
        if self.optim not in OPTIMIZERS:
            raise ValueError(f"unknown optimiser {self.optim!r}; known: {', '.join(OPTIMIZERS)}")
        if self.batch_size < 1 or self.epoch_size < 1 or self.tenacity < 0 or self.kfold < 2 or not self.regs:
            raise ValueError(f"invalid classifier settings {self}")


# SimCSE/DiffCSE evaluation.py: "test" = the papers' numbers; "fasttest" = the dev mode used during training.
TEST = ClassifierSettings(optim="adam", batch_size=64, tenacity=5, epoch_size=4, kfold=10)
FASTTEST = ClassifierSettings(optim="rmsprop", batch_size=128, tenacity=3, epoch_size=2, kfold=5)
SETTINGS = {"test": TEST, "fasttest": FASTTEST}


@dataclass
class Group:
    """Fits that share their training rows, validation rows and shuffles and differ only in the L2 penalty.

    SentEval seeds every classifier with the same seed when it builds it, so the fits of one (fold, data) for
    several penalties see the same initial weights and the same shuffles: they run here as one group, reading
    each mini-batch once. `train` / `valid` are row indices into the shared feature matrix."""

    train: np.ndarray
    valid: np.ndarray
    regs: tuple[float, ...]
    rng: np.random.RandomState = field(repr=False, default=None)  # positioned where SentEval's would be


@dataclass
class Fitted:
    """A finished fit: its best validation accuracy (a fraction) and the weights that reached it."""

    valid_accuracy: float
    weight: Tensor  # [d, C]
    bias: Tensor  # [C]
    epochs: int
    reg: float

    def predict(self, x: Tensor) -> Tensor:
        """The predicted class of every row of `x` (`[N, d]` features).

        Args:
            x: `[N, d]` features.
        """
        return (x.to(self.weight.device, self.weight.dtype) @ self.weight + self.bias).argmax(dim=1)


def group(
    train: np.ndarray,
    regs: Sequence[float],
    seed: int,
    valid: np.ndarray | None = None,
    validation_split: float | None = None,
) -> Group:
    """A group with SentEval's data preparation.

    With `valid` the fits validate on it; else the first permutation of the seeded generator moves
    `int(validation_split * n)` training rows to the validation side.

    Args:
        train: row indices of the training rows.
        regs: the L2 penalties, one fit each.
        seed: the seed of the group's shuffles.
        valid: row indices of the validation rows, or None to split them off `train`.
        validation_split: the fraction split off when `valid` is None.

    Raises:
        ValueError: no validation rows, no training rows or no penalty.

    Examples:
        >>> import numpy as np
        >>> from cse.evaluation.classifier import group
        >>> g = group(np.arange(100), regs=[1e-5, 1e-4], seed=1111, validation_split=0.05)
        >>> len(g.train), len(g.valid), g.regs
        (95, 5, (1e-05, 0.0001))
    """
    rng = np.random.RandomState(seed)
    train = np.asarray(train, dtype=np.int64)
    if valid is None:
        if not validation_split:
            raise ValueError("a fit needs validation rows or a validation_split")
        perm = rng.permutation(len(train))
        cut = int(validation_split * len(train))
        train, valid = train[perm[cut:]], train[perm[:cut]]
    valid = np.asarray(valid, dtype=np.int64)
    if len(train) == 0 or len(valid) == 0:
        raise ValueError(f"a fit needs training and validation rows (got {len(train)} and {len(valid)})")
    if not regs:
        raise ValueError("a group needs at least one L2 penalty")
    return Group(train=train, valid=valid, regs=tuple(float(r) for r in regs), rng=rng)


def initial_weights(d: int, nclasses: int, seed: int) -> tuple[Tensor, Tensor]:
    """`nn.Linear(d, nclasses)`'s default init under `torch.manual_seed(seed)`, as `[d, C]` weight and `[C]` bias.

    Args:
        d: the feature size.
        nclasses: C, the number of classes.
        seed: the seed SentEval gives every classifier (1111).

    Examples:
        >>> import torch
        >>> from cse.evaluation.classifier import initial_weights
        >>> w, b = initial_weights(4, 2, seed=1111)
        >>> _ = torch.manual_seed(1111)
        >>> layer = torch.nn.Linear(4, 2)
        >>> torch.equal(w, layer.weight.t()), torch.equal(b, layer.bias)
        (True, True)
    """
    g = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(d)
    w = torch.empty(nclasses, d).uniform_(-bound, bound, generator=g)  # kaiming_uniform(a=√5) on [C, d]
    b = torch.empty(nclasses).uniform_(-bound, bound, generator=g)
    return w.t().contiguous(), b


def fit_groups(
    x: Tensor, y: Tensor, nclasses: int, groups: Sequence[Group], settings: ClassifierSettings, chunk: int = 16
) -> list[list[Fitted]]:
    """Train every group's fits (SentEval's `fit`, one per penalty), `chunk` groups side by side.

    Args:
        x: `[N, d]` float32 features, on the device the fits run on.
        y: `[N]` int64 labels on the same device.
        nclasses: the number of classes.
        groups: the groups to fit (see `group`).
        settings: the classifier settings.
        chunk: how many groups train side by side as one batched model.

    Returns:
        Per group, one `Fitted` per penalty, in `regs` order.

    Examples:
        >>> import numpy as np, torch
        >>> from cse.evaluation.classifier import FASTTEST, fit_groups, group
        >>> x = torch.cat([torch.full((20, 2), -1.0), torch.full((20, 2), 1.0)])
        >>> y = torch.cat([torch.zeros(20), torch.ones(20)]).long()
        >>> g = group(np.arange(40), regs=FASTTEST.regs, seed=1111, validation_split=0.25)
        >>> fits = fit_groups(x, y, 2, [g], FASTTEST)[0]
        >>> [f.valid_accuracy for f in fits]  # separable data
        [1.0, 1.0, 1.0, 1.0]
    """
    out: list[list[Fitted] | None] = [None] * len(groups)
    by_width: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_width.setdefault(len(g.regs), []).append(i)
    for idx in by_width.values():
        for i in range(0, len(idx), chunk):
            part = idx[i : i + chunk]
            for k, fits in zip(part, _fit_batch(x, y, nclasses, [groups[k] for k in part], settings)):
                out[k] = fits
    return out  # type: ignore[return-value]


def _batches(
    groups: list[Group], alive: np.ndarray, sizes: np.ndarray, bs: int, device
) -> tuple[Tensor, Tensor, Tensor, int]:
    """One epoch of shuffled mini-batches per live group: row indices [G, S, bs], per-row weights 1/|batch| (0 on
    padding) and the [G, S] mask of real steps."""
    nsteps = -(-sizes // bs)
    smax = int(nsteps.max())
    idx = np.zeros((len(alive), smax * bs), dtype=np.int64)
    wgt = np.zeros((len(alive), smax * bs), dtype=np.float32)
    for j, k in enumerate(alive):
        n = sizes[j]
        idx[j, :n] = groups[k].train[groups[k].rng.permutation(n)]
        pos = np.arange(n)
        wgt[j, :n] = 1.0 / np.minimum(bs, n - (pos // bs) * bs)  # mean over each batch, the last one possibly short
    g = len(alive)
    return (
        torch.from_numpy(idx).to(device).view(g, smax, bs),
        torch.from_numpy(wgt).to(device).view(g, smax, bs),
        torch.from_numpy(nsteps[:, None] > np.arange(smax)[None, :]).to(device),
        smax,
    )


def _accuracy(
    x: Tensor, y: Tensor, w: Tensor, b: Tensor, rows: list[np.ndarray], r: int, c: int, max_floats: int = 1 << 24
) -> np.ndarray:
    """[G, R] accuracy of each group's R weight blocks on its rows."""
    out = np.zeros((len(rows), r))
    d = x.shape[1]
    i = 0
    while i < len(rows):
        longest = max(len(q) for q in rows[i:])
        step = max(1, min(len(rows) - i, max_floats // max(1, longest * d)))
        part = rows[i : i + step]
        n = max(len(q) for q in part)
        idx = np.zeros((len(part), n), dtype=np.int64)
        mask = np.zeros((len(part), n), dtype=bool)
        for j, q in enumerate(part):
            idx[j, : len(q)], mask[j, : len(q)] = q, True
        it = torch.from_numpy(idx).to(x.device)
        pred = torch.baddbmm(b[i : i + step], x[it], w[i : i + step]).view(len(part), n, r, c).argmax(dim=3)
        ok = (pred == y[it].unsqueeze(2)) & torch.from_numpy(mask).to(x.device).unsqueeze(2)
        out[i : i + step] = ok.sum(dim=1).cpu().numpy() / np.array([len(q) for q in part])[:, None]
        i += step
    return out


def _fit_batch(x: Tensor, y: Tensor, c: int, groups: list[Group], s: ClassifierSettings) -> list[list[Fitted]]:
    """Groups of one width R side by side: weights [G, d, R·C] (column r·C + k = class k of penalty r)."""
    dev = x.device
    g_all, d, bs, r = len(groups), x.shape[1], s.batch_size, len(groups[0].regs)
    w0, b0 = initial_weights(d, c, s.seed)
    w = w0.to(dev).repeat(1, r).expand(g_all, d, r * c).clone()
    b = b0.to(dev).repeat(r).expand(g_all, 1, r * c).clone()
    m1w, m1b = torch.zeros_like(w), torch.zeros_like(b)  # Adam's first moment (unused by RMSprop)
    m2w, m2b = torch.zeros_like(w), torch.zeros_like(b)  # second moment / square average
    steps = torch.zeros(g_all, 1, 1, device=dev)
    reg = torch.tensor(
        [[q for q in grp.regs for _ in range(c)] for grp in groups], device=dev, dtype=x.dtype
    ).unsqueeze(1)
    best_w, best_b = w.clone(), b.clone()
    best_acc = np.full((g_all, r), -1.0)
    count = np.zeros((g_all, r), dtype=np.int64)
    stopped = np.zeros((g_all, r), dtype=bool)
    epochs = np.zeros((g_all, r), dtype=np.int64)
    epochs_done = 0
    alive = np.arange(g_all)  # groups with a fit still training, in batch order
    b1, b2, eps, alpha = 0.9, 0.999, 1e-8, 0.99
    lr = 1e-3 if s.optim == "adam" else 1e-2

    def update(prm: Tensor, g: Tensor, m1: Tensor, m2: Tensor, act: Tensor | None) -> None:
        if s.optim == "adam":
            nm1 = m1 * b1 + g * (1 - b1)
            nm2 = m2 * b2 + g * g * (1 - b2)
            upd = nm1 / (nm2.sqrt() / torch.sqrt(1 - b2**steps) + eps) * (lr / (1 - b1**steps))
        else:  # rmsprop: alpha 0.99, eps 1e-8, no momentum, not centred
            nm1, nm2 = m1, m2 * alpha + g * g * (1 - alpha)
            upd = g / (nm2.sqrt() + eps) * lr
        if act is None:
            m1.copy_(nm1), m2.copy_(nm2), prm.sub_(upd)
        else:
            m1.copy_(torch.where(act, nm1, m1)), m2.copy_(torch.where(act, nm2, m2))
            prm.sub_(torch.where(act, upd, torch.zeros_like(upd)))

    while len(alive) and epochs_done <= s.max_epoch:
        sizes = np.array([len(groups[k].train) for k in alive])
        for _ in range(s.epoch_size):
            idx_t, wgt_t, active_t, smax = _batches(groups, alive, sizes, bs, dev)
            for st in range(smax):
                rows = idx_t[:, st]
                xb = x[rows]  # [G, bs, d]
                p = torch.softmax(torch.baddbmm(b, xb, w).view(len(alive), bs, r, c), dim=3)
                p.scatter_add_(
                    3, y[rows].view(len(alive), bs, 1, 1).expand(-1, -1, r, 1), torch.full_like(p[..., :1], -1.0)
                )
                p = p.mul_(wgt_t[:, st].view(len(alive), bs, 1, 1)).view(len(alive), bs, r * c)  # d(mean CE)/d logits
                gw = torch.bmm(xb.transpose(1, 2), p).add_(w * reg)
                gb = p.sum(dim=1, keepdim=True).add_(b * reg)
                act = active_t[:, st]
                full = bool(act.all())
                steps += act.view(-1, 1, 1).to(steps.dtype)
                a = None if full else act.view(-1, 1, 1)
                update(w, gw, m1w, m2w, a)
                update(b, gb, m1b, m2b, a)
        epochs_done += s.epoch_size
        acc = _accuracy(x, y, w, b, [groups[k].valid for k in alive], r, c)
        live = ~stopped[alive]
        better = (acc > best_acc[alive]) & live
        epochs[alive] = np.where(live, epochs_done, epochs[alive])  # the rounds each fit took part in
        best_acc[alive] = np.where(better, acc, best_acc[alive])
        cols = torch.from_numpy(np.repeat(better, c, axis=1)).to(dev).unsqueeze(1)  # [G, 1, R·C]
        sel = torch.from_numpy(alive).to(dev)
        best_w[sel] = torch.where(cols, w, best_w[sel])
        best_b[sel] = torch.where(cols, b, best_b[sel])
        worse = live & ~better
        stop_now = worse & (count[alive] >= s.tenacity)  # SentEval: the counter is never reset
        count[alive] += worse & ~stop_now
        stopped[alive] |= stop_now
        keep = np.flatnonzero(~stopped[alive].all(axis=1))
        if len(keep) < len(alive):
            k_t = torch.from_numpy(keep).to(dev)
            w, b, m1w, m1b, m2w, m2b, steps, reg = (
                t.index_select(0, k_t) for t in (w, b, m1w, m1b, m2w, m2b, steps, reg)
            )
            alive = alive[keep]
    return [
        [
            Fitted(
                valid_accuracy=float(best_acc[k, j]),
                weight=best_w[k, :, j * c : (j + 1) * c].clone(),
                bias=best_b[k, 0, j * c : (j + 1) * c].clone(),
                epochs=int(epochs[k, j]),
                reg=groups[k].regs[j],
            )
            for j in range(r)
        ]
        for k in range(g_all)
    ]
