"""The evaluator: protocol mechanics on a hand-made STS table, and the packaged MiniLM against an independent
computation: the vectors our evaluator scored are sentence-transformers' (Transformer + Pooling) on a spread of the
sentences, within 1e-5, and their scores are numpy cosines + scipy + SentEval's "all" rule on every pair, within
1e-3 points (one pass of the backbone over the STS sentences; the sample keeps sentence-transformers' pass short)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from scipy.stats import pearsonr, spearmanr
from torch import nn

from cse.evaluation import Evaluator
from cse.evaluation.evaluator import MissingDataError, UnknownTaskError
from cse.evaluation.results import TEST_TASKS
from cse.models.embedder import PooledEncoder, SentenceEmbedder
from cse.models.pooling import pool
from cse.storage import schemas
from cse.storage.readers import read_senteval
from cse.tracking.reporting import markdown_table

# ---------------------------------------------------------------- a hand-made table


class LookupEmbedder(SentenceEmbedder):
    """Sentence → fixed vector (one token per sentence), with dropout to expose a wrong mode."""

    def __init__(self, vectors: dict[str, np.ndarray]):
        super().__init__()
        self.names = list(vectors)
        self.table = nn.Parameter(torch.tensor(np.stack([vectors[n] for n in self.names]), dtype=torch.float32))
        self.dropout = nn.Dropout(0.5)
        self.tokenized = 0
        self.embedded = 0

    @property
    def pad_token_id(self) -> int:
        return 0

    def token_ids(self, sentences):
        self.tokenized += len(sentences)
        return [[self.names.index(s) + 1] for s in sentences]

    def embed(self, input_ids, attention_mask, token_type_ids=None):
        self.embedded += input_ids.shape[0]
        return self.dropout(self.table[input_ids[:, 0] - 1])


def _toy_table(rng, drop: tuple[str, str] | None = None):
    rows = []
    words = [f"s{i}" for i in range(40)]

    def add(task, subset, split, n):
        for i in range(n):
            a, b = rng.choice(words, 2, replace=False)
            pair = {"sentence1": str(a), "sentence2": str(b), "score": float(rng.integers(0, 6))}
            rows.append({"task": task, "subset": subset, "split": split, "pair_index": i, **pair})

    for t in ("sts12", "sts13", "sts14", "sts15", "sts16"):
        add(t, "first", "test", 12)
        add(t, "second", "test", 9)
    for t in ("stsb", "sickr"):
        for split in ("test", "dev", "train"):
            add(t, "all", split, 15)
    if drop is not None:
        rows = [r for r in rows if (r["task"], r["split"]) != drop]
    return pa.Table.from_pylist(rows, schema=schemas.STS), words


@pytest.fixture(scope="module")
def toy():
    rng = np.random.default_rng(0)
    table, words = _toy_table(rng)
    vectors = {w: rng.normal(size=8) for w in words}
    return table, vectors


def _ref_spearman(df, vectors):
    a = np.stack([vectors[s] for s in df.sentence1])
    b = np.stack([vectors[s] for s in df.sentence2])
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return 100 * spearmanr(cos, df.score).statistic


def test_toy_scores_match_a_direct_computation(toy):
    table, vectors = toy
    words = sorted({*table.column("sentence1").to_pylist(), *table.column("sentence2").to_pylist()})
    emb = LookupEmbedder({w: vectors[w] for w in words})
    res = Evaluator(table, qualitative_queries=()).run(emb, "test")
    df = table.to_pandas()
    for task in TEST_TASKS:
        sub = df[(df.task == task) & (df.split == "test")]
        assert res.tasks[task].spearman == pytest.approx(_ref_spearman(sub, vectors), abs=1e-9)
    sts12 = df[df.task == "sts12"]
    parts = [_ref_spearman(sts12[sts12.subset == s], vectors) for s in ("first", "second")]
    assert res.tasks["sts12"].spearman_mean == pytest.approx(np.mean(parts))
    assert res.tasks["sts12"].spearman_wmean == pytest.approx((12 * parts[0] + 9 * parts[1]) / 21)
    assert res.sts_avg == round(np.mean([round(res.tasks[t].spearman, 2) for t in TEST_TASKS]), 2)
    # every unique sentence tokenised and embedded exactly once
    assert emb.tokenized == emb.embedded == res.timing.sentences == len(words)


def test_modes_are_restored_and_dropout_is_off(toy):
    table, vectors = toy
    emb = LookupEmbedder(vectors)
    ev = Evaluator(table)
    emb.train()
    a = ev.run(emb, "dev")
    assert emb.training and emb.dropout.training
    emb.eval()
    b = ev.run(emb, "dev")
    assert a.tasks["stsb_dev"].spearman == b.tasks["stsb_dev"].spearman
    assert not emb.training


def test_dev_mode_scores_dev_splits_and_caches_tokens(toy):
    table, vectors = toy
    emb = LookupEmbedder(vectors)
    ev = Evaluator(table)
    res = ev.run(emb, "dev")
    assert set(res.tasks) == {"stsb_dev", "sickr_dev"} and res.sts_avg is None and res.retrieval is None
    df = table.to_pandas()
    assert res.dev_score == pytest.approx(_ref_spearman(df[(df.task == "stsb") & (df.split == "dev")], vectors))
    n = emb.tokenized
    ev.run(emb, "dev")
    assert emb.tokenized == n  # second call re-tokenises nothing
    assert set(res.metrics()) >= {"stsb_dev", "sickr_dev", "stsb_dev_pearson"}


def test_task_subset_has_no_avg(toy):
    table, vectors = toy
    res = Evaluator(table).run(LookupEmbedder(vectors), "test", tasks=["stsb", "sts12"], extras=False)
    assert list(res.tasks) == ["sts12", "stsb"] and res.sts_avg is None and res.retrieval is None


def test_bad_input_errors(toy):
    table, vectors = toy
    ev = Evaluator(table)
    emb = LookupEmbedder(vectors)
    with pytest.raises(UnknownTaskError, match="unknown task\\(s\\) \\['sts17'\\]"):
        ev.run(emb, "test", tasks=["sts17"])
    with pytest.raises(ValueError, match="unknown mode 'train'"):
        ev.run(emb, "train")
    with pytest.raises(TypeError, match="SentenceEmbedder"):
        ev.run(nn.Linear(2, 2), "dev")
    no_sick, _ = _toy_table(np.random.default_rng(0), drop=("sickr", "test"))
    with pytest.raises(MissingDataError, match="no pairs for task 'sickr', split 'test'"):
        Evaluator(no_sick).run(emb, "test")
    with pytest.raises(MissingDataError, match="lacks columns"):
        Evaluator(table.drop_columns(["score"]))


# ---------------------------------------------------------------- the packaged MiniLM vs sentence-transformers

POOLERS = {"avg": "mean", "cls_before_pooler": "cls"}  # our pooler → sentence-transformers' pooling mode


@pytest.fixture(scope="module")
def sts_df(shared_data):
    table, _ = read_senteval(shared_data / "senteval")
    return table


@pytest.fixture(scope="module")
def evaluator(sts_df):
    return Evaluator(sts_df)


class RecordingEncoder(PooledEncoder):
    """Our MiniLM encoder (pooler `avg`) that keeps, by token ids, the vectors of every forward pass under both
    poolers: the `avg` ones it returns and the `cls_before_pooler` ones. The second pooler's evaluation then needs no
    second pass of the backbone, and the reference scores are computed from exactly the vectors our evaluator scored."""

    def embed(self, input_ids, attention_mask, token_type_ids=None):
        kwargs = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        last = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **kwargs
        ).last_hidden_state
        vectors = {p: pool(p, last, attention_mask) for p in POOLERS}
        for i, (row, mask) in enumerate(zip(input_ids, attention_mask)):
            self.recorded[tuple(row[mask.bool()].tolist())] = {p: v[i].clone() for p, v in vectors.items()}
        return vectors[self.pooler_name]


class ReplayEncoder(PooledEncoder):
    """Pooler `cls_before_pooler`: the vectors a `RecordingEncoder` pooled from the same forward passes."""

    def embed(self, input_ids, attention_mask, token_type_ids=None):
        return torch.stack(
            [
                self.recorded[tuple(row[mask.bool()].tolist())][self.pooler_name]
                for row, mask in zip(input_ids, attention_mask)
            ]
        )


def recording_encoder() -> RecordingEncoder:
    enc = RecordingEncoder.from_pretrained("packaged:minilm", "avg")
    enc.recorded = {}
    return enc


def recorded_vectors(enc: RecordingEncoder, sentences: list[str], pooler: str) -> np.ndarray:
    """The vectors `enc` pooled with `pooler` for `sentences` (each looked up by its token ids), as float64 rows."""
    return np.stack([enc.recorded[tuple(ids)][pooler].numpy() for ids in enc.token_ids(sentences)]).astype(np.float64)


@pytest.fixture(scope="module")
def recording(minilm_path):
    return recording_encoder()


@pytest.fixture(scope="module")
def ours(evaluator, recording):
    """Our evaluator's test-mode results for both poolers, from one pass of the backbone over the sentences."""
    out = {"avg": evaluator.run(recording, "test", batch_size=128)}
    replay = ReplayEncoder(
        recording.backbone, "cls_before_pooler", tokenizer=recording.tokenizer, name="packaged:minilm"
    )
    replay.recorded = recording.recorded
    out["cls_before_pooler"] = evaluator.run(replay, "test", batch_size=128)
    assert out["cls_before_pooler"].timing.sentences == out["avg"].timing.sentences  # the same sentences, replayed
    return out


