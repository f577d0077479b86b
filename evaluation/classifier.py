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
from dataclasses import dataclass, field, fields

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

    def __post_init__(self) -> None:
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
    rng: np.random.RandomState = field(repr=False)  # positioned where SentEval's would be


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
    return out  # type: ignore[return-value]  # every slot filled: each group is in exactly one width's chunks


def _batches(
    groups: list[Group], alive: np.ndarray, sizes: np.ndarray, bs: int, device: torch.device
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


ADAM_BETAS = (0.9, 0.999)
RMSPROP_ALPHA = 0.99
EPS = 1e-8


def _update(optim: str, prm: Tensor, g: Tensor, m1: Tensor, m2: Tensor, steps: Tensor, act: Tensor | None) -> None:
    """One optimiser step of SentEval's optimiser on batched parameters, in place.

    Args:
        optim: "adam" (lr 1e-3) or "rmsprop" (lr 1e-2, alpha 0.99, no momentum, not centred).
        prm: the parameters, updated in place.
        g: their gradient.
        m1: Adam's first moment (unused by RMSprop), updated in place.
        m2: the second moment / square average, updated in place.
        steps: `[G, 1, 1]` steps taken per group (Adam's bias correction).
        act: `[G, 1, 1]` mask of the groups that take this step, or None for all.
    """
    b1, b2 = ADAM_BETAS
    if optim == "adam":
        nm1 = m1 * b1 + g * (1 - b1)
        nm2 = m2 * b2 + g * g * (1 - b2)
        upd = nm1 / (nm2.sqrt() / torch.sqrt(1 - b2**steps) + EPS) * (1e-3 / (1 - b1**steps))
    else:
        nm1, nm2 = m1, m2 * RMSPROP_ALPHA + g * g * (1 - RMSPROP_ALPHA)
        upd = g / (nm2.sqrt() + EPS) * 1e-2
    if act is None:
        m1.copy_(nm1), m2.copy_(nm2), prm.sub_(upd)
    else:
        m1.copy_(torch.where(act, nm1, m1)), m2.copy_(torch.where(act, nm2, m2))
        prm.sub_(torch.where(act, upd, torch.zeros_like(upd)))


@dataclass
class _Batched:
    """The live groups' fits side by side: weights `[G, d, R·C]` (column r·C + k = class k of penalty r), biases
    `[G, 1, R·C]`, their first and second moments, the steps each group took `[G, 1, 1]` and the penalties
    `[G, 1, R·C]`."""

    w: Tensor
    b: Tensor
    m1w: Tensor
    m1b: Tensor
    m2w: Tensor
    m2b: Tensor
    steps: Tensor
    reg: Tensor

    @classmethod
    def start(cls, x: Tensor, c: int, groups: list[Group], seed: int) -> _Batched:
        """Every fit at `nn.Linear`'s initial weights under `seed`, with zero moments and steps.

        Args:
            x: `[N, d]` features (their device and dtype).
            c: the number of classes.
            groups: the groups, all of one width R.
            seed: the classifiers' seed.
        """
        dev, g_all, r = x.device, len(groups), len(groups[0].regs)
        w0, b0 = initial_weights(x.shape[1], c, seed)
        w = w0.to(dev).repeat(1, r).expand(g_all, x.shape[1], r * c).clone()
        b = b0.to(dev).repeat(r).expand(g_all, 1, r * c).clone()
        reg = torch.tensor([[q for q in grp.regs for _ in range(c)] for grp in groups], device=dev, dtype=x.dtype)
        steps = torch.zeros(g_all, 1, 1, device=dev)
        zeros = torch.zeros_like
        return cls(w, b, zeros(w), zeros(b), zeros(w), zeros(b), steps, reg.unsqueeze(1))

    def keep(self, rows: Tensor) -> None:
        """Keep only the groups at `rows` (indices into the live groups).

        Args:
            rows: the indices of the groups that go on training.
        """
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name).index_select(0, rows))

    def step(self, x: Tensor, y: Tensor, rows: Tensor, wgt: Tensor, act: Tensor, c: int, optim: str) -> None:
        """One mini-batch step of every live group: the mean cross-entropy's gradient plus the L2 term.

        Args:
            x: `[N, d]` features.
            y: `[N]` labels.
            rows: `[G, bs]` row indices of each group's batch.
            wgt: `[G, bs]` per-row weights (1/|batch|, 0 on padding).
            act: `[G]` which groups have a real step here.
            c: the number of classes.
            optim: the optimiser's name.
        """
        g, bs, r = rows.shape[0], rows.shape[1], self.w.shape[2] // c
        xb = x[rows]  # [G, bs, d]
        p = torch.softmax(torch.baddbmm(self.b, xb, self.w).view(g, bs, r, c), dim=3)
        p.scatter_add_(3, y[rows].view(g, bs, 1, 1).expand(-1, -1, r, 1), torch.full_like(p[..., :1], -1.0))
        p = p.mul_(wgt.view(g, bs, 1, 1)).view(g, bs, r * c)  # d(mean CE)/d logits
        gw = torch.bmm(xb.transpose(1, 2), p).add_(self.w * self.reg)
        gb = p.sum(dim=1, keepdim=True).add_(self.b * self.reg)
        full = bool(act.all())
        self.steps += act.view(-1, 1, 1).to(self.steps.dtype)
        a = None if full else act.view(-1, 1, 1)
        _update(optim, self.w, gw, self.m1w, self.m2w, self.steps, a)
        _update(optim, self.b, gb, self.m1b, self.m2b, self.steps, a)


