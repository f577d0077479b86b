"""PNG plots (matplotlib Agg): cosine distribution per gold bucket (DiffCSE Fig. 2) and the
alignment–uniformity point of a run beside the papers' points (Lee, 2023, *D2CSE*, Fig. 3; Gao et al., 2021,
*SimCSE*, Fig. 2)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

# (alignment, uniformity) reported on STS-B test; DiffCSE Table 11 and D2CSE's table.
PAPER_ALIGN_UNIFORM: dict[str, tuple[float, float]] = {
    "avg. BERT-base": (0.172, -1.468),
    "SimCSE unsup": (0.177, -2.313),
    "DiffCSE unsup": (0.097, -1.438),
    "DCPCSE unsup (D2CSE)": (0.0842, -1.5074),
    "D2CSE unsup": (0.062, -1.2627),
    "D2CSE sup": (0.0862, -2.1093),
}

GOLD_BUCKETS: tuple[tuple[float, float], ...] = ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5))


def bucket_of(gold: np.ndarray) -> np.ndarray:
    """The bucket index 0..4 of gold scores: [0,1), [1,2), [2,3), [3,4), [4,5] (5.0 in the last).

    Args:
        gold: gold STS scores in [0, 5].

    Examples:
        >>> from cse.evaluation.plots import bucket_of
        >>> bucket_of([0.0, 3.9, 5.0]).tolist()
        [0, 3, 4]
    """
    return np.clip(np.floor(np.asarray(gold, dtype=np.float64)), 0, 4).astype(int)


def cosine_by_gold_plot(cosine: Sequence[float], gold: Sequence[float], path: str | Path, title: str = "") -> Path:
    """One histogram row per gold bucket (x = cosine similarity), like Chuang et al. (2022), *DiffCSE*, Fig. 2.

    Args:
        cosine: the predicted cosine of every pair.
        gold: the pairs' gold scores.
        path: the PNG to write.
        title: the figure title (a default names STS-B test).

    Returns:
        `path`.
    """
    cos, g = np.asarray(cosine, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    b = bucket_of(g)
    lo = min(0.0, float(cos.min())) if len(cos) else 0.0
    bins = np.linspace(lo, 1.0, 41)
    fig, axes = plt.subplots(len(GOLD_BUCKETS), 1, figsize=(6, 7), sharex=True)
    for i, ax in enumerate(axes[::-1]):  # highest bucket on top
        vals = cos[b == i]
        ax.hist(vals, bins=bins, color=plt.cm.viridis(i / 4), alpha=0.85)
        lo_b, hi_b = GOLD_BUCKETS[i]
        ax.set_ylabel(f"{lo_b}-{hi_b}\n(n={len(vals)})", rotation=0, labelpad=28, va="center")
        ax.set_yticks([])
        if len(vals):
            ax.axvline(float(np.mean(vals)), color="k", lw=1, ls="--")
    axes[-1].set_xlabel("cosine similarity")
    fig.suptitle(title or "STS-B test: cosine similarity per gold-score bucket")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def alignment_uniformity_plot(
    point: tuple[float, float],
    label: str,
    path: str | Path,
    references: Mapping[str, tuple[float, float]] | None = None,
) -> Path:
    """A scatter of (uniformity, alignment): the run highlighted, reference points in grey.

    Args:
        point: the run's `(alignment, uniformity)`.
        label: the run's label.
        path: the PNG to write.
        references: `{name: (alignment, uniformity)}` drawn in grey; None draws the papers' points.

    Returns:
        `path`.
    """
    refs = PAPER_ALIGN_UNIFORM if references is None else references
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, (a, u) in refs.items():
        ax.scatter(u, a, color="0.6", s=25)
        ax.annotate(name, (u, a), fontsize=7, color="0.4", xytext=(3, 3), textcoords="offset points")
    a, u = point
    ax.scatter(u, a, color="tab:red", s=60, marker="*", zorder=3)
    ax.annotate(label, (u, a), fontsize=9, color="tab:red", xytext=(4, -10), textcoords="offset points")
    ax.set_xlabel("uniformity (lower is better)")
    ax.set_ylabel("alignment (lower is better)")
    ax.set_title("Alignment vs uniformity, STS-B test")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
