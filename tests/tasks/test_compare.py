"""tasks/compare.py: which training runs `select_runs` reads back from a real (SQLite) MLflow store, the rows
`build_comparison` puts beside config/published.py, the wide tables and the recorded comparison."""

from __future__ import annotations

import pytest

from cse.config import published
from cse.storage.readers import SEVEN_TASKS
from cse.tasks.compare import (
    RunRecord,
    build_comparison,
    record_comparison,
    render_csv,
    render_markdown,
    select_runs,
    wide_tables,
)
from cse.tracking.run_pages import BACKBONE_TAG, backbone_tag
from cse.tracking.stage_runs import log_run_results, stage_run

SIMCSE_PUB = published.STS[("simcse", "bert-base", "unsup")]
B_BEFORE = {"evaluation_id": "backbone-x", "pooler": "cls_before_pooler", "metrics": {"sts12": 50.0, "sts_avg": 55.0}}


def _train_run(
    label: str,
    *,
    method: str = "simcse",
    metrics: dict[str, float] | None = None,
    tags: dict | None = None,
    params: dict | None = None,
    fail: bool = False,
) -> str:
    """A training run as the training stage leaves it, written through the tracking seam."""
    run_tags = {
        "method": method,
        "backbone": "bert-base-uncased",
        "preset": "default",
        "cse.child": label,
        **(tags or {}),
    }
    run_params = {"supervised": False, "trainable_parameters": 109_482_240, **(params or {})}
    try:
        with stage_run(method, f"train-{label}", params=run_params, tags=run_tags) as run:
            log_run_results(run.info.run_id, metrics={"sts_avg": 70.0, "sts12": 60.0} if metrics is None else metrics)
            if fail:
                raise RuntimeError("training crashed")
    except RuntimeError:
        pass
    return run.info.run_id


@pytest.fixture(scope="module")
def _store(tmp_path_factory):
    """One SQLite MLflow store for the module (creating it is the slow part): runs in experiments `simcse` and
    `d2cse`, oldest first; `old-a` and `a` share the label `a`."""
    home = tmp_path_factory.mktemp("compare_store")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}", "CSE_MLFLOW_ARTIFACTS": str(home / "mlartifacts")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CSE_HOME", str(home))
        for k, v in env.items():
            mp.setenv(k, v)
        ids = {
            "old-a": _train_run("a", metrics={"sts_avg": 60.0}),
            "b": _train_run("b", tags={"cse.group": "g1", BACKBONE_TAG: backbone_tag(B_BEFORE)}),
            "a": _train_run("a", metrics={"sts_avg": 71.5, "stsb": 80.0}),
            "d": _train_run("d", method="d2cse", tags={"cse.group": "g1", "seed": "2"}),
            "failed": _train_run("failed", fail=True),
            "dev-only": _train_run("dev-only", metrics={"stsb_dev": 80.0}),
            "parent": _train_run("parent", tags={"cse.parent": "true"}),
        }
    return env, ids


@pytest.fixture
def store(_store, monkeypatch):
    """The module's store as this test's tracking store (its data root stays the test's own)."""
    env, ids = _store
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return ids


def test_select_runs_reads_finished_test_evaluated_runs_oldest_first(store):
    runs = select_runs()
    assert [(r.label, r.method, r.run_id) for r in runs] == [
        ("a", "simcse", store["a"]),
        ("b", "simcse", store["b"]),
        ("d", "d2cse", store["d"]),
    ]
    a = runs[0]
    assert (a.backbone, a.preset, a.supervised, a.setting) == ("bert-base-uncased", "default", False, "unsup")
    assert a.metrics["sts_avg"] == 71.5 and a.metrics["stsb"] == 80.0
    assert a.metrics["trainable_parameters"] == 109_482_240.0  # from the run's params
    assert a.backbone_metrics == {} and runs[1].backbone_metrics == {"sts12": 50.0, "sts_avg": 55.0}
    assert runs[1].backbone_pooler == "cls_before_pooler"  # (tag cse.backbone, set by the training job)


def test_select_runs_filters(store):
    assert [r.label for r in select_runs(latest_per_label=False)] == ["a", "b", "a", "d"]
    assert [r.run_id for r in select_runs(latest_per_label=False) if r.label == "a"] == [store["old-a"], store["a"]]
    assert [r.label for r in select_runs(methods=["d2cse"])] == ["d"]
    assert [r.label for r in select_runs(group="g1")] == ["b", "d"]
    assert [r.label for r in select_runs(tags={"seed": "2"})] == ["d"]
    assert [r.label for r in select_runs(experiments=["simcse"])] == ["a", "b"]
    assert select_runs(experiments=["no-such-experiment"]) == []
    picked = select_runs(run_ids=[store["d"], store["old-a"], store["dev-only"]])  # given ids: no status filter needed
    assert [(r.label, r.run_id) for r in picked] == [("d", store["d"]), ("a", store["old-a"])]


