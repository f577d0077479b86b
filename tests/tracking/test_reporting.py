"""cse.tracking.reporting: the one markdown renderer, the one CSV renderer (exact output) and the Prefect publisher."""

from __future__ import annotations

import pytest

from cse.tracking import reporting
from cse.tracking.reporting import compact_number, csv_table, markdown_table, plain, publish_artifacts, two_decimals

ROWS = [{"model": "a", "score": 76.254, "n": 3, "note": None}, {"model": "b", "score": 0.5, "n": 12, "note": "x"}]


# ---------------------------------------------------------------- cells
def test_cell_formatters():
    assert [plain(v) for v in (None, 1.5, "x", 0)] == ["", "1.5", "x", "0"]
    assert [two_decimals(v) for v in (None, 76.254, 3, "x", True)] == ["–", "76.25", "3", "x", "True"]
    assert [compact_number(v) for v in (None, 0.12345, -0.5, 12.345, 9_999.0, 10_000, 2_657_818.0, "src")] == [
        "–",
        "0.1235",
        "-0.5000",
        "12.35",
        "9999.00",
        "10,000",
        "2,657,818",
        "src",
    ]


# ---------------------------------------------------------------- markdown
def test_markdown_table_exact():
    assert markdown_table(ROWS) == (
        "| model | score | n | note |\n|---|---|---|---|\n| a | 76.254 | 3 |  |\n| b | 0.5 | 12 | x |\n"
    )


def test_markdown_table_without_header_with_columns_title_and_formatter():
    assert markdown_table(ROWS[:1], header=False) == "| a | 76.254 | 3 |  |\n"
    assert markdown_table(ROWS, ["n", "model", "missing"], cell=two_decimals) == (
        "| n | model | missing |\n|---|---|---|\n| 3 | a | – |\n| 12 | b | – |\n"
    )
    assert markdown_table(ROWS, ["model", "score"], title="Scores", cell=two_decimals) == (
        "### Scores\n\n| model | score |\n|---|---|\n| a | 76.25 |\n| b | 0.50 |\n"
    )


def test_markdown_table_without_rows():
    assert markdown_table([]) == ""
    assert markdown_table([], title="Seeds") == "### Seeds\n\n(no rows)\n"


# ---------------------------------------------------------------- CSV
def test_csv_table_exact():
    assert csv_table(ROWS) == "model,score,n,note\na,76.254,3,\nb,0.5,12,x\n"
    assert csv_table([{"text": 'say "hi", twice', "v": 1}]) == 'text,v\n"say ""hi"", twice",1\n'


def test_csv_table_columns_line_ends_and_no_rows():
    assert csv_table(ROWS, ["table", "model", "n"], line_end="\r\n") == "table,model,n\r\n,a,3\r\n,b,12\r\n"
    assert csv_table([]) == ""
    assert csv_table([], ["a", "b"]) == "a,b\n"


# ---------------------------------------------------------------- Prefect artifacts
@pytest.fixture
def created(monkeypatch):
    """The calls the publisher makes to prefect.artifacts (recorded, not sent to a server)."""
    import prefect.artifacts

    calls = []
    monkeypatch.setattr(prefect.artifacts, "create_table_artifact", lambda **kw: calls.append(("table", kw)))
    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact", lambda **kw: calls.append(("markdown", kw)))
    return calls


def test_nothing_is_published_outside_a_prefect_run(created):
    assert not reporting.in_prefect_run()
    assert publish_artifacts(tables={"t": (ROWS, "d")}, markdown={"m": ("# x", "d")}) is False
    assert created == []


def test_tables_then_markdown_are_published_inside_a_prefect_run(created, monkeypatch):
    monkeypatch.setattr(reporting, "in_prefect_run", lambda: True)
    published = publish_artifacts(
        tables={"comparison-sts": (ROWS, "STS"), "comparison-transfer": (ROWS[:1], "transfer")},
        markdown={"comparison": ("# table", "all tables")},
    )
    assert published is True
    assert created == [
        ("table", {"table": ROWS, "key": "comparison-sts", "description": "STS"}),
        ("table", {"table": ROWS[:1], "key": "comparison-transfer", "description": "transfer"}),
        ("markdown", {"markdown": "# table", "key": "comparison", "description": "all tables"}),
    ]


def test_rendering_imports_neither_prefect_nor_mlflow():
    """Rendering stays pure: importing the module pulls in neither Prefect nor MLflow (only publishing does)."""
    import subprocess
    import sys

    code = "import sys, cse.tracking.reporting; print(sorted(m for m in ('prefect', 'mlflow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
