"""ablate-d2cse, seeds, sweep and compare end to end on a tiny backbone (children run inline as subflows).

Each child is a real training job (a few steps) with test evaluation, so the tables are built from real
MLflow runs; the MLflow parent/child nesting, the re-run behaviour (finished children are not trained again)
and the comparison outputs (Parquet + DuckDB, MLflow artifacts) are checked.
"""

from __future__ import annotations

import statistics

import mlflow
import pytest

from cse.flows.ablate import ablate_d2cse, ablation_children
from cse.flows.compare import compare
from cse.flows.seeds import seeds
from cse.flows.sweep import fine_grid, grid_children, sweep
from cse.storage.catalog import query
from cse.storage.layout import DataRoot
from cse.storage.settings import get_settings
from cse.tasks.compare import select_runs
from cse.tracking.store import configure_mlflow
from tests.loops import heads_ingest


@pytest.fixture(scope="module")
def senteval_head_100(senteval_cut):
    """The SentEval STS and SICK files cut to their first 100 lines (a fraction of the pairs): every child's test
    evaluation scores them.

    `senteval_head`'s 24 lines are too few here: STS16 answer-answer then has two scored pairs, whose cosines under
    variant (d)'s prompted random backbone tie, and their correlation is undefined.
    """
    return senteval_cut(100)


@pytest.fixture
def tiny(tiny_bert_dir, senteval_head_100, wiki_head):
    # the head of the Wiki1M sample: every seed child corrupts the corpus again (its own corruption), so keep it small;
    # the heads of the SentEval files: each child's test evaluation (and the backbone's) scores every pair of them
    return {
        "backbone": str(tiny_bert_dir),
        "max_steps": 2,
        "eval_steps": 2,
        "log_steps": 1,
        "max_train_sentences": 64,
        "ingest": heads_ingest(wiki_head, senteval_head_100),
    }


def _children_of(parent_run_id: str):
    configure_mlflow()
    return mlflow.search_runs(
        search_all_experiments=True,
        filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}'",
        output_format="list",
    )


def test_ablation_wiring_of_the_four_variants():
    cells = {
        c.label: c.overrides["model"] for c in ablation_children("default", None, ["a", "b", "c", "d"], [True, False])
    }
    assert len(cells) == 8
    assert cells["a-cls-prompt"] == dict(
        discriminator_prompts=False, condition_discriminator=True, train_discriminator=False, cls_prompt=True
    )
    assert cells["b-static-cls"]["train_discriminator"] and not cells["b-static-cls"]["cls_prompt"]
    assert not cells["c-cls-prompt"]["condition_discriminator"] and cells["c-cls-prompt"]["discriminator_prompts"]
    assert cells["d-static-cls"] == dict(
        discriminator_prompts=True, condition_discriminator=True, train_discriminator=False, cls_prompt=False
    )
    with pytest.raises(ValueError, match="unknown ablation variants"):
        ablation_children("default", None, ["e"], [True])


def test_sweep_grids():
    kids = grid_children(
        "d2cse", "smoke", {"model": {"prefix_len": 4}}, {"learning_rate": [0.01, 0.02], "model.cls_prompt": [True]}
    )
    assert [k.label for k in kids] == [
        "learning_rate=0.01,model.cls_prompt=True",
        "learning_rate=0.02,model.cls_prompt=True",
    ]
    assert kids[0].overrides == {"model": {"prefix_len": 4, "cls_prompt": True}, "learning_rate": 0.01}
    assert fine_grid([(0.01, 70.0), (0.03, 75.0), (0.05, 74.0)], 0.005) == [0.035, 0.04, 0.045]
    assert fine_grid([(0.02, 70.0), (0.01, 71.0)], 0.005) == [0.015]
    with pytest.raises(ValueError):
        fine_grid([(0.02, 70.0)], 0.005)


