"""Result tables and their publication: the one markdown renderer, the one CSV renderer and the one publisher of
Prefect artifacts.

Rendering is pure (no Prefect, no MLflow at import time): `evaluation/` gives rows (e.g. `EvalResult.table_record`,
`task_rows`) and the tasks and flows render them here. `publish_artifacts` imports `prefect.artifacts` only when it
publishes, inside a Prefect flow or task run.

A table is a list of rows (dicts); its columns are `columns` or the keys of its first row. A cell is rendered by a
formatter: `plain` (None → empty, else `str`), `two_decimals` (None → "–", floats with two decimals) or
`compact_number` (None → "–", numbers by size: 0.1234, 12.34, 123,456).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cse.storage.secrets import redact, redact_value

Row = Mapping[str, Any]
Formatter = Callable[[Any], str]


# ------------------------------------------------------------------------------------------------ cell formatters
def plain(value: Any) -> str:
    """None → an empty cell, anything else as `str` gives it."""
    return "" if value is None else str(value)


def two_decimals(value: Any) -> str:
    """None → "–", a float with two decimals (scores ×100), anything else as `str` gives it."""
    if value is None:
        return "–"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def compact_number(value: Any) -> str:
    """None → "–"; a number by its size: four decimals below 1, two up to 10,000, then thousands separated
    without decimals (parameter counts); anything else as `str` gives it."""
    if value is None:
        return "–"
    if isinstance(value, (int, float)):
        if abs(value) >= 10_000:
            return f"{value:,.0f}"
        return f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


# ------------------------------------------------------------------------------------------------ renderers
def _columns(rows: Sequence[Row], columns: Sequence[str] | None) -> list[str]:
    return list(columns) if columns is not None else list(rows[0])


def markdown_table(
    rows: Sequence[Row],
    columns: Sequence[str] | None = None,
    *,
    title: str | None = None,
    header: bool = True,
    cell: Formatter = plain,
) -> str:
    r"""A markdown table ending with a newline; a missing cell counts as None.

    `title` puts `### <title>` and a blank line above the table; without rows the result is then
    `### <title>\n\n(no rows)\n`, else the empty string. `header=False` leaves out the header and rule lines
    (one more row for a table printed before)."""
    if not rows:
        return f"### {title}\n\n(no rows)\n" if title is not None else ""
    cols = _columns(rows, columns)
    lines = [f"### {title}\n"] if title is not None else []
    if header:
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def csv_table(rows: Sequence[Row], columns: Sequence[str] | None = None, *, line_end: str = "\n") -> str:
    r"""CSV with a header line; a missing or None cell is empty, keys outside `columns` are left out.
    Without rows: the header line alone, or the empty string when no `columns` name it.
    `line_end="\r\n"` gives RFC 4180 line ends."""
    if not rows and columns is None:
        return ""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_columns(rows, columns), extrasaction="ignore", lineterminator=line_end)
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------ Prefect artifacts
def in_prefect_run() -> bool:
    """Whether this code runs inside a Prefect flow run or task run (where artifacts can be created)."""
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def publish_artifacts(
    *,
    tables: Mapping[str, tuple[Sequence[Row], str]] | None = None,
    markdown: Mapping[str, tuple[str, str]] | None = None,
) -> bool:
    """Inside a Prefect flow or task run (`in_prefect_run`): a Prefect table artifact per entry of `tables`
    (key → (rows, description)), then a markdown artifact per entry of `markdown` (key → (text, description)), every
    string masked (`cse.storage.secrets.redact`). Outside one: nothing. Returns whether it published."""
    if not in_prefect_run():
        return False
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    for key, (rows, description) in (tables or {}).items():
        create_table_artifact(table=[redact_value(dict(r)) for r in rows], key=key, description=redact(description))
    for key, (text, description) in (markdown or {}).items():
        create_markdown_artifact(markdown=redact(text), key=key, description=redact(description))
    return True
