"""SentEval's seven transfer tasks (MR, CR, SUBJ, MPQA, SST-2, TREC, MRPC) as SimCSE and DiffCSE ran them.

Protocol (SentEval, Conneau & Kiela 2018; SimCSE's `evaluation.py`; DiffCSE Table 2): a logistic regression
(`cse.evaluation.classifier`, no hidden layer) on the frozen sentence embeddings of the model's evaluation
pooler (the one its STS evaluation uses); accuracy ×100.

| task | classes | protocol (`kfold` = 10 in "test", 5 in "fasttest") |
|---|---|---|
| MR, CR, SUBJ, MPQA | 2 | nested cross-validation: `kfold` outer folds; in each, the L2 penalty is chosen by an inner `kfold` CV on the outer training part (dev score = that inner accuracy), then refit on the outer training part (5 % of it held out for early stopping) and scored on the outer test fold; acc = mean over outer folds |
| SST-2 | 2 | train / dev / test: the penalty with the best dev accuracy; test accuracy of that fit |
| TREC | 6 (coarse) | `kfold` CV on the training set chooses the penalty; refit on all of it (5 % held out for early stopping); TREC_10 test |
| MRPC | 2 | features `[|u − v|, u ⊙ v]` of the two sentences; as TREC on its train / test; F1 of class 1 logged too |

Settings: "test" = the papers' numbers (SimCSE/DiffCSE `--mode test`: Adam, batch 64, tenacity 5, epoch size 4,
kfold 10), "fasttest" = their cheaper mode and what training-time selection uses (`--mode dev`/`fasttest`:
RMSprop, batch 128, tenacity 3, epoch size 2, kfold 5); seed 1111, at most 200 epochs, penalties
1e-5 … 1e-2 (`cse.evaluation.classifier`).

Choices the description leaves open, taken from SentEval's behaviour:
* Examples are ordered as SentEval orders them before embedding (a stable sort by (number of words, label);
  MRPC by (words of sentence 1, words of sentence 2, label)), and folds are sklearn's `StratifiedKFold`
  (shuffled, random_state 1111) on that order, so every fold holds the examples SentEval's fold holds.
* Per-fold and per-penalty accuracies are rounded to two decimals before they are averaged or compared, and
  the first (smallest) penalty wins a tie, as in SentEval. The "dev" accuracy reported per task is SentEval's
  `devacc` (the validation score of the chosen penalty); "Avg." is the mean of the rounded accuracies.
* SST-2's final fit is the chosen penalty's search fit: SentEval refits it with the same seed, data and dev set,
  which reproduces the same fit.
* MRPC's features are SentEval's `np.c_[|u − v|, u * v]`: u and v themselves are not part of them.
* Every unique sentence (across the chosen tasks and both MRPC sides) is embedded once, in length-sorted
  batches; the classifiers run on the embedder's device. A blank line of CR/MPQA is the empty sentence
  (the tokenizer's special tokens only), as SentEval's batcher encodes it.
* `limit` (tests, smoke runs) keeps about that many evenly spaced examples per (task, split), in file order.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from pydantic import BaseModel, Field

from cse.evaluation.classifier import SETTINGS, ClassifierSettings, Fitted, fit_groups, group
from cse.evaluation.encode import EncodeStats, cached_token_ids, check_run, embed_token_ids
from cse.evaluation.sts import rounded_average
from cse.models.embedder import SentenceEmbedder
from cse.storage.transfer import NCLASSES, TRANSFER_TASKS

TITLES = {"mr": "MR", "cr": "CR", "subj": "SUBJ", "mpqa": "MPQA", "sst2": "SST", "trec": "TREC", "mrpc": "MRPC"}
CV_TASKS = ("mr", "cr", "subj", "mpqa")
REQUIRED_COLUMNS = ("task", "split", "example_index", "sentence1", "sentence2", "label")
_SPLITS = {
    **{t: ("all",) for t in CV_TASKS},
    "sst2": ("train", "dev", "test"),
    "trec": ("train", "test"),
    "mrpc": ("train", "test"),
}


class TransferDataError(ValueError):
    """The transfer table lacks a task, split or column the protocol needs."""


class TransferTaskScore(BaseModel):
    """The score of one SentEval transfer task: accuracies, chosen L2 penalties, sizes and timing."""

    task: str
    acc: float = Field(description="test accuracy ×100 (mean over outer folds for MR/CR/SUBJ/MPQA), two decimals")
    devacc: float = Field(description="SentEval's devacc ×100: validation accuracy of the chosen L2 penalty")
    f1: float | None = Field(default=None, description="MRPC: F1 ×100 of the paraphrase class on the test set")
    n_train: int
    n_test: int
    regs: list[float] = Field(description="chosen L2 penalty (one per outer fold for the cross-validated tasks)")
    fits: int
    epochs: float = Field(description="mean epochs a fit trained before early stopping")
    seconds: float = Field(description="classifier wall time of this task (embedding excluded)")
    sentences: int = Field(description="unique sentences of this task")


class TransferTiming(BaseModel):
    """Transfer evaluation wall time, split into embedding and classifier time, with throughput."""

    seconds: float
    embed_seconds: float
    classifier_seconds: float
    sentences: int
    tokens: int
    sentences_per_s: float


class TransferResult(BaseModel):
    """The result of a transfer evaluation: per-task scores, averages, classifier settings and timing."""

    mode: str = "transfer"
    classifier: str
    settings: dict
    tasks: dict[str, TransferTaskScore]
    transfer_avg: float | None = None
    transfer_devacc_avg: float | None = None
    limit: int | None = None
    device: str
    timing: TransferTiming
    embedder: dict = Field(default_factory=dict)

    @property
    def dev_score(self) -> float:
        """Mean devacc over the tasks run (model selection on the transfer dev average, as SimCSE's trainer)."""
        return float(np.mean([t.devacc for t in self.tasks.values()]))

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {}
        for name, t in self.tasks.items():
            m[name] = t.acc
            m[f"{name}_devacc"] = t.devacc
            m[f"{name}_seconds"] = t.seconds
            if t.f1 is not None:
                m[f"{name}_f1"] = t.f1
        if self.transfer_avg is not None:
            m["transfer_avg"] = self.transfer_avg
        if self.transfer_devacc_avg is not None:
            m["transfer_devacc_avg"] = self.transfer_devacc_avg
        m["transfer_seconds"] = self.timing.seconds
        m["transfer_embed_seconds"] = self.timing.embed_seconds
        return m

    def table_record(self, label: str, dev: bool = False) -> dict[str, str]:
        """The papers' Table 2 row as {column title: 'xx.xx'}."""
        row = {"Model": label}
        for t in TRANSFER_TASKS:
            if t in self.tasks:
                row[TITLES[t]] = f"{(self.tasks[t].devacc if dev else self.tasks[t].acc):.2f}"
        avg = self.transfer_devacc_avg if dev else self.transfer_avg
        if avg is not None:
            row["Avg."] = f"{avg:.2f}"
        return row

    def task_rows(self) -> list[dict]:
        return [
            {
                "task": t.task,
                "acc": t.acc,
                "devacc": t.devacc,
                "f1": t.f1,
                "n_train": t.n_train,
                "n_test": t.n_test,
                "regs": " ".join(f"{r:g}" for r in t.regs),
                "fits": t.fits,
                "epochs": t.epochs,
                "seconds": round(t.seconds, 2),
                "sentences": t.sentences,
            }
            for t in self.tasks.values()
        ]


@dataclass
class _Task:
    name: str
    splits: dict[
        str, dict[str, np.ndarray]
    ]  # split → {"i1": sentence positions, "i2": (MRPC), "y": labels}, SentEval order


def _r2(x: float | np.floating) -> float:
    """`x` rounded to two decimals, as a Python float."""
    return round(float(x), 2)


def _senteval_order(s1: list[str], s2: list[str] | None, y: np.ndarray) -> np.ndarray:
    """SentEval's stable sort before embedding: (words, label), MRPC (words 1, words 2, label)."""
    keys: list[tuple[int, ...]]
    if s2 is None:
        keys = [(len(a.split()), int(label)) for a, label in zip(s1, y)]
    else:
        keys = [(len(a.split()), len(b.split()), int(label)) for a, b, label in zip(s1, s2, y)]
    return np.array(sorted(range(len(keys)), key=lambda i: keys[i]), dtype=np.int64)


class TransferEvaluator:
    """Scores any `SentenceEmbedder` on SentEval's transfer tasks (a table of schema `cse.storage.transfer.TRANSFER`).

    Reference: Conneau and Kiela (2018), *SentEval: An Evaluation Toolkit for Universal Sentence Representations*
    (`facebookresearch/SentEval`); the papers' settings as SimCSE (Gao et al., 2021) and DiffCSE (Chuang et al.,
    2022, Table 2) report them.

    Args:
        table: the transfer examples (the `transfer` dataset, or `cse.storage.transfer.read_transfer`'s table).
        limit: keep about this many evenly spaced examples per (task, split), at least 10 (tests, smoke runs);
            None keeps all.

    Raises:
        TransferDataError: the table lacks a column of the schema.
        ValueError: `limit` below 10.

    Examples:
        ```python
        from cse.evaluation.transfer import TransferEvaluator
        from cse.models.embedder import PooledEncoder
        from cse.storage.transfer import read_transfer

        table, _ = read_transfer("../shared/data/senteval")        # or the data root's `transfer` dataset
        evaluator = TransferEvaluator(table)
        encoder = PooledEncoder.from_pretrained("packaged:minilm", "avg")
        result = evaluator.run(encoder, tasks=["mr", "trec"], classifier="fasttest")
        result.metrics()                                            # {"mr": ..., "trec": ..., "transfer_avg": ...}
        ```
    """

    def __init__(self, table: pa.Table, *, limit: int | None = None):
        missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
        if missing:
            raise TransferDataError(
                f"the transfer table lacks columns {missing} (expected the schema of cse.storage.transfer.TRANSFER)"
            )
        if limit is not None and limit < 10:
            raise ValueError(f"limit must be >= 10 examples per split, got {limit}")
        self.limit = limit
        self._rows = self._index(table.select(list(REQUIRED_COLUMNS)).to_pydict())
        self._plans: dict[tuple, tuple[list[str], dict[str, _Task]]] = {}
        self._token_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _index(self, cols: dict[str, list]) -> dict[tuple[str, str], list[tuple[int, str, str | None, int]]]:
        rows: dict[tuple[str, str], list[tuple[int, str, str | None, int]]] = {}
        for t, s, i, a, b, y in zip(*(cols[c] for c in REQUIRED_COLUMNS)):
            rows.setdefault((t, s), []).append((i, a, b, y))
        for key, items in rows.items():
            items.sort(key=lambda r: r[0])
            if self.limit is not None and len(items) > self.limit:
                step = math.ceil(len(items) / self.limit)
                rows[key] = items[::step]
        return rows

    @staticmethod
    def _tasks(tasks: Sequence[str] | None) -> tuple[str, ...]:
        if tasks is None:
            return TRANSFER_TASKS
        bad = [t for t in tasks if t not in TRANSFER_TASKS]
        if bad or not tasks:
            raise ValueError(f"unknown or no transfer task(s) {list(tasks)}; known: {', '.join(TRANSFER_TASKS)}")
        return tuple(t for t in TRANSFER_TASKS if t in tasks)

    def _plan(self, tasks: tuple[str, ...]) -> tuple[list[str], dict[str, _Task]]:
        if tasks in self._plans:
            return self._plans[tasks]
        pos: dict[str, int] = {}

        def at(sentences: Sequence[str]) -> np.ndarray:
            return np.array([pos.setdefault(s, len(pos)) for s in sentences], dtype=np.int64)

        plan: dict[str, _Task] = {}
        for task in tasks:
            splits = {}
            for split in _SPLITS[task]:
                items = self._rows.get((task, split))
                if not items:
                    raise TransferDataError(
                        f"the transfer table has no examples for task {task!r}, split {split!r}; "
                        "ingest the SentEval transfer data (flow `ingest`, dataset `transfer`) or point "
                        "`transfer` at a SentEval downstream folder"
                    )
                s1 = [r[1] for r in items]
                s2 = [r[2] or "" for r in items] if task == "mrpc" else None
                y = np.array([r[3] for r in items], dtype=np.int64)
                order = _senteval_order(s1, s2, y)
                entry = {"i1": at([s1[i] for i in order]), "y": y[order]}
                if s2 is not None:
                    entry["i2"] = at([s2[i] for i in order])
                splits[split] = entry
            plan[task] = _Task(task, splits)
        self._plans[tasks] = (list(pos), plan)
        return self._plans[tasks]

    def sentences(self, tasks: Sequence[str] | None = None) -> list[str]:
        return list(self._plan(self._tasks(tasks))[0])

    # ------------------------------------------------------------------ run

    def run(
        self,
        embedder: SentenceEmbedder,
        *,
        tasks: Sequence[str] | None = None,
        classifier: str = "test",
        batch_size: int = 128,
        precision: str = "fp32",
        progress: bool = False,
        chunk: int = 64,
        log: Callable[[str], None] | None = None,
    ) -> TransferResult:
        """Embed every unique sentence once, then run the protocol task by task.

        Args:
            embedder: the model to score (any `cse.models.embedder.SentenceEmbedder`).
            tasks: the tasks to run (`mr`, `cr`, `subj`, `mpqa`, `sst2`, `trec`, `mrpc`), or None for all.
            classifier: the classifier settings, `test` (the papers' numbers) or `fasttest` (training-time selection).
            batch_size: sentences per embedding batch.
            precision: `fp32`, `bf16` autocast, or `auto` (bf16 on CUDA).
            progress: show a progress bar.
            chunk: how many classifier fits of a task train side by side as one batched model.
            log: told one message string about each finished task.

        Returns:
            Accuracy ×100 per task, SentEval's dev accuracies, timings and the average.

        Raises:
            TypeError: `embedder` is not a `SentenceEmbedder`.
            ValueError: an unknown precision, classifier setting or task.
        """
        check_run(embedder, precision)
        if classifier not in SETTINGS:
            raise ValueError(f"unknown classifier settings {classifier!r}; known: {', '.join(SETTINGS)}")
        settings = SETTINGS[classifier]
        t0 = time.perf_counter()
        names = self._tasks(tasks)
        sentences, plan = self._plan(names)
        emb, st = embed_token_ids(
            embedder,
            cached_token_ids(self._token_cache, embedder, names, sentences),
            batch_size=batch_size,
            precision=precision,
            progress=progress,
            desc="evaluate (transfer)",
            sentences=sentences,
        )
        scores = self._score_tasks(plan, names, emb.to(embedder.device), settings, chunk, log)
        return self._result(classifier, settings, scores, st, embedder, time.perf_counter() - t0)

    def _result(
        self,
        classifier: str,
        settings: ClassifierSettings,
        scores: dict[str, TransferTaskScore],
        st: EncodeStats,
        embedder: SentenceEmbedder,
        seconds: float,
    ) -> TransferResult:
        """The run's result: its scores, timings and, with every task, the averages.

        Args:
            classifier: the name of the classifier settings.
            settings: those settings.
            scores: the tasks' scores.
            st: the embedding pass's statistics.
            embedder: the model scored.
            seconds: the run's wall seconds.
        """
        timing = TransferTiming(
            seconds=seconds,
            embed_seconds=st.seconds,
            classifier_seconds=sum(s.seconds for s in scores.values()),
            sentences=st.sentences,
            tokens=st.tokens,
            sentences_per_s=st.sentences_per_s,
        )
        result = TransferResult(
            classifier=classifier,
            settings=settings.__dict__ | {"regs": list(settings.regs)},
            tasks=scores,
            limit=self.limit,
            device=str(embedder.device),
            embedder=embedder.describe(),
            timing=timing,
        )
        if all(t in scores for t in TRANSFER_TASKS):
            result.transfer_avg = rounded_average([scores[t].acc for t in TRANSFER_TASKS])
            result.transfer_devacc_avg = rounded_average([scores[t].devacc for t in TRANSFER_TASKS])
        return result

    def _score_tasks(
        self,
        plan: dict[str, _Task],
        names: tuple[str, ...],
        emb: torch.Tensor,
        settings: ClassifierSettings,
        chunk: int,
        log: Callable[[str], None] | None,
    ) -> dict[str, TransferTaskScore]:
        """Each task of `names` scored on the embeddings, timed, and told to `log`."""
        scores: dict[str, TransferTaskScore] = {}
        for name in names:
            t1 = time.perf_counter()
            scores[name] = self._score(plan[name], emb, settings, chunk)
            scores[name].seconds = time.perf_counter() - t1
            if log is not None:
                log(
                    f"transfer {name}: acc {scores[name].acc:.2f} (dev {scores[name].devacc:.2f}) in {scores[name].seconds:.1f}s"
                )
        return scores

    @staticmethod
    def _features(emb: torch.Tensor, entry: dict[str, np.ndarray]) -> torch.Tensor:
        a = emb[torch.from_numpy(entry["i1"]).to(emb.device)]
        if "i2" not in entry:
            return a
        b = emb[torch.from_numpy(entry["i2"]).to(emb.device)]
        return torch.cat([(a - b).abs(), a * b], dim=1)  # SentEval's MRPC features

    def _score(self, task: _Task, emb: torch.Tensor, s: ClassifierSettings, chunk: int) -> TransferTaskScore:
        sp = task.splits
        nsent = len(np.unique(np.concatenate([e[k] for e in sp.values() for k in ("i1", "i2") if k in e])))
        score = score_features(
            task.name,
            {split: self._features(emb, e) for split, e in sp.items()},
            {split: e["y"] for split, e in sp.items()},
            s,
            chunk=chunk,
        )
        score.sentences = nsent
        return score


def score_features(
    task: str,
    features: dict[str, torch.Tensor],
    labels: dict[str, np.ndarray],
    settings: ClassifierSettings,
    chunk: int = 64,
) -> TransferTaskScore:
    """SentEval's protocol for `task` on ready features, rows in SentEval's order.

    Splits: `all` (MR, CR, SUBJ, MPQA: nested CV), `train`/`dev`/`test` (SST-2), `train`/`test` (TREC, MRPC: CV on
    train for the penalty).

    Args:
        task: one of `TRANSFER_TASKS`.
        features: `{split: [n, d] float32 tensor}`, all on one device.
        labels: `{split: [n] labels}`.
        settings: the classifier settings (`cse.evaluation.classifier.SETTINGS`).
        chunk: how many fits train side by side as one batched model.

    Raises:
        ValueError: an unknown task.
        TransferDataError: the splits do not match the task's.
    """
    if task not in TRANSFER_TASKS:
        raise ValueError(f"unknown transfer task {task!r}; known: {', '.join(TRANSFER_TASKS)}")
    need = _SPLITS[task]
    if sorted(features) != sorted(need) or sorted(labels) != sorted(need):
        raise TransferDataError(
            f"{task} needs the splits {need}, got features {sorted(features)} and labels {sorted(labels)}"
        )
    x = torch.cat([features[sp].float() for sp in need]).contiguous()
    y = torch.from_numpy(np.concatenate([np.asarray(labels[sp], dtype=np.int64) for sp in need])).to(x.device)
    offs, o = {}, 0
    for sp in need:
        offs[sp] = np.arange(o, o + len(features[sp]))
        o += len(features[sp])
    ncls = NCLASSES[task]
    if int(y.max()) >= ncls or int(y.min()) < 0:
        raise TransferDataError(f"{task}: labels must lie in 0..{ncls - 1}")
    if task in CV_TASKS:
        return _inner_kfold(task, x, y, offs["all"], ncls, settings, chunk)
    if task == "sst2":
        return _split(task, x, y, offs["train"], offs["dev"], offs["test"], ncls, settings, chunk)
    return _kfold(task, x, y, offs["train"], offs["test"], ncls, settings, chunk, f1=task == "mrpc")


def _folds(y: np.ndarray, k: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    from sklearn.model_selection import StratifiedKFold

    return list(StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(np.zeros(len(y)), y))


def _acc(fit: Fitted, x: torch.Tensor, y: torch.Tensor, rows: np.ndarray) -> tuple[float, np.ndarray]:
    idx = torch.from_numpy(rows).to(x.device)
    pred = fit.predict(x[idx])
    return float((pred == y[idx]).float().mean()), pred.cpu().numpy()


def _inner_kfold(
    name: str, x: torch.Tensor, y: torch.Tensor, rows: np.ndarray, ncls: int, s: ClassifierSettings, chunk: int
) -> TransferTaskScore:
    yn = y[torch.from_numpy(rows).to(y.device)].cpu().numpy()
    outer = _folds(yn, s.kfold, s.seed)
    groups, owner = [], []
    for f, (tr, _) in enumerate(outer):
        for itr, ite in _folds(yn[tr], s.kfold, s.seed):
            groups.append(group(rows[tr][itr], s.regs, s.seed, valid=rows[tr][ite]))
            owner.append(f)
    fits = fit_groups(x, y, ncls, groups, s, chunk=chunk)
    dev, chosen = [], []
    for f in range(len(outer)):
        inner = [fs for o, fs in zip(owner, fits) if o == f]
        per_reg = [_r2(100 * np.mean([fs[i].valid_accuracy for fs in inner])) for i in range(len(s.regs))]
        chosen.append(s.regs[int(np.argmax(per_reg))])
        dev.append(max(per_reg))
    finals = fit_groups(
        x,
        y,
        ncls,
        [group(rows[tr], [chosen[f]], s.seed, validation_split=s.validation_split) for f, (tr, _) in enumerate(outer)],
        s,
        chunk=chunk,
    )
    test = [_r2(100 * _acc(ft[0], x, y, rows[te])[0]) for ft, (_, te) in zip(finals, outer)]
    all_fits = [f for fs in fits + finals for f in fs]
    return _task_score(name, _r2(np.mean(test)), _r2(np.mean(dev)), len(rows), len(rows), chosen, all_fits)


def _kfold(
    name: str,
    x: torch.Tensor,
    y: torch.Tensor,
    train: np.ndarray,
    test: np.ndarray,
    ncls: int,
    s: ClassifierSettings,
    chunk: int,
    f1: bool,
) -> TransferTaskScore:
    yn = y[torch.from_numpy(train).to(y.device)].cpu().numpy()
    folds = _folds(yn, s.kfold, s.seed)
    fits = fit_groups(
        x, y, ncls, [group(train[tr], s.regs, s.seed, valid=train[te]) for tr, te in folds], s, chunk=chunk
    )
    per_reg = [_r2(100 * np.mean([fs[i].valid_accuracy for fs in fits])) for i in range(len(s.regs))]
    best = int(np.argmax(per_reg))
    final = fit_groups(x, y, ncls, [group(train, [s.regs[best]], s.seed, validation_split=s.validation_split)], s)[0][0]
    acc, pred = _acc(final, x, y, test)
    score = _chosen_score(name, acc, per_reg, train, test, s, [f for fs in fits for f in fs] + [final])
    if f1:
        gold = y[torch.from_numpy(test).to(y.device)].cpu().numpy()
        tp = int(((pred == 1) & (gold == 1)).sum())
        denom = int((pred == 1).sum()) + int((gold == 1).sum())
        score.f1 = _r2(100 * 2 * tp / denom) if denom else 0.0
    return score


def _split(
    name: str,
    x: torch.Tensor,
    y: torch.Tensor,
    train: np.ndarray,
    dev: np.ndarray,
    test: np.ndarray,
    ncls: int,
    s: ClassifierSettings,
    chunk: int,
) -> TransferTaskScore:
    fits = fit_groups(x, y, ncls, [group(train, s.regs, s.seed, valid=dev)], s, chunk=chunk)[0]
    per_reg = [_r2(100 * ft.valid_accuracy) for ft in fits]
    best = int(np.argmax(per_reg))
    acc, _ = _acc(fits[best], x, y, test)
    return _chosen_score(name, acc, per_reg, train, test, s, fits)


def _chosen_score(
    name: str,
    acc: float,
    per_reg: list[float],
    train: np.ndarray,
    test: np.ndarray,
    s: ClassifierSettings,
    fits: list[Fitted],
) -> TransferTaskScore:
    """The score of a task whose one L2 penalty was chosen on the validation accuracies `per_reg` (×100, one per
    penalty; SentEval's devacc is the best of them): `acc` is its test accuracy (a fraction), `fits` every fit it
    trained, `train` and `test` its rows."""
    regs = [s.regs[int(np.argmax(per_reg))]]
    return _task_score(name, _r2(100 * acc), max(per_reg), len(train), len(test), regs, fits)


def _task_score(
    name: str, acc: float, devacc: float, n_train: int, n_test: int, regs: list[float], fits: list[Fitted]
) -> TransferTaskScore:
    """A task's score from its accuracies (×100), sizes, chosen penalties and fits (timing and sentences set later)."""
    return TransferTaskScore(
        task=name,
        acc=acc,
        devacc=devacc,
        n_train=n_train,
        n_test=n_test,
        regs=regs,
        fits=len(fits),
        epochs=round(float(np.mean([f.epochs for f in fits])), 1),  # the mean epochs a fit trained
        seconds=0.0,
        sentences=0,
    )
