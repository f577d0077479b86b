"""A job's data warnings on its MLflow run: the tag `cse.data_warning` (e.g. Wiki1M read from the local sample).

The training flow's preflight (tasks/preflight.py) finds them before any work; the flow passes these tags with the
job's other tags, so the run carries them from its start (visible in the runs table and on the run's page).
"""

from __future__ import annotations

from collections.abc import Sequence

DATA_WARNING_TAG = "cse.data_warning"
_MAX_CHARS = 8000  # MLflow keeps tag values up to 8,000 characters


def data_warning_tags(warnings: Sequence[str]) -> dict[str, str]:
    """The MLflow tags that carry `warnings` (the preflight's, one sentence each, joined by newlines); none when there
    is no warning."""
    if not warnings:
        return {}
    text = "\n".join(warnings)
    return {DATA_WARNING_TAG: text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 1] + "…"}