def scored_pairs(sts_df, splits: dict[str, str]) -> pd.DataFrame:
    """The pairs of `splits` (task → split) as a pandas frame."""
    df = sts_df.to_pandas()
    return df[np.logical_or.reduce([(df.task == t) & (df.split == s) for t, s in splits.items()])]


def reference_scores(df: pd.DataFrame, vectors: dict[str, np.ndarray]) -> dict[str, float]:
    """Independent scores of the pairs `df` from `vectors` (sentence → vector): numpy cosines, scipy's correlations,
    SentEval's "all" rule (STS12–16: one correlation over every subset's pairs), the average of the rounded scores."""

    def cos(part: pd.DataFrame) -> np.ndarray:
        a = np.stack([vectors[s] for s in part.sentence1])
        b = np.stack([vectors[s] for s in part.sentence2])
        c = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        # cos(x, x) = 1 exactly: otherwise float noise orders the 65 + 14 identical pairs of STS12
        return np.where(part.sentence1.to_numpy() == part.sentence2.to_numpy(), 1.0, c)

    res: dict[str, float] = {}
    for (task, split), part in df.groupby(["task", "split"]):
        part = part.sort_values(["subset", "pair_index"], kind="stable")
        c = cos(part)
        name = task if split == "test" else f"{task}_{split}"
        res[name] = 100 * spearmanr(c, part.score).statistic
        res[f"{name}_pearson"] = 100 * pearsonr(c, part.score).statistic
        if split == "test" and task.startswith("sts1"):
            for sub, g in part.groupby("subset"):
                res[f"{task}/{sub}"] = 100 * spearmanr(cos(g), g.score).statistic
    if all(t in res for t in TEST_TASKS):
        res["sts_avg"] = round(np.mean([float(f"{res[t]:.2f}") for t in TEST_TASKS]), 2)
    return res


