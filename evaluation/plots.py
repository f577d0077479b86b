"""PNG plots (matplotlib Agg): cosine distribution per gold bucket (DiffCSE Fig. 2) and the
alignment–uniformity point of a run beside the papers' points (Lee, 2023, *D2CSE*, Fig. 3; Gao et al., 2021,
*SimCSE*, Fig. 2)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from cse.storage.readers import SEVEN_TASKS, TASK_TITLES

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
    return _save(fig, path)


def _save(fig: Figure, path: str | Path, **kwargs: Any) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=120, **kwargs)
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
    return _save(fig, path)


STS_COLUMNS: tuple[tuple[str, str], ...] = tuple((t, TASK_TITLES[t]) for t in (*SEVEN_TASKS, "sts_avg"))


def sts_scores_plot(rows: Mapping[str, Mapping[str, object]], path: str | Path, title: str = "") -> Path:
    """Grouped bars of STS test scores (Spearman ×100): the seven tasks and Avg. on the x axis, one bar per row
    (a run, the backbone before training, a paper's row, ...), each labelled with its score; a missing or
    non-numeric score is left out.

    Args:
        rows: label → scores by metric name (`sts12` … `sickr`, `sts_avg`), in legend order.
        path: the PNG to write.
        title: the figure title.

    Returns:
        `path`.

    Examples:
        >>> import tempfile, pathlib
        >>> from cse.evaluation.plots import sts_scores_plot
        >>> out = pathlib.Path(tempfile.mkdtemp()) / "sts.png"
        >>> sts_scores_plot({"run": {"sts12": 70.0, "sts_avg": 71.5}, "paper": {"sts12": "n/a"}}, out).stat().st_size > 0
        True
    """

    def number(value: object) -> float:
        try:
            return float(value)  # type: ignore[arg-type]  # any cell: what float() refuses is nan below
        except (TypeError, ValueError):
            return np.nan

    table = {label: [number(scores.get(metric)) for metric, _ in STS_COLUMNS] for label, scores in rows.items()}
    n = max(len(table), 1)
    width = 0.8 / n
    x = np.arange(len(STS_COLUMNS))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(STS_COLUMNS) * max(1.0, n / 3)), 4.2 + 0.2 * ((n + 2) // 3)))
    for i, (label, values) in enumerate(table.items()):
        bars = ax.bar(x - 0.4 + width * (i + 0.5), values, width, label=label, color=plt.cm.tab10(i % 10))
        if n <= 4:
            ax.bar_label(bars, labels=[f"{v:.1f}" if np.isfinite(v) else "" for v in values], fontsize=6, padding=1)
    ax.set_xticks(x, [t for _, t in STS_COLUMNS])
    ax.set_ylabel("Spearman × 100")
    finite = [v for values in table.values() for v in values if np.isfinite(v)]
    ax.set_ylim(max(0.0, min(finite, default=0.0) - 10.0), min(100.0, max(finite, default=100.0) + 8.0))
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=min(n, 3), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title or "STS test (Spearman × 100)")
    return _save(fig, path, bbox_inches="tight")  # (the legend below the axes included)
