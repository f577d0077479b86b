"""Evaluation results: typed, JSON-serialisable, with flat metric names and paper-style table rows (rendered as
markdown/CSV by `cse.tracking.reporting`, where tasks/evaluate.py records them).

Metric names (MLflow allows letters, digits, `_ - . / :` and spaces, not `@`): `sts12` … `sts16`,
`stsb`, `sickr`, `sts_avg` (Spearman ×100; `<name>_pearson` alongside), `sts12/<subset>`,
`sts12_mean`, `sts12_wmean`; dev mode `stsb_dev`, `sickr_dev`; `retrieval_r1` … (the chosen
duplicate rule) plus `retrieval_index_r1` and `retrieval_string_r1`; `alignment`, `uniformity`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cse.storage.readers import TASK_TITLES  # the one definition of the task titles


class _Result(BaseModel):
    """A result model: an undefined score stays NaN, in JSON too (`NaN`). SentEval reports NaN for a subset whose
    predicted or gold similarities are all equal (no ranking to correlate); the task's "all" score, over the subsets
    concatenated, is still defined. Pydantic would otherwise write NaN as `null`, which no float field reads back."""

    model_config = ConfigDict(ser_json_inf_nan="constants")


TEST_TASKS: tuple[str, ...] = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")
DEV_TASKS: tuple[str, ...] = ("stsb", "sickr")


class Correlation(_Result):
    """Spearman and Pearson correlation of predicted and gold similarities over `n` pairs."""

    spearman: float
    pearson: float
    n: int


class TaskScore(_Result):
    """One task's score. `spearman`/`pearson` = the headline ("all" for STS12–16)."""

    task: str
    split: str
    spearman: float
    pearson: float
    n: int
    subsets: dict[str, Correlation] = Field(default_factory=dict)
    spearman_mean: float | None = None
    spearman_wmean: float | None = None
    pearson_mean: float | None = None
    pearson_wmean: float | None = None


class RetrievalScore(_Result):
    """Recall@k ×100 per duplicate rule (`index`, `string`); `match` is the rule reported as headline."""

    match: Literal["index", "string"]
    ks: list[int]
    n_pairs: int
    n_queries: int
    corpus_size: dict[str, int]
    recall: dict[str, dict[int, float]]

    def headline(self) -> dict[int, float]:
        return self.recall[self.match]


class AlignUniform(_Result):
    """Alignment and uniformity of the embeddings (Wang & Isola, 2020) with the settings they were computed with."""

    alignment: float
    uniformity: float
    n_positive_pairs: int
    n_sentences: int
    threshold: float
    inclusive: bool
    alpha: float = 2.0
    t: float = 2.0
    dedup_sentences: bool = False


class Neighbour(_Result):
    """A retrieved neighbour sentence, its cosine similarity to the query, and whether it is an expected answer."""

    sentence: str
    cosine: float
    is_answer: bool = False


class QueryNeighbours(_Result):
    """A qualitative retrieval example: a query, its expected answers and its nearest neighbours."""

    query: str
    answers: list[str] = Field(default_factory=list)
    neighbours: list[Neighbour]


class Timing(_Result):
    """Evaluation wall time, embedding time, sentences and tokens embedded, and throughput."""

    seconds: float
    embed_seconds: float
    sentences: int
    tokens: int
    sentences_per_s: float


