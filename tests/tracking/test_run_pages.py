"""What the MLflow pages show (tracking/run_pages.py): run names, the STS description beside the paper row, the
metrics a training run charts, the experiment tags of the model-training view. The pages themselves are checked in a
browser by test_mlflow_pages_browser.py."""

from __future__ import annotations

import json

import mlflow

from cse.config import published
from cse.config.methods import DEFAULT_METHOD
from cse.config.training import resolve_train_config
from cse.storage.readers import SEVEN_TASKS
from cse.tracking.run_pages import (
    BACKBONE_TAG,
    EXPERIMENT_KIND_TAG,
    MODEL_TRAINING,
    SCORES_VIEW,
    SHARED_VIEW_PREFIX,
    artifact_image,
    backbone_tag,
    curve_metrics,
    experiment_url,
    overrides_text,
    page_metrics,
    preset_differences,
    read_backbone_tag,
    run_name,
    run_url,
    score_tags,
    sts_description,
)
from cse.tracking.store import configure_mlflow, ensure_experiment

TITLES = ("STS12", "STS13", "STS14", "STS15", "STS16", "STS-B", "SICK-R", "Avg.")  # the score tags' names, in order


def test_run_names_carry_what_differs_from_the_preset(monkeypatch):
    cfg = resolve_train_config("smoke", {"learning_rate": 0.03, "model": {"prefix_len": 12}}, method=DEFAULT_METHOD)
    assert run_name(cfg) == f"{DEFAULT_METHOD}-smoke lr=0.03 prefix_len=12"
    assert run_name(resolve_train_config("smoke", method=DEFAULT_METHOD)) == f"{DEFAULT_METHOD}-smoke"
    many = resolve_train_config(
        "smoke", {"seed": 7, "max_steps": 3, "corrupt": {"mask_ratio": 0.15}}, method=DEFAULT_METHOD
    )
    # name order; seed sets corrupt.seed
    assert run_name(many) == f"{DEFAULT_METHOD}-smoke mask_ratio=0.15 corrupt.seed=7 max_steps=3 seed=7"
    nulled = resolve_train_config("smoke", {"ingest": {"senteval": {"expected_rows": None}}}, method=DEFAULT_METHOD)
    assert run_name(nulled) == f"{DEFAULT_METHOD}-smoke expected_rows=None"  # a mapping replaced: one name
    monkeypatch.setattr("cse.tracking.run_pages.RUN_NAME_MAX", 20)  # past it, the rest is counted
    assert run_name(many) == f"{DEFAULT_METHOD}-smoke mask_ratio=0.15 +3 more"


def test_the_description_shows_the_sts_table_beside_the_bert_base_row_for_minilm():
    cfg = resolve_train_config("smoke", {"learning_rate": 0.03}, method=DEFAULT_METHOD)
    metrics = {t: 70.0 for t in SEVEN_TASKS} | {"sts_avg": 70.0}
    setting = published.setting_of(cfg.method, cfg.preset, cfg.supervised)
    text = sts_description(
        metrics,
        method=cfg.method,
        preset=cfg.preset,
        backbone=cfg.backbone,
        setting=setting,
        differences=preset_differences(cfg),
        before={"pooler": "cls_before_pooler", "metrics": {t: 68.0 for t in metrics}},
        chart=artifact_image("abc123", "evaluation/sts_chart.png", "chart"),
    )
    paper = published.STS[(cfg.method, "bert-base", setting)]
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["backbone before training (cls_before_pooler)"].count("68.00") == 8
    assert rows["difference (run − backbone)"].count("+2.00") == 8
    assert "![chart](get-artifact?path=evaluation/sts_chart.png&run_uuid=abc123)" in text
    assert "| STS12 | STS13 | STS14 | STS15 | STS16 | STS-B | SICK-R | Avg. |" in text
    assert rows["this run"].count("70.00") == 8
    label = "published (BERT-base; this run uses packaged:minilm)"
    assert f"| {paper['sts_avg']:.2f} |" in rows[label] and f"| {paper['sts12']:.2f} |" in rows[label]
    assert f"| {70.0 - paper['sts_avg']:+.2f} |" in rows["difference (run − published)"]
    assert "`learning_rate=0.03`" in text and paper["source"] in text