def test_ablate_seeds_sweep_and_compare(prefect_harness, tiny, tiny_bert_dir):
    rows = ablate_d2cse("smoke", tiny, variants=["a", "d"], cls_prompt=[False], dispatch="inline")
    assert [(r["variant"], r["cls"]) for r in rows] == [("a", "static-cls"), ("d", "static-cls")]
    assert all(r["state"] == "COMPLETED" and r["sts_avg"] is not None for r in rows)
    assert rows[1]["published_avg"] == 79.02  # Table 6, unsup, static [CLS], (d)
    parent = mlflow.get_run(rows[0]["run_id"]).data.tags["mlflow.parentRunId"]
    assert {r.data.tags["cse.child"] for r in _children_of(parent)} == {"a-static-cls", "d-static-cls"}
    assert {a.path for a in mlflow.tracking.MlflowClient().list_artifacts(parent)} >= {"ablation.md", "ablation.json"}

    again = ablate_d2cse("smoke", tiny, variants=["a", "d"], cls_prompt=[False], dispatch="inline")
    assert [r["run_id"] for r in again] == [r["run_id"] for r in rows]  # finished cells are not retrained
    assert len(_children_of(parent)) == 2

    summary = seeds("d2cse", "smoke", seed_list=[1, 2], overrides=tiny, dispatch="inline")
    by_metric = {r["metric"]: r for r in summary}
    seed_runs = mlflow.search_runs(
        search_all_experiments=True, filter_string="tags.`cse.kind` = 'seeds'", output_format="list"
    )
    seed_children = [r for r in seed_runs if "cse.child" in r.data.tags]
    seed_avgs = [r.data.metrics["sts_avg"] for r in seed_children]
    assert len(seed_avgs) == 2 and seed_avgs[0] != seed_avgs[1]  # two seeds train two different models
    # each seed reads its own corruption (the corruption seed follows the job's), so its own dataset
    corruptions = {r.data.tags["cse.child"]: r.data.tags["corruption_hash"] for r in seed_children}
    assert len(set(corruptions.values())) == 2, corruptions
    published = [m for _, m in DataRoot(get_settings().data_root).list("corruption")]
    assert {m.content_hash for m in published} >= set(corruptions.values())
    assert {m.params["seed"] for m in published if m.content_hash in corruptions.values()} == {1, 2}
    assert by_metric["sts_avg"]["n"] == 2 and by_metric["sts_avg"]["mean"] == pytest.approx(statistics.fmean(seed_avgs))
    assert by_metric["sts_avg"]["std"] == pytest.approx(statistics.stdev(seed_avgs))
    assert set(by_metric) >= {"sts12", "sickr", "sts_avg", "best_stsb_dev"}
    client = mlflow.MlflowClient()
    model = f"cse-d2cse-{tiny_bert_dir.name}-smoke"  # every child registered a version of it (ablation cells too)
    best_seed = max(seed_children, key=lambda r: r.data.metrics["best_stsb_dev"])  # best STS-B dev of the seeds
    assert client.get_model_version_by_alias(model, "best").run_id == best_seed.info.run_id

    out = sweep(
        "d2cse",
        "smoke",
        strategy="lr-two-step",
        coarse=[0.01, 0.03],
        fine_step=0.01,
        overrides={**tiny, "test_evaluation": False},
        dispatch="inline",
    )
    stages = [r["stage"] for r in out["children"]]
    assert stages == ["coarse", "coarse", "fine"] and out["children"][2]["child"] == "fine:learning_rate=0.02"
    assert out["best"]["best_stsb_dev"] == max(r["best_stsb_dev"] for r in out["children"])
    assert all("sts_avg" not in mlflow.get_run(r["run_id"]).data.metrics for r in out["children"])  # dev only
    assert client.get_model_version_by_alias(model, "best").run_id == out["best"]["run_id"]  # the selected child
    assert out["best_versions"] == {model: str(client.get_model_version_by_alias(model, "best").version)}

    result = compare(methods=["d2cse"])
    assert result.runs == 4  # 2 ablation cells + 2 seeds (sweep children have no test scores)
    assert "| published |" in result.markdown and "| difference |" in result.markdown
    assert "D2CSE paper; reference BERT-base" in result.markdown
    root = DataRoot(get_settings().data_root)
    table = query(
        root,
        "select row_kind, count(*) as n from comparisons where \"table\" = 'sts' group by row_kind order by row_kind",
    )
    # 4 runs × 8 columns: each run's scores, the published row and the difference beside it, and the backbone's score
    # before training (issue 34)
    assert dict(zip(table["row_kind"], table["n"])) == {"backbone": 32, "difference": 32, "published": 32, "run": 32}
    avg = "select value from comparisons where row_kind = '{}' and metric = 'sts_avg' limit 1"
    diff, ours = (query(root, avg.format(kind))["value"][0] for kind in ("difference", "run"))
    assert diff == pytest.approx(ours - 79.02, abs=1e-3)
    artifacts = {a.path for a in mlflow.tracking.MlflowClient().list_artifacts(result.mlflow_run_id)}
    assert {"comparison.md", "comparison.csv", "selection.json", "comparison_table.json"} <= artifacts
    best_compared = max(select_runs(methods=["d2cse"]), key=lambda r: r.metrics["best_stsb_dev"])
    assert client.get_model_version_by_alias(model, "best").run_id == best_compared.run_id
    assert mlflow.get_run(result.mlflow_run_id).data.tags[f"cse.best.{model}"] == result.best_versions[model]
