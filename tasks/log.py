"""The logger of whatever runs the code: the Prefect run's logger inside a flow or task run, a standard one outside."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger


def stage_logger(name: str = "cse") -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a flow or task run, else the standard logger `name`."""
    try:
        return get_run_logger()
    except MissingContextError:  # called outside a Prefect run (tests, scripts, the torchrun worker)
        return logging.getLogger(name)


EMBEDDING_EVERY_S = 10.0  # an evaluation's progress line at most this often (and when every sentence is embedded)


def embedding_progress(
    stage: str, log: logging.Logger | logging.LoggerAdapter | None = None
) -> Callable[[int, int], None]:
    """The `on_progress` of an evaluation (`Evaluator.run`): a log line `<stage>: 12,000 of 40,000 sentences embedded
    (30%), 850 sentences/s, ETA 0:00:41` at most every `EMBEDDING_EVERY_S` seconds and when all are embedded (what
    `cse run` shows while an evaluation runs, `cse.ops.follow.EVAL_LINE`).

    Args:
        stage: the stage's name (`evaluate-test`, `evaluate-backbone`, `evaluate`).
        log: where the lines go; None: `stage_logger()`.
    """
    began, said = time.monotonic(), [time.monotonic()]
    out = log or stage_logger()

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - said[0] < EMBEDDING_EVERY_S:
            return
        said[0] = now
        rate = done / max(now - began, 1e-9)
        eta = f", ETA {timedelta(seconds=round((total - done) / rate))}" if done < total and rate > 0 else ""
        out.info(
            "%s: %s of %s sentences embedded (%d%%), %.0f sentences/s%s",
            stage,
            f"{done:,d}",
            f"{total:,d}",
            100 * done // max(total, 1),
            rate,
            eta,
        )

    return report
