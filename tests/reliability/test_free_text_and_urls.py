"""Issue 43, Secrets in free text and URLs: every URL `cse` prints and every user-given free text the project stores
passes the masking rule (`cse.storage.secrets.redact`).

The campaign's cases: `cse run` printed the flow run's Prefect page with the password of `PREFECT_API_URL` in clear
(`http://user:p%40ss…@host`, or a plain password), twice, and once with `--quiet`; a password in an evaluation's label
(`EvalConfig.label`) was masked in the MLflow run's name and params but stored in clear in the `evaluation/table1.md`
artifact, the `evaluations` dataset (manifest, Parquet, Arrow copy), the DuckDB catalog and `cse report`. The new case
of the class: the MLflow run page `cse run` prints at the end is built on the tracking server's URL (the tracking URI,
or `CSE_MLFLOW_UI_URL`), whose password was printed in clear too."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import mlflow
import pytest

from cse.config.evaluation import EvalConfig
from cse.storage.secrets import redact

MARK = "Secret43"  # every credential below holds it: "MARK in text" is "a credential leaked"
API_URLS = {
    "percent-encoded": f"http://user:p%40ss{MARK}x@127.0.0.1:9/api",
    "plain": f"http://user:plain{MARK}x@127.0.0.1:9/api",
}


@pytest.fixture
def fake_flow_run(monkeypatch) -> SimpleNamespace:
    """`cse run` against a stand-in for the Prefect server: the flow run is created, reaches Completed at once and
    made no MLflow run (the printing is the project's; only the server's answers are stood in for)."""
    from cse.ops import deployments

    run = SimpleNamespace(id=uuid.uuid4(), name="masked-otter")

    async def start(deployment, parameters):
        return run

    async def wait(flow_run_id, on_state, poll_s=2.0, timeout_s=None, on_poll=None):
        on_state("Completed")

    async def outcome_of(flow_run_id, with_stage_lines=True):
        return deployments.RunOutcome(flow_run_id, run.name, "Completed", True, stage_lines=["cache hit nli/abc"])

    monkeypatch.setattr(deployments, "start", start)
    monkeypatch.setattr(deployments, "wait", wait)
    monkeypatch.setattr(deployments, "outcome_of", outcome_of)
    return run


def _cse_run(quiet: bool, api_url: str) -> str:
    """What `cse run` prints (stdout and stderr) for the stand-in flow run, with `api_url` as PREFECT_API_URL (the
    UI URL, and so the flow run's page, is derived from it)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    from cse.ops.deployments import run_deployment_cli

    lines: list[str] = []
    with temporary_settings(updates={PREFECT_API_URL: api_url}, restore_defaults={PREFECT_UI_URL}):
        assert run_deployment_cli("ingest/default", [], out=lines.append, err=lines.append, quiet=quiet, tty=False) == 0
    return "\n".join(lines)


@pytest.mark.parametrize("form", list(API_URLS))
@pytest.mark.parametrize("quiet", [False, True], ids=["follow", "quiet"])
def test_cse_run_prints_the_flow_run_page_masked(form, quiet, fake_flow_run):
    printed = _cse_run(quiet, API_URLS[form])
    page = f"http://user:***@127.0.0.1:9/runs/flow-run/{fake_flow_run.id}"
    assert MARK not in printed, printed
    assert printed.count(page) == (1 if quiet else 2), printed  # the first line, and the summary's (not --quiet)


def test_cse_run_prints_the_mlflow_run_page_masked(fake_flow_run, monkeypatch):
    """New case: the summary's MLflow page is built on the MLflow UI's URL, the tracking URI when it is a server."""
    import cse.tracking.progress as progress

    monkeypatch.setenv("CSE_MLFLOW_UI_URL", f"https://alice:ui{MARK}x@mlflow.example")
    view = progress.RunView("r" * 32, "3", "evaluate-test-x", "FINISHED", "evaluation", 0, metrics={"sts_avg": 50.0})
    monkeypatch.setattr(progress, "runs_of_flow_runs", lambda ids: [view])
    assert MARK in view.url()  # what the page is built from
    printed = _cse_run(False, "http://127.0.0.1:9/api")
    assert MARK not in printed and f"https://alice:***@mlflow.example/#/experiments/3/runs/{'r' * 32}" in printed


LABELS = {"password=": f"mine password={MARK}x", "URL": f"mine from https://bob:pw{MARK}x@models.example/m"}


@pytest.mark.parametrize("form", list(LABELS))
def test_an_evaluations_label_is_stored_masked_everywhere(form, data_root, tiny_bert_dir, monkeypatch, capsys):
    from cse.ops.cli import main as cse
    from cse.storage.catalog import query
    from cse.storage.layout import DataRoot
    from cse.tasks.evaluate import run_evaluation

    folder, refs = data_root
    monkeypatch.setenv("CSE_DATA_ROOT", str(folder))
    config = EvalConfig(
        model=str(tiny_bert_dir), pooler="cls", sts=refs["sts"].key, label=LABELS[form], extras=False, progress=False
    )
    summary = run_evaluation(config)
    run = mlflow.get_run(summary.mlflow_run_id)
    root = DataRoot(folder)
    dataset = root.dataset_dir("evaluations", summary.evaluation_id)
    stored = {
        "run name": run.info.run_name,
        "params": json.dumps(run.data.params),
        "table1.md": mlflow.artifacts.load_text(f"{run.info.artifact_uri}/evaluation/table1.md"),
        **{f.name: f.read_bytes().decode("latin-1") for f in sorted(dataset.rglob("*")) if f.is_file()},
        "catalog": query(root, f"SELECT * FROM evaluations WHERE evaluation_id = '{summary.evaluation_id}'").to_json(),
        "summary": summary.model_dump_json(),
    }
    assert cse(["report"]) == 0
    stored["cse report"] = capsys.readouterr().out
    assert {"manifest.json", "part-00000.parquet"} <= set(stored)
    assert any(name.endswith(".arrow") for name in stored)
    assert {k: MARK in v for k, v in stored.items()} == dict.fromkeys(stored, False)
    assert redact(LABELS[form]) in stored["table1.md"] and redact(LABELS[form]) in stored["cse report"]


def test_every_evaluation_row_is_stored_masked(root):
    """Whoever labels a row (a training job labels its evaluation with its run name, which quotes what differs from
    its preset: a source URL too), the `evaluations` dataset stores its text masked; the JSON `details` stay JSON."""
    from cse.storage.catalog import query
    from cse.storage.evaluations import row_identity, write_evaluation_row

    label = f"simcse-smoke url=https://reader:pw{MARK}x@data.example/wiki.txt"
    row = row_identity(
        evaluation_id="test-rowmasked",
        mode="test",
        label=label,
        what={"model": "m", "pooler": "cls"},
        embedder={},
        mlflow_run_id=None,
        source="url:https://reader:***@data.example/senteval",
        source_hash="0" * 64,
    )
    details = json.dumps({"label": label, "note": f"mine password={MARK}x", "n": 3})
    write_evaluation_row(root, row | {"sentences": 1, "seconds": 0.5, "details": details}, params={"label": label})
    files = [f for f in root.dataset_dir("evaluations", "test-rowmasked").rglob("*") if f.is_file()]
    assert files and not any(MARK.encode() in f.read_bytes() for f in files)
    [stored] = query(root, "SELECT label, details FROM evaluations").to_dict("records")
    assert stored["label"] == redact(label) and json.loads(stored["details"]) == {
        "label": redact(label),
        "note": "mine password=***",
        "n": 3,
    }
