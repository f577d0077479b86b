"""Items 6-8: parameters that mean nonsense are refused; the CLI prints one line and exits 2; no credential is
printed or logged."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from cse.config.evaluation import EvalConfig
from cse.config.stages import TokenizeConfig
from cse.config.training import TrainConfig
from cse.ops.cli import main as cse
from cse.storage.secrets import redact
from tests.reliability.conftest import flip_byte_in_data, ingest, part

# ------------------------------------------------------------------ item 6


NONSENSE = {  # TrainConfig field -> values it refuses
    "eval_batch_size": (-1, 0),
    "max_steps": (0, -5),
    "max_train_sentences": (-1, 0),
    "learning_rate": (-0.01, 0),
    "grad_clip": (-1.0, 0),
    "checkpoint_steps": (0,),
    "backbone": ("", "   "),
    "seed": (-1,),
    "max_length": (2,),
}


@pytest.mark.parametrize("field,value", [(field, v) for field, values in NONSENSE.items() for v in values])
def test_train_config_refuses_nonsense(field, value):
    with pytest.raises(ValidationError, match=field):
        TrainConfig(**{field: value})


def test_none_means_no_limit():
    cfg = TrainConfig(max_steps=None, max_train_sentences=None, checkpoint_steps=None)
    assert cfg.max_steps is None and cfg.max_train_sentences is None
    assert TrainConfig(max_steps=1, max_train_sentences=1, checkpoint_steps=1).max_steps == 1


@pytest.mark.parametrize("kwargs", [{"checkpoint": ""}, {"checkpoint": "  "}, {"model": "", "pooler": "avg"}])
def test_eval_config_refuses_empty_names(kwargs):
    with pytest.raises(ValidationError):
        EvalConfig(**kwargs)


def test_tokenizer_must_be_named():
    with pytest.raises(ValidationError, match="tokenizer"):
        TokenizeConfig(tokenizer="")


# ------------------------------------------------------------------ item 7


def _last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


def test_bad_sql_is_one_line_and_exit_2(capsys):
    assert cse(["sql", "SELEC nonsense"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and _last_line(err).startswith("cse: error: ") and "SELEC" in _last_line(err)
    with pytest.raises(Exception, match="SELEC"):  # --debug: the traceback
        cse(["--debug", "sql", "SELEC nonsense"])


def test_damaged_parquet_in_sql_is_one_line_and_exit_2(ingest_config, root, capsys):
    nli = ingest("nli", ingest_config)
    bad = part(root, "nli", nli.key)
    data = bad.read_bytes()
    bad.write_bytes(data[:4] + b"\xff" * (len(data) - 12) + data[-8:])  # garbage pages, intact footer length/magic
    assert cse(["sql", "select * from nli"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert _last_line(err).startswith("cse: error: ") and "cse verify" in _last_line(err)


def test_cli_verify_on_intact_root_exits_0(ingest_config, root, capsys):
    ingest("nli", ingest_config)
    assert cse(["verify"]) == 0 and "all intact" in capsys.readouterr().out


def test_cli_verify_quick_misses_a_flipped_byte_full_finds_it(ingest_config, root, capsys):
    nli = ingest("nli", ingest_config)
    flip_byte_in_data(part(root, "nli", nli.key))
    assert cse(["verify", "--quick"]) == 0
    assert cse(["verify", "--quarantine"]) == 1
    assert "moved to" in capsys.readouterr().out and not root.dataset_dir("nli", nli.key).exists()


# ------------------------------------------------------------------ item 8

SECRET = "s3cr3t-pw"


@pytest.mark.parametrize(
    "uri",
    [
        f"http://alice:{SECRET}@mlflow.example:5000",
        f"https://alice:{SECRET}@prefect.example/api",
        f"postgresql+psycopg://cse:{SECRET}@127.0.0.1:5432/mlflow",
        f"postgresql://127.0.0.1/db?user=cse&password={SECRET}",
        f"host=127.0.0.1 user=cse password={SECRET} dbname=prefect",
    ],
)
def test_redact_masks_every_uri_form(uri):
    assert SECRET not in redact(uri) and "***" in redact(uri)


def test_evaluation_error_does_not_leak_the_tracking_password(monkeypatch, tmp_path):
    from cse.tasks.evaluate_common import resolve_checkpoint

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{SECRET}@127.0.0.1:9")  # nothing listens on port 9
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with pytest.raises(FileNotFoundError) as e:
        resolve_checkpoint("runs:/0123456789abcdef0123456789abcdef", tmp_path)
    import traceback

    printed = "".join(traceback.format_exception(e.value))  # what a log of the failure shows
    assert SECRET not in printed and "alice:***@127.0.0.1:9" in str(e.value)


def test_outage_warning_does_not_leak_the_tracking_password(tmp_path, caplog):
    import mlflow

    from cse.storage.runs import RunDir
    from cse.tracking.spool import ResilientMetricLogger

    client = mlflow.MlflowClient(tracking_uri=f"http://alice:{SECRET}@127.0.0.1:9")
    run_dir = RunDir("d2cse", "job", home=tmp_path)
    logger = ResilientMetricLogger("0" * 32, run_dir, retry_seconds=0, client=client)
    assert SECRET not in logger.tracking_uri and "alice:***@" in logger.tracking_uri
    with caplog.at_level(logging.WARNING):
        logger._warn_outage(ConnectionError(f"refused: http://alice:{SECRET}@127.0.0.1:9/api"))
    assert SECRET not in caplog.text and "alice:***@" in caplog.text
