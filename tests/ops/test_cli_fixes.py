"""Issue 24 item 7: `cse sql` tells an SQL mistake from a damaged file, `manifests` names its key column
`dataset_key`, `cse report` prints no `NaN` and two decimals for every score, `cse dataset KIND` names the deployment
to run when there is none yet."""

from __future__ import annotations

import math
from typing import get_args

import pytest

from cse.ops.cli import PRODUCED_BY, DatasetKind
from cse.ops.cli import main as cse
from cse.storage.evaluations import write_evaluation_row
from cse.storage.layout import KINDS, DataRoot
from cse.storage.settings import get_settings

SEVEN = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")


def _err(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "sql, says",
    [
        ("SELEC nonsense", 'Parser Error: syntax error at or near "SELEC"'),
        ("select nosuch from manifests", 'Binder Error: Referenced column "nosuch" not found'),
        ("select 1 / 'a'", "Conversion Error: Could not convert string 'a'"),
    ],
)
def test_sql_mistakes_are_called_sql_errors(sql, says, capsys):
    assert cse(["sql", sql]) == 2
    line = _err(capsys)
    assert line.startswith("cse: error: SQL error: ") and says in line
    assert "cse verify" not in line and "damaged" not in line and "LINE 1" not in line


def test_unknown_view_lists_the_views(capsys):
    assert cse(["sql", "select * from nosuch"]) == 2
    line = _err(capsys)
    assert line.startswith("cse: error: SQL error: Catalog Error: Table with name nosuch does not exist")
    assert "(views: damaged_datasets, manifests)" in line


def _evaluation(eid: str, **scores) -> None:
    """An evaluation row of `eid` with `scores` in the test's data root."""
    write_evaluation_row(
        DataRoot(get_settings().data_root),
        {
            "evaluation_id": eid,
            "created": "2026-01-01T00:00:00",
            "mode": "test",
            "label": eid,
            "sts_source": "sts",
            "sts_hash": "h",
            "sentences": 10,
            "seconds": 1.0,
            "details": "{}",
            **scores,
        },
    )


def test_report_has_no_nan_and_two_decimals(capsys):
    _evaluation(
        "full",
        **{t: 70 + i / 3 for i, t in enumerate(SEVEN)},
        sts_avg=71.123456,
        retrieval_r1=55.5,
        alignment=0.123456,
        uniformity=-2.5,
    )
    _evaluation("partial", **{t: 60.0 for t in SEVEN}, sts_avg=60.0, retrieval_r1=math.nan)  # no r1, no align
    assert cse(["report"]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out and "None" not in out and "nan" not in out
    assert "dataset_key" in out.splitlines()[3]  # the datasets table's header
    rows = {line.split()[1]: line.split()[2:] for line in out.splitlines() if line.startswith("2026-01-01")}
    assert rows["full"] == "70.00 70.33 70.67 71.00 71.33 71.67 72.00 71.12 - 55.50 0.1235 -2.5000".split()
    assert rows["partial"] == ["60.00"] * 8 + ["-", "-", "-", "-"]


def test_report_shows_each_run_beside_its_backbone_before_training(capsys):
    """Issue 34: a training run's evaluation is labelled with what differs from its preset (its MLflow run name), and
    `before` is the Avg. of its backbone's own evaluation (the row `backbone ...`, joined by `backbone_evaluation`)."""
    base = {t: 70.0 for t in SEVEN}
    _evaluation("backbone-1", **base, sts_avg=73.694, label="backbone packaged:minilm (cls)")
    for i, (eid, label, avg) in enumerate((("t1", "d2cse-smoke", 71.57), ("t2", "d2cse-smoke lr=0.0001", 69.82))):
        scores = {t: avg for t in SEVEN} | {"sts_avg": avg, "created": f"2026-01-01T00:00:0{i + 1}"}
        _evaluation(eid, **scores, label=label, backbone_evaluation="backbone-1")
    assert cse(["report"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line.split() for line in lines if line.split()[:2] == ["created", "label"])
    assert header[header.index("avg") + 1] == "before"
    rows = [line for line in lines if line.startswith("2026-01-01")]
    assert " d2cse-smoke lr=0.0001 " in rows[2] and rows[2].split()[-5:-3] == ["69.82", "73.69"]
    assert rows[1].split()[1] == "d2cse-smoke" and rows[1].split()[-5:-3] == ["71.57", "73.69"]
    assert " backbone packaged:minilm (cls) " in rows[0] and rows[0].split()[-5:-3] == ["73.69", "-"]


def test_manifests_key_column_is_dataset_key(capsys):
    _evaluation("e1", sts_avg=1.0)
    assert cse(["sql", "select kind, dataset_key from manifests"]) == 0
    assert [line.split() for line in capsys.readouterr().out.splitlines()] == [
        ["kind", "dataset_key"],
        ["evaluations", "e1"],
    ]


def test_empty_kind_names_the_deployment(capsys):
    assert set(PRODUCED_BY) == set(KINDS)
    assert cse(["dataset", "comparisons"]) == 2
    line = _err(capsys)
    assert "no comparisons dataset under" in line and "`cse run compare/default`" in line
    assert cse(["dataset", "corruption", "--hf"]) == 2
    assert "`cse run corrupt/smoke`" in _err(capsys)


def test_dataset_kind_choices_are_the_layouts_kinds():
    """`cse dataset KIND`'s choices are spelled as a Literal for the type checker; they are storage.layout's KINDS."""
    assert get_args(DatasetKind) == KINDS


def test_outside_a_checkout_without_cse_home_nothing_is_created_in_the_current_folder(monkeypatch, tmp_path, capsys):
    """Issue 44, item 7: `cse report` run from another folder (the package installed, no CSE_HOME) made
    `./.cse/data/catalog.duckdb` there, and the MLflow snippet an empty `./.cse/mlflow.db`. Both now use `~/.cse`,
    and the command says which data root it used."""
    from cse.storage import settings
    from cse.tracking.store import configure_mlflow

    here, home = tmp_path / "elsewhere", tmp_path / "home"
    here.mkdir()
    monkeypatch.setattr(settings, "REPO_ROOT", tmp_path / "site-packages")  # not a checkout
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("CSE_HOME")
    monkeypatch.chdir(here)
    assert cse(["report"]) == 0
    assert f"cse: data root {home / '.cse' / 'data'} (CSE_HOME is unset outside a checkout" in capsys.readouterr().err
    configure_mlflow()  # what the README's MLflow snippet runs first
    assert list(here.iterdir()) == []
    assert (home / ".cse" / "data").is_dir()