@pytest.fixture(scope="module")
def reference(sts_df, ours, recording):
    """Per pooler, the independent scores of the very vectors our evaluator scored (test mode)."""
    df = scored_pairs(sts_df, {t: "test" for t in TEST_TASKS})
    sentences = sorted(set(df.sentence1) | set(df.sentence2))
    return {
        pooler: reference_scores(df, dict(zip(sentences, recorded_vectors(recording, sentences, pooler))))
        for pooler in POOLERS
    }


# The same vectors' scores agree to float noise: cosines computed in another order reorder a few near-tied pairs
# (up to 5.5e-5 points measured, STS13); the vectors agree with sentence-transformers' to float noise.
SCORE_TOL, VECTOR_TOL = 1e-3, 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("pooler", list(POOLERS))
def test_minilm_scores_match_an_independent_computation(ours, reference, pooler):
    mine, ref = ours[pooler].metrics(), reference[pooler]
    diffs = {t: abs(mine[t] - ref[t]) for t in TEST_TASKS}
    assert max(diffs.values()) <= SCORE_TOL, diffs
    assert all(abs(mine[f"{t}_pearson"] - ref[f"{t}_pearson"]) <= SCORE_TOL for t in TEST_TASKS)
    subsets = [k for k in ref if "/" in k]
    sub_diffs = {k: abs(mine[k] - ref[k]) for k in subsets}
    assert len(subsets) == 24 and max(sub_diffs.values()) <= SCORE_TOL, sub_diffs
    assert abs(mine["sts_avg"] - ref["sts_avg"]) <= 0.005  # an average of scores rounded to 2 decimals
    print(pooler, markdown_table([ours[pooler].table_record(f"MiniLM {pooler}")], header=False))


