"""The logger of whatever runs the code: the Prefect run's logger inside a flow or task run, a standard one outside."""

from __future__ import annotations

import logging

from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger


def stage_logger(name: str = "cse") -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a flow or task run, else the standard logger `name`."""
    try:
        return get_run_logger()
    except MissingContextError:  # called outside a Prefect run (tests, scripts, the torchrun worker)
        return logging.getLogger(name)