def test_a_training_run_charts_no_per_subset_scores():
    kept = page_metrics(
        {"sts12": 1.0, "sts_avg": 2.0, "sts12/MSRpar": 3.0, "sts12_pearson": 4.0, "eval_seconds": 5.0, "alignment": 0.1}
    )
    assert kept == {
        "sts12": 1.0,
        "sts_avg": 2.0,
        "alignment": 0.1,
        "STS test/1 STS12": 1.0,  # the headline scores again, as the Model metrics tab's first charts
        "STS test/8 Avg.": 2.0,
    }


def test_the_test_scores_lead_the_model_metrics_tab_then_the_loops_curves():
    """The Model metrics tab puts prefixed sections first, in name order (JavaScript's sort: capitals first), the
    unprefixed metrics last: the test scores' section `STS test` (charts named as the score tags, the paper's order)
    leads, then the dev and loss curves; the single-phase `phase` (a flat line) is left out; the selection's best
    keeps its name."""
    logged = {"loss": 1.0, "loss_rtd": 0.5, "rtd_accuracy": 0.9, "learning_rate": 0.1, "learning_rate_head": 0.2}
    logged |= {"grad_norm": 3.0, "epoch": 0.5, "phase": 0.0, "sentences_per_s": 9.0, "peak_memory_gb": 1.0}
    assert curve_metrics(logged) == {
        "loss/loss": 1.0,
        "loss/loss_rtd": 0.5,
        "loss/rtd_accuracy": 0.9,
        "optimizer/learning_rate": 0.1,
        "optimizer/learning_rate_head": 0.2,
        "optimizer/grad_norm": 3.0,
        "progress/epoch": 0.5,
        "throughput/sentences_per_s": 9.0,
        "throughput/peak_memory_gb": 1.0,
    }
    assert curve_metrics({"phase": 1.0}, phases=2) == {"progress/phase": 1.0}
    assert curve_metrics({"stsb_dev": 70.0, "mr_dev": 80.0, "best_stsb_dev": 70.0}) == {
        "dev/stsb_dev": 70.0,
        "dev/mr_dev": 80.0,
        "best_stsb_dev": 70.0,
    }
    scores = {t: float(i) for i, t in enumerate((*SEVEN_TASKS, "sts_avg"))}
    charts = [k for k in page_metrics(scores) if "/" in k]
    assert charts == [f"STS test/{i} {t}" for i, t in enumerate(TITLES, 1)]
    assert sorted(charts) == charts  # the chart order in the section is the paper's
    names = [*curve_metrics(logged | {"stsb_dev": 1.0}), *page_metrics(scores)]
    sections = sorted({k.rsplit("/", 1)[0] for k in names if "/" in k})  # (Python's str order is JavaScript's here)
    assert sections[:3] == ["STS test", "dev", "loss"]


def test_score_tags_keep_the_papers_order_and_two_decimals():
    tags = score_tags({"sts12": 66.8031023, "sickr": 70.0, "sts_avg": 71.456, "stsb_dev": 1.0}, {"sts_avg": 69.1})
    assert tags == {"1 STS12": "66.80", "7 SICK-R": "70.00", "8 Avg.": "71.46", "9 backbone Avg.": "69.10"}
    assert sorted(tags) == list(tags)  # name order is the paper's order
    cfg = resolve_train_config("smoke", {"learning_rate": 0.0001}, method=DEFAULT_METHOD)
    assert overrides_text(cfg) == "lr=0.0001"
    assert overrides_text(resolve_train_config("smoke", method=DEFAULT_METHOD)) == "(preset)"
    before = {"evaluation_id": "backbone-1", "pooler": "avg", "metrics": {"sts_avg": 78.871, "eval_seconds": 3.0}}
    assert read_backbone_tag({BACKBONE_TAG: backbone_tag(before)}) == {
        "evaluation_id": "backbone-1",
        "pooler": "avg",
        "metrics": {"sts_avg": 78.871},
    }
    assert read_backbone_tag({}) is None and read_backbone_tag({BACKBONE_TAG: "{broken"}) is None


