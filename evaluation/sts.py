"""STS scoring as SentEval does it (Conneau and Kiela, 2018, *SentEval*; `facebookresearch/SentEval`).

Cosine per pair (a zero vector → 0; a non-finite one is an error, never a silent 0), Spearman/Pearson ×100 against
gold; for STS12–16 the per-subset scores, their plain mean, their size-weighted mean and the "all" score (one
correlation over all subsets concatenated), which is the headline. "Avg." = mean of per-task scores rounded to 2 decimals.

One deliberate refinement: a pair whose two sentences are the same string gets cosine exactly 1
(`identical`). SentEval computes 1 ± float noise there, and that noise alone orders the tied pairs
(STS12 SMTeuroparl has 65 such pairs, SMTnews 14), which moves subset scores by up to ~0.1 between
two otherwise equal encoders.

The "all" headline is the aggregation SimCSE reports (Gao et al., 2021, appendix B) and every method here follows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats

from cse.evaluation.results import Correlation, TaskScore


def cosine_pairs(a: np.ndarray, b: np.ndarray, identical: np.ndarray | None = None) -> np.ndarray:
    """The row-wise cosine of two `[N, d]` arrays in float64; a zero vector gives 0 (SentEval's guard), a non-finite
    one is an error (SentEval's `nan_to_num` would score it 0 without a word).

    Args:
        a: `[N, d]` embeddings of the first sentences.
        b: `[N, d]` embeddings of the second sentences.
        identical: bool `[N]` marking pairs of the same sentence: their cosine is exactly 1 (unless zero).

    Raises:
        ValueError: the shapes differ, or a vector holds `nan`/`inf` (naming how many pairs).

    Examples:
        >>> import numpy as np
        >>> from cse.evaluation.sts import cosine_pairs
        >>> cosine_pairs(np.array([[1.0, 0.0], [0.0, 0.0]]), np.array([[1.0, 1.0], [1.0, 0.0]])).round(4)
        array([0.7071, 0.    ])
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"cosine_pairs needs two [N, d] arrays of one shape, got {a.shape} and {b.shape}")
    if (bad := int((~np.isfinite(a).all(axis=1) | ~np.isfinite(b).all(axis=1)).sum())) > 0:
        raise ValueError(f"{bad} of {len(a)} pairs hold a non-finite (nan/inf) vector: no cosine is scored for them")
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    cos = np.nan_to_num(cos, nan=0.0, posinf=0.0, neginf=0.0)
    if identical is not None:
        cos = np.where(np.asarray(identical, dtype=bool) & (np.linalg.norm(a, axis=1) > 0), 1.0, cos)
    return cos


def correlation(pred: Sequence[float] | np.ndarray, gold: Sequence[float] | np.ndarray) -> Correlation:
    """Spearman (ties averaged) and Pearson correlation, both ×100.

    Args:
        pred: predicted similarities, one per pair.
        gold: gold scores, one per pair.

    Raises:
        ValueError: lengths differ or fewer than 2 pairs.

    Examples:
        >>> from cse.evaluation.sts import correlation
        >>> correlation([0.1, 0.5, 0.9], [1.0, 2.0, 5.0]).spearman
        100.0
    """
    x, y = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"predictions {x.shape} and gold scores {y.shape} must be 1-D of equal length")
    if len(x) < 2:
        raise ValueError(f"a correlation needs at least 2 pairs, got {len(x)}")
    return Correlation(
        spearman=100.0 * float(stats.spearmanr(x, y).statistic),
        pearson=100.0 * float(stats.pearsonr(x, y).statistic),
        n=len(x),
    )


def score_task(task: str, split: str, subsets: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> TaskScore:
    """Score one task; the headline is the "all" correlation over every subset concatenated.

    Args:
        task: the task name (`sts12` … `sickr`), recorded in the result.
        split: `test` or `dev`, recorded in the result.
        subsets: `{subset: (predicted cosines, gold scores)}`; with more than one subset the per-subset scores and
            their plain and size-weighted means are kept too.

    Examples:
        >>> import numpy as np
        >>> from cse.evaluation.sts import score_task
        >>> s = score_task("stsb", "test", {"all": (np.array([0.1, 0.5, 0.9]), np.array([1.0, 2.0, 5.0]))})
        >>> s.spearman, s.n
        (100.0, 3)
    """
    if not subsets:
        raise ValueError(f"{task}/{split}: no subsets to score")
    per = {name: correlation(p, g) for name, (p, g) in subsets.items()}
    pred = np.concatenate([np.asarray(p, dtype=np.float64) for p, _ in subsets.values()])
    gold = np.concatenate([np.asarray(g, dtype=np.float64) for _, g in subsets.values()])
    allc = correlation(pred, gold)
    sizes = np.array([c.n for c in per.values()], dtype=np.float64)
    sp = np.array([c.spearman for c in per.values()])
    pe = np.array([c.pearson for c in per.values()])
    multi = len(per) > 1
    return TaskScore(
        task=task,
        split=split,
        spearman=allc.spearman,
        pearson=allc.pearson,
        n=allc.n,
        subsets=per if multi else {},
        spearman_mean=float(sp.mean()) if multi else None,
        spearman_wmean=float(np.average(sp, weights=sizes)) if multi else None,
        pearson_mean=float(pe.mean()) if multi else None,
        pearson_wmean=float(np.average(pe, weights=sizes)) if multi else None,
    )


def rounded_average(scores: Sequence[float]) -> float:
    """The papers' "Avg.": the mean of the scores each rounded to two decimals, rounded to two decimals.

    Args:
        scores: the per-task scores.

    Examples:
        >>> from cse.evaluation.sts import rounded_average
        >>> rounded_average([72.374, 80.606])  # 72.37 and 80.61
        76.49
    """
    if not scores:
        raise ValueError("no scores to average")
    return round(sum(float(f"{s:.2f}") for s in scores) / len(scores), 2)