def _record(**kw) -> RunRecord:
    base = dict(
        run_id="r1",
        label="simcse-1",
        method="simcse",
        backbone="bert-base-uncased",
        preset="default",
        supervised=False,
        metrics={**{t: float(SIMCSE_PUB[t]) + 1.0 for t in (*SEVEN_TASKS, "sts_avg")}},
    )
    return RunRecord(**{**base, **kw})


def test_build_comparison_against_the_published_numbers():
    rows = build_comparison([_record()])
    sts = [r for r in rows if r["table"] == "sts"]
    assert [r["row_kind"] for r in sts] == ["run"] * 8 + ["published"] * 8 + ["difference"] * 8
    pub = {r["metric"]: r["value"] for r in sts if r["row_kind"] == "published"}
    assert pub == {k: v for k, v in SIMCSE_PUB.items() if k != "source"} and pub["sts_avg"] == 76.25
    assert {r["source"] for r in sts if r["row_kind"] == "published"} == {"SimCSE paper"}
    diff = [r for r in sts if r["row_kind"] == "difference"]
    assert all(r["value"] == 1.0 for r in diff) and diff[0]["source"] == "run − published (bert-base)"
    assert {r["table"] for r in rows} == {"sts", "align_uniform"}  # (which shows sts_avg beside them); no others
    assert [r["value"] for r in rows if r["table"] == "align_uniform" and r["metric"] == "alignment"] == [
        None,
        0.177,
        None,
    ]
    first = sts[0]
    assert {k: first[k] for k in ("label", "method", "backbone", "setting", "mlflow_run_id")} == {
        "label": "simcse-1",
        "method": "simcse",
        "backbone": "bert-base-uncased",
        "setting": "unsup",
        "mlflow_run_id": "r1",
    }


def test_the_backbone_before_training_is_a_row_beside_its_run():
    run = _record(backbone_metrics={"sts12": 40.0, "sts_avg": 50.0}, backbone_pooler="cls_before_pooler")
    sts = [r for r in build_comparison([run]) if r["table"] == "sts"]
    assert [r["row_kind"] for r in sts] == ["run"] * 8 + ["backbone"] * 8 + ["published"] * 8 + ["difference"] * 8
    before = {r["metric"]: r["value"] for r in sts if r["row_kind"] == "backbone"}
    assert before["sts12"] == 40.0 and before["sts_avg"] == 50.0 and before["stsb"] is None
    assert {r["source"] for r in sts if r["row_kind"] == "backbone"} == {"backbone before training (cls_before_pooler)"}
    assert [r["row"] for r in wide_tables(build_comparison([run]))["sts"]] == [
        "run",
        "backbone",
        "published",
        "difference",
    ]


def test_an_unpublished_backbone_is_compared_with_bert_base_and_its_parameters_get_no_difference():
    run = _record(
        method="d2cse", backbone="packaged:minilm", metrics={"sts_avg": 70.0, "trainable_parameters": 12_345.0}
    )
    rows = build_comparison([run])
    sts_pub = [r for r in rows if r["table"] == "sts" and r["row_kind"] == "published"]
    assert sts_pub[0]["source"] == "D2CSE paper; reference BERT-base (no published numbers for packaged:minilm)"
    sts_diff = {r["metric"]: r["value"] for r in rows if r["table"] == "sts" and r["row_kind"] == "difference"}
    assert (
        sts_diff["sts_avg"] == pytest.approx(70.0 - 79.02) and sts_diff["sts12"] is None
    )  # no run value: no difference
    params = [r for r in rows if r["table"] == "parameters"]
    assert [r["row_kind"] for r in params] == ["run", "published"]  # another size: shown, not subtracted
    assert params[1]["value"] == published.PARAMETERS[("d2cse", "bert-base")]["trainable_parameters"]


