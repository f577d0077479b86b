"""Issue 32, Secrets: one masking rule (`cse.storage.secrets.redact`) for every form of user-info, applied at every exit
of the process. Each form below is fed through each exit: the rule itself, log records, exceptions, Prefect's state
messages and artifacts, every MLflow field the project writes (run name, params, tags, description, dict/text
artifacts, dataset inputs), a training job's records and its exported model card.

The campaign's forms: a password holding `'` (the pattern stopped at quotes), a raw `@` in a DSN's password (libpq
then names the password's tail as the host), and a source URL's credentials (recorded in clear everywhere); the new
cases of the class: a percent-encoded password, a token as the whole user-info, a quoted libpq keyword DSN."""

from __future__ import annotations

import json
import logging
import traceback

import mlflow
import pytest

from cse.storage.secrets import mask_uris, redact, redact_value, redacted_exception, register_environment

# the job's stage tasks run outside a flow (standalone task runs), whose logs Prefect cannot send to its API
pytestmark = pytest.mark.filterwarnings("ignore:Logger 'prefect.task_runs' attempted to send logs:UserWarning")

# every form's credential contains MARK, so "MARK in text" is "a credential leaked"
MARK = "Secret9"
FORMS = {
    "quote": f"http://cse:Pw'{MARK}@127.0.0.1:9",
    "raw @": f"postgresql+psycopg://cse:p@ss{MARK}@127.0.0.1:9/mlflow",
    "source url": f"https://reader:Pw-{MARK}-x@data.example/wiki1m.txt",
    "percent-encoded": f"https://reader:p%40ss%27{MARK}@data.example/wiki1m.txt",
    "token": f"https://ghp_{MARK}Tok@github.com/org/data.git",
    "libpq keywords": f"host=db user=cse password='Pw \\' {MARK}' dbname=mlflow",
}


@pytest.fixture(params=list(FORMS), ids=list(FORMS))
def form(request) -> str:
    return FORMS[request.param]


def _messages(form: str) -> list[str]:
    """The form as libraries and the project print it: bare, quoted, inside JSON, as a repr."""
    return [
        form,
        f"Invalid URI '{form}'",
        f'API request to "{form}/api/2.0/mlflow/runs/get" failed',
        json.dumps({"url": form, "other": "kept"}),
        repr({"tracking_uri": form}),
    ]


def test_the_rule_masks_every_form_wherever_it_is_written(form):
    for text in _messages(form):
        assert MARK not in redact(text), text
        assert "***" in redact(text)
    assert redact("http://127.0.0.1:5000/api and mail@example.com") == "http://127.0.0.1:5000/api and mail@example.com"
    redact("hf_hub_download(repo, token=None)")  # masked there, but `None` is no secret to remember
    assert redact("the result is None) and mask_token='[MASK]'") == "the result is None) and mask_token='[MASK]'"
    assert redact_value({"ingest": {"wiki": {"url": form}}, "steps": [1, form]})["steps"][0] == 1
    assert MARK not in json.dumps(redact_value({"ingest": {"wiki": {"url": form}}, "steps": [1, form]}))


def test_a_piece_of_a_known_password_is_masked_where_a_parser_split_it():
    """The campaign's raw `@`: SQLAlchemy and libpq cut `postgresql://cse:p@ssSecret9@127.0.0.1:9/mlflow` at the first
    `@`, so the error names the password's tail as the host: `failed to resolve host 'ssSecret9@127.0.0.1'` (10
    times, once per retry). A credential of the environment is remembered with the pieces a parser makes of it."""
    from mlflow.store.db.utils import create_sqlalchemy_engine
    from sqlalchemy import inspect

    register_environment({"MLFLOW_TRACKING_URI": FORMS["raw @"]})
    with pytest.raises(Exception) as e:  # the real driver's message
        inspect(create_sqlalchemy_engine(FORMS["raw @"]))
    assert f"ss{MARK}@127.0.0.1" in str(e.value)
    assert MARK not in redact(str(e.value)) and "failed to resolve host '***@127.0.0.1'" in redact(str(e.value))
    register_environment({"HF_TOKEN": f"hf_{MARK}abcdef", "USE_AUTH_TOKEN": "false"})
    assert redact(f"401 for token hf_{MARK}abcdef") == "401 for token ***" and redact("false") == "false"


def test_logs_exceptions_and_prefect_state_messages_are_masked(form, caplog):
    import prefect.states

    import cse.tasks  # noqa: F401 - installs the masking of Prefect's state messages

    with caplog.at_level(logging.WARNING):
        logging.getLogger("sqlalchemy.pool").warning("could not connect to %s", form)
        try:
            raise ConnectionError(f"refused: {form}")
        except ConnectionError:
            logging.getLogger("urllib3").exception("request failed")
    formatted = "\n".join(logging.Formatter().format(r) for r in caplog.records)
    assert MARK not in caplog.text and MARK not in formatted and "***" in caplog.text
    clean = redacted_exception(ValueError(f"cannot reach {form}"))
    assert isinstance(clean, ValueError) and MARK not in "".join(traceback.format_exception(clean))
    assert MARK not in prefect.states.format_exception(RuntimeError(f"task failed on {form}"))