class EvalResult(_Result):
    """The result of an STS evaluation: per-task scores, averages, optional retrieval, alignment and timing."""

    mode: Literal["test", "dev"]
    tasks: dict[str, TaskScore]
    sts_avg: float | None = None
    sts_avg_pearson: float | None = None
    retrieval: RetrievalScore | None = None
    align_uniform: AlignUniform | None = None
    qualitative: list[QueryNeighbours] = Field(default_factory=list)
    stsb_test_pairs: dict[str, list[float]] | None = Field(
        default=None, description="cosine and gold of STS-B test (plots)"
    )
    timing: Timing
    embedder: dict = Field(default_factory=dict)

    @property
    def dev_score(self) -> float:
        """STS-B dev Spearman ×100 (model selection)."""
        if "stsb_dev" not in self.tasks:
            raise KeyError("no STS-B dev score in this result (evaluate with mode='dev')")
        return self.tasks["stsb_dev"].spearman

    def metrics(self) -> dict[str, float]:
        """Flat MLflow metric names → values."""
        m: dict[str, float] = {}
        for name, t in self.tasks.items():
            m[name] = t.spearman
            m[f"{name}_pearson"] = t.pearson
            if t.spearman_mean is not None:  # sts12_mean, sts12_wmean, sts12_pearson_mean, sts12_pearson_wmean
                m.update({f"{name}_{k.removeprefix('spearman_')}": getattr(t, k) for k in _AGGREGATES})
            for sub, c in t.subsets.items():
                m[f"{name}/{sub}"] = c.spearman
                m[f"{name}/{sub}_pearson"] = c.pearson
        if self.sts_avg is not None:
            m["sts_avg"] = self.sts_avg
        if self.sts_avg_pearson is not None:  # (set together with sts_avg)
            m["sts_avg_pearson"] = self.sts_avg_pearson
        if self.retrieval is not None:
            for k, v in self.retrieval.headline().items():
                m[f"retrieval_r{k}"] = v
            for rule, rec in self.retrieval.recall.items():
                for k, v in rec.items():
                    m[f"retrieval_{rule}_r{k}"] = v
        if self.align_uniform is not None:
            m["alignment"] = self.align_uniform.alignment
            m["uniformity"] = self.align_uniform.uniformity
        m["eval_seconds"] = self.timing.seconds
        m["eval_sentences_per_s"] = self.timing.sentences_per_s
        return m

    # ------------------------------------------------------------------ tables

    def table_columns(self) -> list[str]:
        cols = [t for t in (TEST_TASKS if self.mode == "test" else ("stsb_dev", "sickr_dev")) if t in self.tasks]
        return cols

    def table_record(self, label: str, pearson: bool = False) -> dict[str, str]:
        """The papers' Table 1 row as {column title: 'xx.xx'}."""
        row = {"Model": label}
        for t in self.table_columns():
            row[TASK_TITLES[t]] = f"{(self.tasks[t].pearson if pearson else self.tasks[t].spearman):.2f}"
        avg = self.sts_avg_pearson if pearson else self.sts_avg
        if avg is not None:
            row["Avg."] = f"{avg:.2f}"
        return row

    def task_rows(self) -> list[dict]:
        """One row per task: headline Spearman/Pearson, pairs, and the subset aggregations."""
        return [
            {
                "task": name,
                "split": t.split,
                "n": t.n,
                **{k: _r(getattr(t, k)) for k in ("spearman", "pearson", *_AGGREGATES)},
            }
            for name, t in self.tasks.items()
        ]

    def subset_rows(self) -> list[dict]:
        """One row per STS12–16 subset plus the task's `all`, `mean`, `wmean` rows."""
        rows = []
        for name, t in self.tasks.items():
            if not t.subsets:
                continue
            per: list[tuple[str, int, float | None, float | None]] = [
                (sub, c.n, c.spearman, c.pearson) for sub, c in t.subsets.items()
            ]
            per += [
                ("all", t.n, t.spearman, t.pearson),
                ("mean", len(t.subsets), t.spearman_mean, t.pearson_mean),
                ("wmean", t.n, t.spearman_wmean, t.pearson_wmean),
            ]
            rows += [
                {"task": name, "subset": sub, "n": n, "spearman": _r(sp), "pearson": _r(pe)} for sub, n, sp, pe in per
            ]
        return rows

    def retrieval_rows(self) -> list[dict]:
        if self.retrieval is None:
            return []
        r = self.retrieval
        return [
            {
                "rule": rule,
                "headline": rule == r.match,
                "corpus": r.corpus_size[rule],
                "queries": r.n_queries,
                **{f"R@{k}": round(v, 2) for k, v in rec.items()},
            }
            for rule, rec in r.recall.items()
        ]


_AGGREGATES = ("spearman_mean", "spearman_wmean", "pearson_mean", "pearson_wmean")


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
