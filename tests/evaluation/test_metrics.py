"""Each metric on small hand-made cases with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cse.evaluation.alignment import alignment, uniformity
from cse.evaluation.plots import alignment_uniformity_plot, bucket_of, cosine_by_gold_plot
from cse.evaluation.qualitative import answers_of, nearest_neighbours
from cse.evaluation.retrieval import ranks_of_targets, retrieval_scores
from cse.evaluation.sts import correlation, cosine_pairs, rounded_average, score_task

# ---------------------------------------------------------------- STS


def test_cosine_pairs_known_values_and_zero_guard():
    a = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [3.0, 4.0]])
    b = np.array([[0.0, 2.0], [2.0, 2.0], [1.0, 0.0], [-3.0, -4.0]])
    assert np.allclose(cosine_pairs(a, b), [0.0, 1.0, 0.0, -1.0])
    with pytest.raises(ValueError, match="one shape"):
        cosine_pairs(a, b[:2])


def test_correlation_spearman_and_pearson():
    c = correlation([1, 2, 3, 4], [1, 8, 27, 64])  # monotone but not linear
    assert c.spearman == pytest.approx(100.0) and c.pearson < 99.0 and c.n == 4
    assert correlation([4, 3, 2, 1], [1, 2, 3, 4]).spearman == pytest.approx(-100.0)
    # ties averaged: gold ranks (1, 2.5, 2.5, 4); Pearson of ranks (1,2,3,4) vs those = 0.9486833
    assert correlation([1, 2, 3, 4], [0, 1, 1, 2]).spearman == pytest.approx(94.86833, abs=1e-4)
    with pytest.raises(ValueError, match="at least 2"):
        correlation([1.0], [2.0])


def test_score_task_all_mean_wmean():
    # subset A (3 pairs) is perfectly ranked, subset B (2 pairs) perfectly reversed.
    a = (np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0]))
    b = (np.array([0.2, 0.1]), np.array([4.0, 5.0]))
    s = score_task("sts12", "test", {"A": a, "B": b})
    assert s.subsets["A"].spearman == pytest.approx(100.0) and s.subsets["B"].spearman == pytest.approx(-100.0)
    assert s.spearman_mean == pytest.approx(0.0)
    assert s.spearman_wmean == pytest.approx((3 * 100 - 2 * 100) / 5)
    # "all": pred ranks (3,4,5,2,1) vs gold ranks (1..5): d = (2,2,2,-2,-4), Σd² = 32, ρ = 1 - 6·32/(5·24) = -0.6
    assert s.spearman == pytest.approx(-60.0) and s.n == 5
    single = score_task("stsb", "test", {"all": a})
    assert single.subsets == {} and single.spearman_mean is None and single.spearman == pytest.approx(100.0)


def test_rounded_average_rounds_each_score_first():
    assert rounded_average([73.42, 84.34, 77.43, 84.18, 81.16, 81.97, 70.61]) == 79.02  # D2CSE-BERT-base unsup
    assert rounded_average([0.006, 0.006, 0.0]) == 0.01  # mean of unrounded = 0.004 → 0.00
    with pytest.raises(ValueError):
        rounded_average([])


# ---------------------------------------------------------------- retrieval

# pairs: (a, b, 5.0), (b, c, 2.0), (d, e, 1.0) → corpus positions a0 b1 d2 | b3 c4 e5; "b" appears twice.
S1, S2, GOLD = ["a", "b", "d"], ["b", "c", "e"], [5.0, 2.0, 1.0]
VEC = {"a": [1.0, 0.0], "b": [0.8, 0.6], "c": [0.6, 0.8], "d": [0.0, 1.0], "e": [-1.0, 0.0]}


def _emb(sents):
    return np.array([VEC[s] for s in sents])


def test_retrieval_index_and_string_rules():
    r = retrieval_scores(S1, S2, GOLD, _emb(S1), _emb(S2), ks=(1, 2, 3), match="index")
    # query a → target b@3: the copy b@1 ties and comes first → rank 1.
    # query b@3 → target a@0: b@1 (cos 1) and c (0.96) score higher → rank 2.
    assert r.recall["index"] == {1: 0.0, 2: 50.0, 3: 100.0}
    # string rule: corpus {a, b, d, c, e}; query a → b ranks first; query b (its string excluded) → c beats a → rank 1.
    assert r.recall["string"] == {1: 50.0, 2: 100.0, 3: 100.0}
    assert r.n_pairs == 1 and r.n_queries == 2 and r.corpus_size == {"index": 6, "string": 5}
    assert r.headline() == r.recall["index"]
    assert retrieval_scores(S1, S2, GOLD, _emb(S1), _emb(S2), ks=(1,), match="string").headline() == {1: 50.0}


def test_retrieval_identical_pair_is_a_string_hit_and_errors():
    vec = {"x": [1.0, 0.0], "y": [0.9, 0.1]}
    s1, s2 = ["x", "y"], ["x", "y"]
    e = np.array([vec[s] for s in s1])
    r = retrieval_scores(s1, s2, [5.0, 1.0], e, e, ks=(1,))
    assert r.recall["string"] == {1: 100.0}
    assert r.recall["index"] == {1: 100.0}  # the other copy of x is the target itself
    with pytest.raises(ValueError, match="no pair has gold score 5.0"):
        retrieval_scores(S1, S2, [1.0, 2.0, 3.0], _emb(S1), _emb(S2))
    with pytest.raises(ValueError, match="unknown retrieval duplicate rule"):
        retrieval_scores(S1, S2, GOLD, _emb(S1), _emb(S2), match="fuzzy")


def test_ranks_of_targets_ties_and_exclusion():
    sim = np.array([[0.5, 0.9, 0.5, 0.1]])
    none = np.zeros_like(sim, dtype=bool)
    assert ranks_of_targets(sim, np.array([2]), none).tolist() == [2]  # 0.9 and the earlier tie
    excl = np.array([[False, True, False, False]])
    assert ranks_of_targets(sim, np.array([2]), excl).tolist() == [1]
    assert ranks_of_targets(sim, np.array([0]), excl).tolist() == [0]


# ---------------------------------------------------------------- alignment / uniformity


def test_alignment_on_normalised_embeddings():
    assert alignment(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])) == pytest.approx(2.0)
    x, y = torch.tensor([[2.0, 0.0], [0.0, 5.0]]), torch.tensor([[0.0, 3.0], [0.0, 1.0]])
    assert alignment(x, y) == pytest.approx(1.0)
    assert alignment(torch.tensor([[1.0, 1.0]]), torch.tensor([[3.0, 3.0]])) == pytest.approx(0.0)


def test_uniformity_known_configurations():
    assert uniformity(torch.tensor([[1.0, 0.0], [-1.0, 0.0]])) == pytest.approx(-8.0)  # ‖x−y‖² = 4
    tri = torch.tensor([[math.cos(a), math.sin(a)] for a in (0.0, 2 * math.pi / 3, 4 * math.pi / 3)]) * 7
    assert uniformity(tri) == pytest.approx(-6.0)  # all pairwise ‖x−y‖² = 3
    assert uniformity(tri, t=1.0) == pytest.approx(-3.0)
    # mixed distances: log((e^{-8} + 2e^{-4}) / 3)
    pts = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])
    assert uniformity(pts) == pytest.approx(math.log((math.exp(-8) + 2 * math.exp(-4)) / 3))
    with pytest.raises(ValueError):
        uniformity(torch.tensor([[1.0, 0.0]]))


# ---------------------------------------------------------------- qualitative, plots


def test_nearest_neighbours_excludes_query_and_duplicates():
    corpus = ["a", "b", "b", "c", "d"]
    emb = np.array([[1.0, 0.0], [0.8, 0.6], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.0]])
    out = nearest_neighbours(["a"], np.array([[1.0, 0.0]]), corpus, emb, k=3, answers=[["c"]])
    n = out[0].neighbours
    assert [x.sentence for x in n] == ["b", "c", "d"]
    assert [round(x.cosine, 4) for x in n] == [0.8, 0.0, -1.0]
    assert [x.is_answer for x in n] == [False, True, False]


def test_answers_of_gold5_partners():
    assert answers_of("b", ["a", "b", "b"], ["b", "c", "d"], [5.0, 5.0, 4.0]) == ["a", "c"]
    assert answers_of("zzz", ["a"], ["b"], [5.0]) == []


def test_plots_write_pngs(tmp_path):
    assert bucket_of(np.array([0.0, 0.99, 1.0, 3.99, 4.0, 5.0])).tolist() == [0, 0, 1, 3, 4, 4]
    rng = np.random.default_rng(0)
    gold = rng.uniform(0, 5, 300)
    p = cosine_by_gold_plot(gold / 5 + rng.normal(0, 0.1, 300), gold, tmp_path / "c.png")
    q = alignment_uniformity_plot((0.2, -2.0), "run", tmp_path / "au.png")
    for f in (p, q):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000


# ---------------------------------------------------------------- metric names


def test_metric_names_are_flat_mlflow_keys_and_recall_is_named_r1():
    """`EvalResult.metrics()` names every number; MLflow keys allow letters, digits, `_ - . / :` and spaces, not `@`,
    so recall@k is `retrieval_r<k>` (the headline rule) beside `retrieval_<rule>_r<k>`."""
    import re

    from cse.evaluation.results import AlignUniform, Correlation, EvalResult, RetrievalScore, TaskScore, Timing

    sts12 = TaskScore(
        task="sts12",
        split="test",
        spearman=70.0,
        pearson=71.0,
        n=5,
        subsets={
            "MSRpar": Correlation(spearman=60.0, pearson=61.0, n=3),
            "surprise.OnWN": Correlation(spearman=80.0, pearson=81.0, n=2),
        },
        spearman_mean=70.0,
        spearman_wmean=68.0,
        pearson_mean=71.0,
        pearson_wmean=69.0,
    )
    stsb = TaskScore(task="stsb", split="test", spearman=75.0, pearson=76.0, n=4)
    retrieval = RetrievalScore(
        match="string",
        ks=[1, 5],
        n_pairs=97,
        n_queries=194,
        corpus_size={"index": 2758, "string": 2700},
        recall={"index": {1: 50.0, 5: 80.0}, "string": {1: 55.0, 5: 85.0}},
    )
    au = AlignUniform(
        alignment=0.2, uniformity=-2.0, n_positive_pairs=10, n_sentences=20, threshold=4.0, inclusive=True
    )
    timing = Timing(seconds=2.0, embed_seconds=1.0, sentences=8, tokens=80, sentences_per_s=4.0)
    result = EvalResult(
        mode="test",
        tasks={"sts12": sts12, "stsb": stsb},
        sts_avg=72.5,
        sts_avg_pearson=73.5,
        retrieval=retrieval,
        align_uniform=au,
        timing=timing,
    )
    metrics = result.metrics()
    assert metrics == {
        "sts12": 70.0,
        "sts12_pearson": 71.0,
        "sts12_mean": 70.0,
        "sts12_wmean": 68.0,
        "sts12_pearson_mean": 71.0,
        "sts12_pearson_wmean": 69.0,
        "sts12/MSRpar": 60.0,
        "sts12/MSRpar_pearson": 61.0,
        "sts12/surprise.OnWN": 80.0,
        "sts12/surprise.OnWN_pearson": 81.0,
        "stsb": 75.0,
        "stsb_pearson": 76.0,
        "sts_avg": 72.5,
        "sts_avg_pearson": 73.5,
        "retrieval_r1": 55.0,
        "retrieval_r5": 85.0,
        "retrieval_index_r1": 50.0,
        "retrieval_index_r5": 80.0,
        "retrieval_string_r1": 55.0,
        "retrieval_string_r5": 85.0,
        "alignment": 0.2,
        "uniformity": -2.0,
        "eval_seconds": 2.0,
        "eval_sentences_per_s": 4.0,
    }
    assert all(re.fullmatch(r"[A-Za-z0-9_\-./: ]+", name) for name in metrics), sorted(metrics)


def test_identical_sentences_have_cosine_exactly_one():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 16)).astype(np.float32).astype(np.float64)
    b = a.copy()
    b[2] = rng.normal(size=16)
    same = np.array([True, True, False])
    c = cosine_pairs(a, b, identical=same)
    assert c[0] == 1.0 and c[1] == 1.0 and c[2] < 1.0
    z = np.zeros((1, 4))
    assert cosine_pairs(z, z, identical=np.array([True]))[0] == 0.0  # a zero vector stays 0 (SentEval's guard)


def test_a_subset_with_tied_predictions_scores_nan_and_the_result_survives_json():
    """SentEval's reading: a subset whose predicted similarities are all equal has no ranking to correlate (NaN);
    the task's headline over the subsets concatenated is still defined. The NaN is written to JSON as `NaN` and read
    back (pydantic's default `null` made the stored result unreadable)."""
    import json

    from cse.evaluation.results import EvalResult, Timing

    tied = (np.array([0.5, 0.5]), np.array([1.0, 2.0]))  # 2 pairs, the same cosine
    other = (np.array([0.1, 0.2, 0.3]), np.array([1.0, 2.0, 3.0]))
    score = score_task("sts16", "test", {"answer-answer": tied, "headlines": other})
    assert np.isnan(score.subsets["answer-answer"].spearman) and np.isnan(score.spearman_mean)
    assert np.isfinite(score.spearman) and score.n == 5
    timing = Timing(seconds=1.0, embed_seconds=1.0, sentences=10, tokens=50, sentences_per_s=10.0)
    result = EvalResult(mode="test", tasks={"sts16": score}, timing=timing)
    back = EvalResult.model_validate(json.loads(result.model_dump_json()))
    assert np.isnan(back.tasks["sts16"].subsets["answer-answer"].spearman)
    assert back.tasks["sts16"].spearman == score.spearman
    assert np.isnan(back.metrics()["sts16/answer-answer"])