def test_every_mlflow_field_is_masked(form, tmp_path):
    """What the project writes through MLflow's fluent API and client lands masked in the store."""
    from mlflow.entities import Dataset, DatasetInput

    from cse.tracking.run_pages import set_description
    from cse.tracking.store import configure_mlflow, ensure_experiment, flatten

    configure_mlflow()
    with mlflow.start_run(experiment_id=ensure_experiment("secrets"), run_name=f"run {form}") as run:
        mlflow.log_params(flatten({"ingest": {"wiki": {"url": form}}}))
        mlflow.set_tags({"source_location": form})
        set_description(run.info.run_id, f"**simcse** differs: `url={form}`")
        mlflow.log_dict({"config": {"url": form}}, "config.json")
        mlflow.log_text(f"url: {form}", "notes.txt")
        dataset = Dataset(name=f"wiki {form}", digest="d", source_type="http", source=json.dumps({"url": form}))
        mlflow.MlflowClient().log_inputs(run.info.run_id, [DatasetInput(dataset)])
    stored = mlflow.get_run(run.info.run_id)
    fields = {
        "run name": stored.info.run_name,
        "params": json.dumps(stored.data.params),
        "tags": json.dumps(stored.data.tags),  # the description is the tag mlflow.note.content
        "inputs": json.dumps([(d.dataset.name, d.dataset.source) for d in stored.inputs.dataset_inputs]),
        "config.json": mlflow.artifacts.load_text(f"{stored.info.artifact_uri}/config.json"),
        "notes.txt": mlflow.artifacts.load_text(f"{stored.info.artifact_uri}/notes.txt"),
    }
    assert {k: MARK in v for k, v in fields.items()} == dict.fromkeys(fields, False)
    assert "***" in fields["params"] and "***" in fields["run name"]


def test_a_source_urls_credentials_reach_no_record_of_the_ingest_stage(ingest_config, root):
    """The campaign's `ingest.wiki.url = https://user:pw@host/…`: the stage's params `source.url`, and a source read
    from that URL: its location in the tags, the dataset input and the manifest."""
    from cse.config.stages import IngestConfig
    from cse.storage.sources import resolve_source
    from tests.reliability.conftest import data_runs, ingest

    url = FORMS["source url"]
    config = IngestConfig.model_validate(
        {**ingest_config.model_dump(), "wiki": {"path": ingest_config.wiki.path, "url": url}}
    )
    ref = ingest("wiki1m", config)
    # the run of this ingest: the one whose source is this URL (a session-scoped data root of another module may have
    # logged its own ingest-wiki1m, from the default URL, into the store this test starts from)
    [run] = [r for r in data_runs("ingest-wiki1m") if "data.example" in r.data.params.get("source.url", "")]
    assert run.data.params["source.url"] == "https://reader:***@data.example/wiki1m.txt"
    assert MARK not in json.dumps([run.data.params, run.data.tags]) and ref.rows > 0

    root.downloads.mkdir(parents=True, exist_ok=True)
    (root.downloads / "wiki1m_for_simcse.txt").write_text("a cached download .\n")  # the URL is not fetched again
    src = resolve_source(root, "wiki1m", None, url, sha256=None, retries=0)
    assert src.origin == "url" and src.location == "https://reader:***@data.example/wiki1m.txt"
    assert MARK not in json.dumps(src.describe())


def test_a_training_jobs_records_and_model_card_hold_no_credential(job):
    """The campaign's training job with a source URL holding credentials: the MLflow params, the run's name and
    description, the `config.json` artifact and the exported model card (which `cse push` uploads) were in clear."""
    from cse.storage.runs import RunDir

    url = FORMS["percent-encoded"]
    result = job(ingest={"wiki": {"url": url}})
    run = mlflow.get_run(result.run_id)
    card = (RunDir.at(result.run_dir).export / "README.md").read_text()
    shown = {
        "params": json.dumps(run.data.params),
        "run name": run.info.run_name,
        "description and tags": json.dumps(run.data.tags),
        "config.json": mlflow.artifacts.load_text(f"{run.info.artifact_uri}/config.json"),
        "model card": card,
    }
    assert {k: MARK in v for k, v in shown.items()} == dict.fromkeys(shown, False)
    assert run.data.params["ingest.wiki.url"] == "https://reader:***@data.example/wiki1m.txt"
    assert "url=https://reader:***@data.example" in run.info.run_name


@pytest.mark.parametrize("script", ["scripts/services.sh", "scripts/team.sh"])
def test_the_scripts_mask_uris_by_the_same_rule(script):
    """The service scripts print the Prefect and MLflow URLs with `sed`: the same user-info rule as `redact`."""
    import subprocess

    from cse.storage.settings import REPO_ROOT

    uris = [f for f in FORMS.values() if "://" in f] + ["http://127.0.0.1:4200/api", "postgresql://cse@db/prefect"]
    for uri in uris:
        shown = subprocess.run(
            ["bash", "-c", f'eval "$(grep "^redact()" {script})"; redact "$1"', "redact", uri],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert shown == mask_uris(uri), uri