@pytest.mark.slow
def test_minilm_vectors_match_sentence_transformers(sts_df, ours, recording, minilm_path):
    """sentence-transformers (Transformer + Pooling(mean, cls)) embeds a spread of the scored sentences, the longest
    included, as our encoder did for the evaluation, under both poolers."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    df = scored_pairs(sts_df, {t: "test" for t in TEST_TASKS})
    by_length = sorted(set(df.sentence1) | set(df.sentence2), key=lambda s: (len(s), s))
    sample = sorted(set(by_length[::20]) | set(by_length[-16:]))
    tr = Transformer(minilm_path)
    d = tr.get_embedding_dimension() if hasattr(tr, "get_embedding_dimension") else tr.get_word_embedding_dimension()
    both = SentenceTransformer(modules=[tr, Pooling(d, pooling_mode=("mean", "cls"))], device="cpu")
    emb = both.encode(sample, batch_size=128, convert_to_numpy=True, show_progress_bar=False).astype(np.float64)
    # the concatenation order (mean | cls) checked against single-mode models on a few sentences
    for i, mode in enumerate(("mean", "cls")):
        single = SentenceTransformer(modules=[tr, Pooling(d, pooling_mode=mode)], device="cpu")
        assert np.allclose(single.encode(sample[:8], convert_to_numpy=True), emb[:8, i * d : (i + 1) * d], atol=1e-5)
    for i, pooler in enumerate(POOLERS):
        gap = np.abs(recorded_vectors(recording, sample, pooler) - emb[:, i * d : (i + 1) * d]).max()
        assert gap <= VECTOR_TOL, (pooler, gap, len(sample))


@pytest.mark.slow
def test_minilm_dev_mode_matches(evaluator, sts_df):
    enc = recording_encoder()
    res = evaluator.run(enc, "dev")
    df = scored_pairs(sts_df, {"stsb": "dev", "sickr": "dev"})
    sentences = sorted(set(df.sentence1) | set(df.sentence2))
    ref = reference_scores(df, dict(zip(sentences, recorded_vectors(enc, sentences, "avg"))))
    assert abs(res.dev_score - ref["stsb_dev"]) <= SCORE_TOL
    assert abs(res.tasks["sickr_dev"].spearman - ref["sickr_dev"]) <= SCORE_TOL
    assert res.timing.sentences < 4000  # only the dev splits are embedded


TEST_PAIRS = {"sts12": 3108, "sts13": 1500, "sts14": 3750, "sts15": 3000, "sts16": 1186, "stsb": 1379, "sickr": 4927}


@pytest.mark.slow
def test_minilm_test_mode_structure(ours):
    res = ours["avg"]
    assert {t: res.tasks[t].n for t in TEST_TASKS} == TEST_PAIRS
    subsets = {"sts12": 5, "sts13": 3, "sts14": 6, "sts15": 5, "sts16": 5}
    assert {t: len(res.tasks[t].subsets) for t in subsets} == subsets
    r = res.retrieval
    assert r.n_pairs == 97 and r.n_queries == 194 and r.corpus_size == {"index": 2758, "string": 2551}
    for rule in ("index", "string"):
        rec = r.recall[rule]
        assert rec[1] <= rec[3] <= rec[5] <= rec[10] <= 100
        assert all(abs(v * 194 / 100 - round(v * 194 / 100)) < 1e-9 for v in rec.values())  # multiples of 1/194
    assert r.recall["string"][1] >= r.recall["index"][1]
    au = res.align_uniform
    assert au.n_positive_pairs == 338 and au.n_sentences == 2758
    assert 0 < au.alignment < 2 and au.uniformity < 0
    assert [q.query for q in res.qualitative][:1] == ["you can do it , too ."]
    assert all(len(q.neighbours) == 5 and q.query not in [n.sentence for n in q.neighbours] for q in res.qualitative)
    assert res.qualitative[0].answers == ["yes , you can do it ."]
    assert len(res.stsb_test_pairs["cosine"]) == 1379
