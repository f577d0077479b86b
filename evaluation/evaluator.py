"""The evaluator: one pass of embedding over every unique sentence a mode needs, then all metrics.

The protocol is SentEval's (Conneau and Kiela, 2018, *SentEval: An Evaluation Toolkit for Universal Sentence
Representations*; `facebookresearch/SentEval`) as SimCSE runs it (Gao et al., 2021); retrieval and
alignment/uniformity as D2CSE reports them (Lee, 2023).

`test` mode: STS12–16 (test; "all" headline, per-subset scores), STS-B test, SICK-R test, "Avg.",
and on STS-B test the retrieval, alignment/uniformity and qualitative neighbours (`extras`).
`dev` mode (model selection during training): STS-B dev and SICK-R dev only; its token ids are
cached per embedder object, so calling it every few hundred steps re-tokenises nothing.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from cse.evaluation.alignment import alignment, uniformity
from cse.evaluation.encode import DeviceBatches, EncodeStats, cached_token_ids, check_run, embed_token_ids
from cse.evaluation.qualitative import PAPER_QUERIES, answers_of, nearest_neighbours
from cse.evaluation.results import DEV_TASKS, TEST_TASKS, AlignUniform, EvalResult, TaskScore, Timing
from cse.evaluation.retrieval import RULES, retrieval_scores
from cse.evaluation.sts import cosine_pairs, rounded_average, score_task
from cse.models.embedder import SentenceEmbedder

MODES = ("test", "dev")
REQUIRED_COLUMNS = ("task", "subset", "split", "pair_index", "sentence1", "sentence2", "score")


class UnknownTaskError(ValueError):
    """A task name outside the seven STS tasks."""


class MissingDataError(ValueError):
    """The STS table lacks pairs a mode needs."""


@dataclass
class _Subset:
    s1: list[str]
    s2: list[str]
    gold: np.ndarray

    @classmethod
    def of(cls, items: list[tuple[int, str, str, float]]) -> _Subset:
        """The subset of (pair index, sentence 1, sentence 2, gold) rows, in pair order."""
        _, s1, s2, gold = zip(*sorted(items, key=lambda r: r[0]))
        return cls(list(s1), list(s2), np.array(gold, dtype=np.float64))


@dataclass
class _Plan:
    """What one (mode, tasks, extras) call embeds and scores; sentence positions are unique."""

    sentences: list[str]
    scored: dict[
        str, tuple[str, str, dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]]
    ]  # name → (task, split, {subset: (i1, i2, gold)})
    stsb_test: tuple[np.ndarray, np.ndarray] | None  # positions of sentence1/sentence2 of STS-B test
    queries: np.ndarray | None


class Evaluator:
    """Scores any `SentenceEmbedder` on an STS table (schema `cse.storage.schemas.STS`).

    The STS table is indexed once; each `run` embeds every unique sentence of its mode once (length-sorted batches)
    and scores every task from those embeddings.

    Args:
        sts_table: the STS pairs (the `sts` dataset, or `cse.storage.readers.read_senteval`'s table).
        retrieval_match: the headline duplicate rule of the retrieval scores, `string` or `index`.
        retrieval_ks: the recall@k cut-offs.
        alignment_threshold: positive pairs for alignment are those with gold at (or above) this score.
        alignment_inclusive: whether a gold score equal to `alignment_threshold` counts as positive.
        uniformity_t: the uniformity temperature t.
        uniformity_dedup: compute uniformity over unique sentences instead of every pair's two sentences.
        qualitative_queries: sentences whose nearest neighbours in STS-B test are reported (the papers' queries).
        qualitative_k: how many neighbours each query reports.

    Raises:
        MissingDataError: the table lacks a column of the STS schema.
        ValueError: an unknown `retrieval_match`.

    Examples:
        ```python
        from cse.evaluation.evaluator import Evaluator
        from cse.models.embedder import PooledEncoder
        from cse.storage.readers import read_senteval

        sts, _ = read_senteval("../shared/data/senteval")          # or the data root's `sts` dataset
        encoder = PooledEncoder.from_pretrained("packaged:minilm", "avg")
        result = Evaluator(sts).run(encoder, mode="test")
        result.sts_avg                                               # 78.87
        ```
    """

    def __init__(
        self,
        sts_table: pa.Table,
        *,
        retrieval_match: str = "string",
        retrieval_ks: Sequence[int] = (1, 3, 5, 10),
        alignment_threshold: float = 4.0,
        alignment_inclusive: bool = True,
        uniformity_t: float = 2.0,
        uniformity_dedup: bool = False,
        qualitative_queries: Sequence[str] = PAPER_QUERIES,
        qualitative_k: int = 5,
    ):
        missing = [c for c in REQUIRED_COLUMNS if c not in sts_table.column_names]
        if missing:
            raise MissingDataError(
                f"the STS table lacks columns {missing} (expected the schema of cse.storage.schemas.STS)"
            )
        if retrieval_match not in RULES:
            raise ValueError(f"unknown retrieval duplicate rule {retrieval_match!r}; known: {', '.join(RULES)}")
        self.retrieval_match = retrieval_match
        self.retrieval_ks = tuple(int(k) for k in retrieval_ks)
        self.alignment_threshold = float(alignment_threshold)
        self.alignment_inclusive = bool(alignment_inclusive)
        self.uniformity_t = float(uniformity_t)
        self.uniformity_dedup = bool(uniformity_dedup)
        self.qualitative_queries = tuple(qualitative_queries)
        self.qualitative_k = int(qualitative_k)
        self._data = self._index(sts_table)
        self._plans: dict[tuple, _Plan] = {}
        self._token_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # the padded batches on the embedder's device (a dev set evaluated every eval_steps is copied once)
        self._device_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @staticmethod
    def _index(table: pa.Table) -> dict[tuple[str, str], dict[str, _Subset]]:
        cols = table.select(list(REQUIRED_COLUMNS)).to_pydict()
        rows: dict[tuple[str, str], dict[str, list[tuple[int, str, str, float]]]] = {}
        for task, subset, split, pi, s1, s2, g in zip(*(cols[c] for c in REQUIRED_COLUMNS)):
            rows.setdefault((task, split), {}).setdefault(subset, []).append((pi, s1, s2, g))
        return {key: {name: _Subset.of(items) for name, items in subsets.items()} for key, subsets in rows.items()}

    def _need(self, task: str, split: str) -> dict[str, _Subset]:
        got = self._data.get((task, split))
        if not got:
            raise MissingDataError(
                f"the STS table has no pairs for task {task!r}, split {split!r}; "
                "ingest the SentEval data (flow `ingest`) or point `sts` at a SentEval folder"
            )
        return got

    # ------------------------------------------------------------------ planning

    def _plan(self, mode: str, tasks: tuple[str, ...], extras: bool) -> _Plan:
        key = (mode, tasks, extras)
        if key in self._plans:
            return self._plans[key]
        pos: dict[str, int] = {}

        def at(sentences: Sequence[str]) -> np.ndarray:
            return np.array([pos.setdefault(s, len(pos)) for s in sentences], dtype=np.int64)

        split = "test" if mode == "test" else "dev"
        scored = {}
        for task in tasks:
            name = task if mode == "test" else f"{task}_dev"
            scored[name] = (
                task,
                split,
                {sub: (at(d.s1), at(d.s2), d.gold) for sub, d in self._need(task, split).items()},
            )
        stsb_test = queries = None
        if mode == "test" and extras:
            d = self._need("stsb", "test")["all"]
            stsb_test = (at(d.s1), at(d.s2))
            queries = at(self.qualitative_queries) if self.qualitative_queries else None
        plan = _Plan(sentences=list(pos), scored=scored, stsb_test=stsb_test, queries=queries)
        self._plans[key] = plan
        return plan

    def sentences(self, mode: str = "test", tasks: Sequence[str] | None = None, extras: bool = True) -> list[str]:
        """The unique sentences a run of these arguments embeds, in embedding order (benchmarks use this).

        Args:
            mode: `test` or `dev`.
            tasks: the tasks to score, or None for all of the mode's.
            extras: include STS-B test's retrieval and qualitative sentences (`test` mode).
        """
        return list(self._plan(mode, self._tasks(mode, tasks), extras).sentences)

    @staticmethod
    def _tasks(mode: str, tasks: Sequence[str] | None) -> tuple[str, ...]:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
        allowed = TEST_TASKS if mode == "test" else DEV_TASKS
        if tasks is None:
            return allowed
        bad = [t for t in tasks if t not in allowed]
        if bad:
            raise UnknownTaskError(f"unknown task(s) {bad} for mode {mode!r}; known: {', '.join(allowed)}")
        if not tasks:
            raise UnknownTaskError("tasks is empty: name at least one task or pass None for all")
        return tuple(t for t in allowed if t in tasks)

    # ------------------------------------------------------------------ run

    def run(
        self,
        embedder: SentenceEmbedder,
        mode: str = "test",
        *,
        tasks: Sequence[str] | None = None,
        extras: bool = True,
        batch_size: int = 128,
        precision: str = "fp32",
        progress: bool = False,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> EvalResult:
        """Embed every unique sentence once and compute all scores of `mode`.

        Args:
            embedder: the model to score (any `cse.models.embedder.SentenceEmbedder`).
            mode: `test` (STS12–16, STS-B, SICK-R test, "Avg.") or `dev` (STS-B and SICK-R dev, for selection).
            tasks: the tasks to score, or None for all of the mode's.
            extras: in `test` mode, also retrieval, alignment/uniformity and the qualitative neighbours.
            batch_size: sentences per embedding batch.
            precision: `fp32` (as the reference code evaluates), `tf32` matmuls, `bf16` autocast, or `auto` (bf16 on CUDA).
            progress: show a progress bar.
            on_progress: called after each embedding batch with (sentences embedded so far, all sentences).

        Returns:
            The scores, with timings and the embedder's description.

        Raises:
            TypeError: `embedder` is not a `SentenceEmbedder`.
            ValueError: an unknown mode or precision.
            UnknownTaskError: a task outside the mode's.
            MissingDataError: the table lacks pairs the mode needs.
        """
        check_run(embedder, precision)
        t0 = time.perf_counter()
        key = (mode, self._tasks(mode, tasks), extras)
        plan = self._plan(*key)
        emb_t, st = embed_token_ids(
            embedder,
            cached_token_ids(self._token_cache, embedder, key, plan.sentences),
            batch_size=batch_size,
            precision=precision,
            progress=progress,
            desc=f"evaluate ({mode})",
            device_cache=self._device_cache.setdefault(embedder, DeviceBatches()),
            sentences=plan.sentences,
            on_progress=on_progress,
        )
        emb = emb_t.numpy().astype(np.float64)
        scores = self._scores(plan, emb)
        result = self._result(mode, scores, st, embedder)
        if plan.stsb_test is not None:
            self._extras(result, emb, plan.stsb_test, plan.queries)
        result.timing.seconds = time.perf_counter() - t0
        return result

    @staticmethod
    def _result(mode: str, scores: dict[str, TaskScore], st: EncodeStats, embedder: SentenceEmbedder) -> EvalResult:
        """The run's result: its scores, the embedding pass's timing and, in `test` mode with every task, the averages.

        Args:
            mode: `test` or `dev` (`_tasks` refused any other).
            scores: the tasks' scores.
            st: the embedding pass's statistics.
            embedder: the model scored.
        """
        result = EvalResult(
            mode="test" if mode == "test" else "dev",
            tasks=scores,
            timing=Timing(
                seconds=0.0,
                embed_seconds=st.seconds,
                sentences=st.sentences,
                tokens=st.tokens,
                sentences_per_s=st.sentences_per_s,
            ),
            embedder=embedder.describe(),
        )
        if mode == "test" and all(t in scores for t in TEST_TASKS):
            result.sts_avg = rounded_average([scores[t].spearman for t in TEST_TASKS])
            result.sts_avg_pearson = rounded_average([scores[t].pearson for t in TEST_TASKS])
        return result

    @staticmethod
    def _scores(plan: _Plan, emb: np.ndarray) -> dict[str, TaskScore]:
        """Each planned task's correlations: the cosine of each pair's embeddings against its gold score.

        Args:
            plan: the run's plan.
            emb: every planned sentence's embedding, in plan order.
        """
        return {
            name: score_task(
                task,
                split,
                {sub: (cosine_pairs(emb[i1], emb[i2], identical=i1 == i2), g) for sub, (i1, i2, g) in subsets.items()},
            )
            for name, (task, split, subsets) in plan.scored.items()
        }

    def _extras(
        self, result: EvalResult, emb: np.ndarray, stsb_test: tuple[np.ndarray, np.ndarray], queries: np.ndarray | None
    ) -> None:
        """STS-B test's cosines, retrieval, alignment/uniformity and qualitative neighbours, set on `result`.

        Args:
            result: the run's result, completed in place.
            emb: every planned sentence's embedding.
            stsb_test: the rows of STS-B test's first and second sentences in `emb`.
            queries: the rows of the qualitative queries, or None for none.
        """
        d = self._data[("stsb", "test")]["all"]
        i1, i2 = stsb_test
        e1, e2 = emb[i1], emb[i2]
        result.stsb_test_pairs = {"cosine": cosine_pairs(e1, e2, identical=i1 == i2).tolist(), "gold": d.gold.tolist()}
        result.retrieval = retrieval_scores(
            d.s1, d.s2, d.gold, e1, e2, ks=self.retrieval_ks, match=self.retrieval_match
        )
        pos = d.gold >= self.alignment_threshold if self.alignment_inclusive else d.gold > self.alignment_threshold
        if not pos.any():
            raise MissingDataError(
                f"no STS-B test pair has gold {'>=' if self.alignment_inclusive else '>'} {self.alignment_threshold}"
            )
        if self.uniformity_dedup:
            everything = emb[np.unique(np.concatenate([i1, i2]))]
        else:
            everything = np.concatenate([e1, e2])
        result.align_uniform = AlignUniform(
            alignment=alignment(torch.from_numpy(e1[pos]), torch.from_numpy(e2[pos])),
            uniformity=uniformity(torch.from_numpy(everything), t=self.uniformity_t),
            n_positive_pairs=int(pos.sum()),
            n_sentences=len(everything),
            threshold=self.alignment_threshold,
            inclusive=self.alignment_inclusive,
            t=self.uniformity_t,
            dedup_sentences=self.uniformity_dedup,
        )
        if queries is not None:
            result.qualitative = nearest_neighbours(
                self.qualitative_queries,
                emb[queries],
                d.s1 + d.s2,
                np.concatenate([e1, e2]),
                k=self.qualitative_k,
                answers=[answers_of(q, d.s1, d.s2, d.gold) for q in self.qualitative_queries],
            )