def test_experiments_open_in_the_model_training_view_with_the_scores_view():
    exp_id = ensure_experiment("pages-new")
    tags = mlflow.get_experiment(exp_id).tags
    assert tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    view = json.loads(tags[SHARED_VIEW_PREFIX + SCORES_VIEW])
    assert view["selectedColumns"] == [
        "params.`overrides`",
        *(f"tags.`{i} {t}`" for i, t in enumerate(TITLES, 1)),
        "tags.`9 backbone Avg.`",
    ]
    assert (view["orderByKey"], view["orderByAsc"]) == ("metrics.`sts_avg`", False)  # the best STS Avg. first
    configure_mlflow()
    old = mlflow.create_experiment("pages-old")  # made before (or by someone else): tagged when next used
    assert EXPERIMENT_KIND_TAG not in mlflow.get_experiment(old).tags
    assert ensure_experiment("pages-old") == old
    assert mlflow.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    assert experiment_url("http://h:5000/", "3") == (
        f"http://h:5000/#/experiments/3/runs?workflowType=machine_learning&viewStateShareKey={SCORES_VIEW}"
    )
    assert (
        run_url("http://h:5000", "3", "abc") == "http://h:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    )


def test_the_scores_view_lists_the_best_sts_avg_first():
    """The shared view's order as the runs table asks the store for it (its key and direction as `order_by`), on a
    real local store: the best STS Avg. first (each run's latest value: the trained model's, not the backbone's at
    step 0), a run without a test score yet (still training) last."""
    exp_id = ensure_experiment("pages-order")
    view = json.loads(mlflow.get_experiment(exp_id).tags[SHARED_VIEW_PREFIX + SCORES_VIEW])
    names = {}
    for name, avg in (("low", 70.0), ("high", 75.5), ("training", None), ("middle", 72.25)):
        with mlflow.start_run(experiment_id=exp_id, run_name=name) as run:
            names[run.info.run_id] = name
            mlflow.log_metric("loss/loss", 1.0, step=5)
            if avg is not None:
                mlflow.log_metric("sts_avg", 80.0 - avg, step=0)  # the backbone's before training
                mlflow.log_metric("sts_avg", avg, step=40)
    order = f"{view['orderByKey']} {'ASC' if view['orderByAsc'] else 'DESC'}"
    runs = mlflow.search_runs([exp_id], order_by=[order], output_format="list")
    assert [names[r.info.run_id] for r in runs] == ["high", "middle", "low", "training"]


def test_the_rtd_probe_section_tabulates_each_evaluation_and_reads_the_last_gap():
    from cse.tracking.run_pages import RTD_GAP_READ, rtd_probe_section

    assert rtd_probe_section([]) == ""
    history = [
        (4, {"true_h": 0.5, "rolled_h": 0.5, "no_h": 0.6, "gap": 0.0}),
        (8, {"true_h": 0.40, "rolled_h": 0.52, "no_h": 0.6, "gap": 0.12}),
    ]
    text = rtd_probe_section(history)
    assert "| 4 | 0.5000 | 0.5000 | 0.6000 | +0.0000 |" in text and "| 8 | 0.4000 | 0.5200 | 0.6000 | +0.1200 |" in text
    assert "At step 8 the discriminator's loss is 0.1200 lower with its own sentence's h" in text
    flat = rtd_probe_section([(8, {"true_h": 0.40, "rolled_h": 0.4002, "no_h": 0.38, "gap": 0.0002})])
    assert f"below {RTD_GAP_READ}: the discriminator does not measurably use which sentence h describes" in flat
    wrong = rtd_probe_section([(8, {"true_h": 0.5, "rolled_h": 0.4, "no_h": 0.45, "gap": -0.1})])
    assert "higher with its own sentence's h than with another sentence's" in wrong


def test_the_rtd_probe_section_shows_the_gradient_share_in_group_order():
    from cse.tracking.run_pages import curve_name, rtd_probe_section

    probe = {"true_h": 0.5, "rolled_h": 0.5, "no_h": 0.6, "gap": 0.0}
    shares = {"rtd_grad_norm_rtd_head": 0.002, "rtd_grad_share_mlp": 1.5e-4, "rtd_grad_share_prompts": 6.1e-4}
    text = rtd_probe_section([(4, {**probe, **shares})])
    assert "| ‖λ∇RTD‖ / ‖∇CL‖, prompts | ‖λ∇RTD‖ / ‖∇CL‖, mlp | ‖λ∇RTD‖, rtd_head |" in text
    assert "| +0.0000 | 6.10e-04 | 1.50e-04 | 2.00e-03 |" in text and "gradient share" in text
    assert "gradient share" not in rtd_probe_section([(4, probe)])
    assert curve_name("rtd_grad_share_prompts") == "rtd_probe/rtd_grad_share_prompts"
