"""Retrieval on STS-B test, as D2CSE (Lee, 2023) and DiffCSE (Chuang et al., 2022) report it: the gold-5.0 pairs as
queries, both directions.

Corpus: the test split's sentences, all `sentence1` in pair order then all `sentence2` (2,758 with
duplicates). A query's answer is its partner. Two duplicate rules, both always computed:

- `index`: the corpus keeps duplicates; only the query's own position is excluded; a hit needs the
  partner's own position. Copies of the query or of the answer elsewhere in the corpus compete.
- `string`: the corpus is deduplicated by exact string (2,551 sentences); the query's string is
  excluded; a hit is the partner's string. (A pair whose two sentences are identical strings counts
  as a hit at rank 1.)

Ranks: the number of candidates scoring strictly higher, plus equal-scoring candidates that come
earlier in corpus order (identical strings get identical embeddings, so ties are real in `index`).
Recall@k ×100.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from cse.evaluation.results import RetrievalScore

RULES = ("index", "string")


def unit_rows(x: np.ndarray) -> np.ndarray:
    """The rows of `x` scaled to unit length in float64 (nan as 0; a zero row stays zero)."""
    x = np.nan_to_num(np.asarray(x, dtype=np.float64))
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return np.divide(x, n, out=np.zeros_like(x), where=n > 0)


def ranks_of_targets(sim: np.ndarray, targets: np.ndarray, exclude: np.ndarray) -> np.ndarray:
    """The rank (0 = top) of `targets[i]` in row i of `sim`, ignoring the excluded columns.

    Ties go to the earlier column.

    Args:
        sim: `[Q, N]` query-by-corpus similarities.
        targets: `[Q]` the corpus position of each query's answer.
        exclude: bool `[Q, N]`, True for candidates a query may not retrieve (itself).

    Examples:
        >>> import numpy as np
        >>> from cse.evaluation.retrieval import ranks_of_targets
        >>> sim = np.array([[0.9, 0.5, 0.7]])
        >>> ranks_of_targets(sim, np.array([1]), np.array([[True, False, False]]))
        array([1])
    """
    sim = np.where(exclude, -np.inf, sim)
    rows = np.arange(sim.shape[0])
    t = sim[rows, targets][:, None]
    cols = np.arange(sim.shape[1])[None, :]
    better = (sim > t) | ((sim == t) & (cols < targets[:, None]))
    better &= ~exclude
    return better.sum(axis=1)


def recall_at_k(ranks: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
    """Recall@k ×100: the share of queries whose answer ranks below k, for every k.

    Args:
        ranks: `[Q]` 0-based ranks from `ranks_of_targets`.
        ks: the cut-offs.

    Examples:
        >>> import numpy as np
        >>> from cse.evaluation.retrieval import recall_at_k
        >>> recall_at_k(np.array([0, 2, 5, 0]), [1, 3])
        {1: 50.0, 3: 75.0}
    """
    return {int(k): 100.0 * float((ranks < k).mean()) for k in ks}


def rule(match: str) -> Literal["index", "string"]:
    """`match` as one of the duplicate rules of `RULES`.

    Args:
        match: `index` or `string`.

    Raises:
        ValueError: any other name.
    """
    if match == "index":
        return "index"
    if match == "string":
        return "string"
    raise ValueError(f"unknown retrieval duplicate rule {match!r}; known: {', '.join(RULES)}")


def retrieval_scores(
    sentence1: Sequence[str],
    sentence2: Sequence[str],
    gold: Sequence[float] | np.ndarray,
    emb1: np.ndarray,
    emb2: np.ndarray,
    *,
    ks: Sequence[int] = (1, 3, 5, 10),
    match: str = "string",
    answer_score: float = 5.0,
) -> RetrievalScore:
    """Recall@k under both duplicate rules (see the module text); `match` picks the headline rule.

    Args:
        sentence1: the first sentence of each of the P pairs.
        sentence2: the second sentence of each pair.
        gold: the pairs' gold scores.
        emb1: `[P, d]` embeddings of `sentence1`.
        emb2: `[P, d]` embeddings of `sentence2`.
        ks: the recall cut-offs.
        match: the headline rule, `string` or `index`.
        answer_score: the gold score of the pairs used as queries (5.0).

    Raises:
        ValueError: an unknown rule, a k below 1, mismatched lengths, or no pair with gold `answer_score`.
    """
    headline = rule(match)
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {list(ks)}")
    n_pairs = len(sentence1)
    scores = np.asarray(gold, dtype=np.float64)
    if not (len(sentence2) == n_pairs == len(scores) == len(emb1) == len(emb2)):
        raise ValueError("sentence1, sentence2, gold, emb1 and emb2 must have one length")
    pairs = np.flatnonzero(scores == answer_score)
    if len(pairs) == 0:
        raise ValueError(f"no pair has gold score {answer_score}: nothing to retrieve")
    texts = list(sentence1) + list(sentence2)
    corpus = unit_rows(np.concatenate([emb1, emb2]))
    q_pos = np.concatenate([pairs, pairs + n_pairs])  # s1 → s2, then s2 → s1
    t_pos = np.concatenate([pairs + n_pairs, pairs])
    string_ranks, n_unique = _string_rule_ranks(texts, corpus, q_pos, t_pos)
    return RetrievalScore(
        match=headline,
        ks=[int(k) for k in ks],
        n_pairs=len(pairs),
        n_queries=len(q_pos),
        corpus_size={"index": len(texts), "string": n_unique},
        recall={
            "index": recall_at_k(_index_rule_ranks(corpus, q_pos, t_pos), ks),
            "string": recall_at_k(string_ranks, ks),
        },
    )


def _index_rule_ranks(corpus: np.ndarray, q_pos: np.ndarray, t_pos: np.ndarray) -> np.ndarray:
    """The index rule: each query's target ranked among every other corpus row (only the query's own row left out).

    Args:
        corpus: `[2P, d]` unit embeddings of every sentence1, then every sentence2.
        q_pos: the queries' rows in `corpus`.
        t_pos: their targets' rows.
    """
    sim = corpus[q_pos] @ corpus.T
    excl = np.zeros_like(sim, dtype=bool)
    excl[np.arange(len(q_pos)), q_pos] = True
    return ranks_of_targets(sim, t_pos, excl)


def _string_rule_ranks(
    texts: list[str], corpus: np.ndarray, q_pos: np.ndarray, t_pos: np.ndarray
) -> tuple[np.ndarray, int]:
    """The string rule: the corpus deduplicated by text (first occurrence kept), the query's own text left out, and a
    target of the query's very text found at rank 0; the ranks and the deduplicated corpus's size.

    Args:
        texts: every sentence1, then every sentence2.
        corpus: their unit embeddings, row for row.
        q_pos: the queries' rows in `corpus`.
        t_pos: their targets' rows.
    """
    uniq: dict[str, int] = {}
    first_pos: list[int] = []
    for i, s in enumerate(texts):
        if s not in uniq:
            uniq[s] = len(first_pos)
            first_pos.append(i)
    ucorpus = corpus[first_pos]
    uq = np.array([uniq[texts[i]] for i in q_pos])
    ut = np.array([uniq[texts[i]] for i in t_pos])
    usim = ucorpus[uq] @ ucorpus.T
    uexcl = np.zeros_like(usim, dtype=bool)
    uexcl[np.arange(len(uq)), uq] = True
    return np.where(uq == ut, 0, ranks_of_targets(usim, ut, uexcl & (uq != ut)[:, None])), len(first_pos)