@dataclass
class _Progress:
    """Per fit `[G, R]` of all the groups: the best validation accuracy and its weights, SentEval's early-stopping
    counter, whether it stopped and the rounds it took part in."""

    best_w: Tensor
    best_b: Tensor
    best_acc: np.ndarray
    count: np.ndarray
    stopped: np.ndarray
    epochs: np.ndarray

    @classmethod
    def start(cls, fits: _Batched, r: int) -> _Progress:
        """No validation yet: the initial weights as the best, every accuracy below any real one.

        Args:
            fits: the fits at their initial weights.
            r: R, the penalties of each group.
        """
        shape = (fits.w.shape[0], r)
        return cls(
            best_w=fits.w.clone(),
            best_b=fits.b.clone(),
            best_acc=np.full(shape, -1.0),
            count=np.zeros(shape, dtype=np.int64),
            stopped=np.zeros(shape, dtype=bool),
            epochs=np.zeros(shape, dtype=np.int64),
        )

    def record(
        self, acc: np.ndarray, alive: np.ndarray, epochs_done: int, fits: _Batched, c: int, tenacity: int
    ) -> np.ndarray:
        """Take one validation round of the live groups; return which of them have a fit still training.

        Args:
            acc: `[G_live, R]` validation accuracies.
            alive: the live groups' indices among all the groups.
            epochs_done: the epochs trained so far.
            fits: the live groups' current weights.
            c: the number of classes.
            tenacity: the rounds without improvement a fit may take before it stops.
        """
        live = ~self.stopped[alive]
        better = (acc > self.best_acc[alive]) & live
        self.epochs[alive] = np.where(live, epochs_done, self.epochs[alive])  # the rounds each fit took part in
        self.best_acc[alive] = np.where(better, acc, self.best_acc[alive])
        cols = torch.from_numpy(np.repeat(better, c, axis=1)).to(fits.w.device).unsqueeze(1)  # [G, 1, R·C]
        sel = torch.from_numpy(alive).to(fits.w.device)
        self.best_w[sel] = torch.where(cols, fits.w, self.best_w[sel])
        self.best_b[sel] = torch.where(cols, fits.b, self.best_b[sel])
        worse = live & ~better
        stop_now = worse & (self.count[alive] >= tenacity)  # SentEval: the counter is never reset
        self.count[alive] += worse & ~stop_now
        self.stopped[alive] |= stop_now
        return np.flatnonzero(~self.stopped[alive].all(axis=1))

    def fitted(self, groups: list[Group], c: int) -> list[list[Fitted]]:
        """Per group, one `Fitted` per penalty: its best accuracy and weights.

        Args:
            groups: all the groups.
            c: the number of classes.
        """
        return [
            [
                Fitted(
                    valid_accuracy=float(self.best_acc[k, j]),
                    weight=self.best_w[k, :, j * c : (j + 1) * c].clone(),
                    bias=self.best_b[k, 0, j * c : (j + 1) * c].clone(),
                    epochs=int(self.epochs[k, j]),
                    reg=groups[k].regs[j],
                )
                for j in range(len(groups[k].regs))
            ]
            for k in range(len(groups))
        ]


def _fit_batch(x: Tensor, y: Tensor, c: int, groups: list[Group], s: ClassifierSettings) -> list[list[Fitted]]:
    """Groups of one width R side by side (`_Batched`), SentEval's epochs and early stopping per fit (`_Progress`).

    Args:
        x: `[N, d]` features.
        y: `[N]` labels.
        c: the number of classes.
        groups: the groups, all of one width.
        s: the classifier settings.
    """
    fits = _Batched.start(x, c, groups, s.seed)
    progress = _Progress.start(fits, len(groups[0].regs))
    epochs_done = 0
    alive = np.arange(len(groups))  # groups with a fit still training, in batch order
    while len(alive) and epochs_done <= s.max_epoch:
        sizes = np.array([len(groups[k].train) for k in alive])
        for _ in range(s.epoch_size):
            idx_t, wgt_t, active_t, smax = _batches(groups, alive, sizes, s.batch_size, x.device)
            for st in range(smax):
                fits.step(x, y, idx_t[:, st], wgt_t[:, st], active_t[:, st], c, s.optim)
        epochs_done += s.epoch_size
        acc = _accuracy(x, y, fits.w, fits.b, [groups[k].valid for k in alive], len(groups[0].regs), c)
        keep = progress.record(acc, alive, epochs_done, fits, c, s.tenacity)
        if len(keep) < len(alive):
            fits.keep(torch.from_numpy(keep).to(x.device))
            alive = alive[keep]
    return progress.fitted(groups, c)
