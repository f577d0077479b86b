"""Qualitative retrieval: the papers' example queries and their nearest STS-B test sentences.

Queries (Chuang et al., 2022, *DiffCSE*, Table 9; Lee, 2023, *D2CSE*, Tables 2–3) are written in the corpus' tokenisation. The corpus is
deduplicated by string and the query's own string is left out. Answers = partners of the query in
gold-5.0 pairs, when the query is in the corpus.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cse.evaluation.results import Neighbour, QueryNeighbours
from cse.evaluation.retrieval import unit_rows

PAPER_QUERIES: tuple[str, ...] = (
    "you can do it , too .",
    "this is not a problem .",
    "i think that is not a bad idea .",
    "yes you got it .",
)


def answers_of(
    query: str,
    sentence1: Sequence[str],
    sentence2: Sequence[str],
    gold: Sequence[float] | np.ndarray,
    score: float = 5.0,
) -> list[str]:
    """The partners of `query` in the pairs of gold `score`, each once.

    Args:
        query: the query sentence.
        sentence1: the pairs' first sentences.
        sentence2: the pairs' second sentences.
        gold: the pairs' gold scores.
        score: the gold score of an answer pair.

    Examples:
        >>> from cse.evaluation.qualitative import answers_of
        >>> answers_of("yes you got it .", ["yes you got it .", "a"], ["you got it .", "b"], [5.0, 5.0])
        ['you got it .']
    """
    out: list[str] = []
    for a, b, g in zip(sentence1, sentence2, gold):
        if g == score:
            if a == query and b not in out:
                out.append(b)
            elif b == query and a not in out:
                out.append(a)
    return out


def nearest_neighbours(
    queries: Sequence[str],
    query_emb: np.ndarray,
    corpus: Sequence[str],
    corpus_emb: np.ndarray,
    *,
    k: int = 5,
    answers: Sequence[Sequence[str]] | None = None,
) -> list[QueryNeighbours]:
    """The top-k distinct corpus sentences by cosine for each query (the query's own string excluded).

    Args:
        queries: the query sentences.
        query_emb: `[Q, d]` their embeddings.
        corpus: the corpus sentences (deduplicated by string here).
        corpus_emb: `[N, d]` their embeddings.
        k: neighbours per query.
        answers: the known answers of each query (`answers_of`), marked in the result.

    Raises:
        ValueError: `k` below 1, or sentences and embeddings of different lengths.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if len(queries) != len(query_emb) or len(corpus) != len(corpus_emb):
        raise ValueError("sentences and embeddings differ in length")
    seen: dict[str, int] = {}
    for i, s in enumerate(corpus):
        seen.setdefault(s, i)
    texts = list(seen)
    emb = unit_rows(np.asarray(corpus_emb)[list(seen.values())])
    sim = unit_rows(query_emb) @ emb.T
    out = []
    for qi, q in enumerate(queries):
        row = sim[qi].copy()
        if q in seen:
            row[texts.index(q)] = -np.inf
        top = np.argsort(-row, kind="stable")[:k]
        ans = list(answers[qi]) if answers is not None else []
        out.append(
            QueryNeighbours(
                query=q,
                answers=ans,
                neighbours=[Neighbour(sentence=texts[j], cosine=float(row[j]), is_answer=texts[j] in ans) for j in top],
            )
        )
    return out
