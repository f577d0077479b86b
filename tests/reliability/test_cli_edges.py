"""Issue 32, CLI: empty arguments, a negative timeout and oversized parameters are refused in one line, before
anything is done, naming the argument.

The campaign's cases: `cse sql ""` raised `AttributeError: 'NoneType' object has no attribute 'df'`; `cse push ""
owner/name` took `""` for the current folder; `cse run train-simcse/smoke --timeout -5` created a flow run, then said
"not finished after -5 s" and left it scheduled; a 900-level nested `-p overrides=…` raised a `RecursionError`
naming no parameter; a 10 MB override was echoed whole (26 MB from Prefect; the project's own unknown-key check would
have printed a 9.6-million-character line). New cases of the class: SQL of comments or `;` only, `cse card ""`, a
`nan` timeout, a parameter nested deeper than Python's JSON parser goes, 20,000 unknown keys given to a config."""

from __future__ import annotations

import json

import pytest

from cse.config.limits import MAX_CHARS, MAX_DEPTH, ParameterRefused
from cse.ops.cli import main as cse


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("cse: error: ") and "Traceback" not in err, err
    return err


@pytest.fixture
def no_flow_run(monkeypatch) -> list:
    """`cse run` never reaches the Prefect server: every attempt to create a flow run is recorded here."""
    started: list = []

    async def start(deployment, parameters):
        started.append(deployment)
        raise AssertionError("a flow run was created")

    monkeypatch.setattr("cse.ops.deployments.start", start)
    return started


@pytest.mark.parametrize("sql", ["", "   ", "-- only a comment", ";"])
def test_sql_without_a_statement_is_one_line(sql, capsys):
    assert cse(["sql", sql]) == 2
    line = _one_line(capsys)
    assert "AttributeError" not in line and ("the SQL is empty" in line or "no SQL statement" in line)


@pytest.mark.parametrize("argv", [["push", "", "owner/name"], ["push", "  ", "owner/name"], ["card", ""]])
def test_an_empty_folder_is_not_the_current_folder(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # an export-like folder here must not be taken
    (tmp_path / "modules.json").write_text("[]")
    (tmp_path / "README.md").write_text("---\nlibrary_name: sentence-transformers\n---\n")
    assert cse(argv) == 2
    assert "is empty" in _one_line(capsys)
    from cse.ops.publish import ExportFolderError, push_export

    with pytest.raises(ExportFolderError, match="no export folder given"):
        push_export("", "owner/name")


@pytest.mark.parametrize("timeout", ["-5", "0", "nan", "inf", "soon"])
def test_a_timeout_that_is_no_positive_number_is_refused_before_a_flow_run_exists(timeout, no_flow_run, capsys):
    assert cse(["run", "train-simcse/smoke", "--timeout", timeout]) == 2
    assert "--timeout" in _one_line(capsys) and no_flow_run == []
    from cse.ops.deployments import run_deployment_cli

    with pytest.raises(ValueError, match="a finite number of seconds > 0"):
        run_deployment_cli("train-simcse/smoke", [], timeout_s=-5.0)
    assert no_flow_run == []


def _nested(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


@pytest.mark.parametrize("levels", [900, 100_000])
def test_a_deeply_nested_parameter_is_refused_by_name(levels, no_flow_run, capsys):
    assert cse(["run", "train-simcse/smoke", "-p", f"overrides={_nested(levels)}"]) == 2
    line = _one_line(capsys)
    assert "parameter 'overrides' is nested" in line and "RecursionError" not in line and no_flow_run == []
    from cse.config.training import resolve_train_config

    with pytest.raises(ParameterRefused, match=rf"'overrides' is nested more than {MAX_DEPTH} levels"):
        resolve_train_config("smoke", json.loads(_nested(900)), method="simcse")


def test_a_10_mb_parameter_is_refused_without_echoing_it(no_flow_run, capsys):
    value = json.dumps({"learning_rate": "x" * 10_000_000})
    assert cse(["run", "train-simcse/smoke", "-p", f"overrides={value}"]) == 2
    line = _one_line(capsys)
    assert f"parameter 'overrides' is {len(value):,d} characters of JSON; at most {MAX_CHARS:,d}" in line
    assert len(line) < 500 and no_flow_run == []


def test_unknown_keys_are_listed_cut(capsys):
    """What a flow's own check says when a large override reaches it another way (`prefect deployment run`)."""
    from pydantic import ValidationError

    from cse.config.training import TrainConfig

    with pytest.raises(ValidationError) as e:
        TrainConfig.model_validate({f"key_{i:06d}_{'y' * 90}": 1 for i in range(20_000)})
    text = str(e.value)
    assert "unknown TrainConfig keys 'key_000000_" in text and "and 19,990 more" in text and len(text) < 3000