def test_wide_tables_and_their_markdown_and_csv():
    run = _record(metrics={"sts_avg": 77.25, "alignment": 0.2, "uniformity": -2.0})
    tables = wide_tables(build_comparison([run]))
    assert list(tables) == ["sts", "align_uniform"]
    assert [r["row"] for r in tables["align_uniform"]] == ["run", "published", "difference"]
    assert tables["align_uniform"][0] == {
        "label": "simcse-1",
        "row": "run",
        "method": "simcse",
        "backbone": "bert-base-uncased",
        "setting": "unsup",
        "source": "this project",
        "alignment": 0.2,
        "uniformity": -2.0,
        "sts_avg": 77.25,
    }
    assert tables["align_uniform"][2]["alignment"] == pytest.approx(0.2 - 0.177)

    markdown = render_markdown({"align_uniform": tables["align_uniform"]})
    assert markdown == (
        "### Alignment / uniformity (STS-B test, lower is better)\n\n"
        "| label | row | alignment | uniformity | sts_avg | source |\n"
        "|---|---|---|---|---|---|\n"
        "| simcse-1 | run | 0.2000 | -2.00 | 77.25 | this project |\n"
        "| simcse-1 | published | 0.1770 | -2.31 | – | DiffCSE paper |\n"
        "| simcse-1 | difference | 0.0230 | 0.3130 | – | run − published (bert-base) |\n"
    )
    assert render_markdown(tables).count("### ") == 2 and "\n\n### Alignment" in render_markdown(tables)

    csv_text = render_csv({"align_uniform": tables["align_uniform"][:1]})
    header, row, end = csv_text.split("\r\n")
    assert header.startswith("table,label,row,method,backbone,setting,source,sts12,") and end == ""
    assert header.endswith(",trainable_parameters,mr,cr,subj,mpqa,sst2,trec,mrpc,transfer_avg")
    values = dict(zip(header.split(","), row.split(",")))
    assert {k: values[k] for k in ("table", "label", "alignment", "uniformity", "sts_avg", "sts12")} == {
        "table": "align_uniform",
        "label": "simcse-1",
        "alignment": "0.2",
        "uniformity": "-2.0",
        "sts_avg": "77.25",
        "sts12": "",
    }


def test_record_comparison_writes_the_dataset_and_an_mlflow_run(store):
    import mlflow

    from cse.storage.catalog import query
    from cse.storage.layout import DataRoot
    from cse.storage.settings import get_settings
    from cse.tracking.store import get_runs

    runs = select_runs(experiments=["simcse"])
    summary = record_comparison(runs, {"experiments": ["simcse"]})
    assert summary.runs == 2 and summary.markdown.startswith("### STS (Spearman ×100, test)\n\n| label | row |")
    [run] = get_runs([summary.mlflow_run_id])
    assert run.data.tags["cse.comparison_id"] == summary.comparison_id and run.data.metrics["runs"] == 2
    assert run.info.run_name == f"compare-{summary.comparison_id[:6]}"
    note = run.data.tags["mlflow.note.content"]  # the run's description: the runs side by side on STS
    assert note.startswith(f"**Comparison {summary.comparison_id}**: 2 runs side by side.")
    assert "### STS (Spearman ×100, test)" in note and "| a | run |" in note and "| b | run |" in note
    assert "| label | row | STS12 | STS13 | STS14 | STS15 | STS16 | STS-B | SICK-R | Avg. | source |" in note
    assert "| b | backbone | 50.00 | – |" in note and "| a | run | – | – | – | – | – | 80.00 | – | 71.50 |" in note
    # the chart of every run × task, an artifact shown in the description
    assert "comparison_sts.png" in {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert note.endswith(f"(get-artifact?path=comparison_sts.png&run_uuid={run.info.run_id})")
    assert mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/comparison.md") == summary.markdown
    assert mlflow.artifacts.load_dict(f"runs:/{run.info.run_id}/selection.json") == {"experiments": ["simcse"]}
    csv_text = mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/comparison.csv")
    assert csv_text.startswith("table,label,row,") and ",a,run," in csv_text
    table = mlflow.MlflowClient().load_table(
        run.info.experiment_id,
        "comparison_table.json",  # an MLflow table of
        run_ids=[run.info.run_id],
    )  # the CSV's rows
    assert list(table.columns[:3]) == ["table", "label", "row"] and len(table) == len(csv_text.splitlines()) - 1
    assert table.loc[
        (table["label"] == "a") & (table["row"] == "run") & (table["table"] == "sts"), "sts_avg"
    ].tolist() == [71.5]
    assert summary.best_versions == {}  # these runs logged no model: no registry alias to move
    rows = query(DataRoot(get_settings().data_root), "SELECT DISTINCT label FROM comparisons ORDER BY label")
    assert list(rows["label"]) == ["a", "b"]
    wide = query(DataRoot(get_settings().data_root), "SELECT * FROM comparisons_wide")  # one row per run
    assert list(wide["label"]) == ["a", "b"] and list(wide.columns[:5]) == [
        "label",
        "method",
        "backbone",
        "setting",
        "mlflow_run_id",
    ]
    assert list(wide.columns[5:]) == [*SEVEN_TASKS, "sts_avg", "backbone_avg", "published_avg", "difference_avg"]
    b = wide.iloc[1]
    assert (b.sts12, b.sts_avg, b.backbone_avg, b.published_avg) == (60.0, 70.0, 55.0, SIMCSE_PUB["sts_avg"])
    assert b.difference_avg == pytest.approx(70.0 - SIMCSE_PUB["sts_avg"])
    with pytest.raises(ValueError, match="no finished, test-evaluated training runs"):
        record_comparison([], {"experiments": ["none"]})
