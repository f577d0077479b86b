"""How this process takes signals it would otherwise die of without any cleanup: `hangup_as_termination`.

SIGHUP (a closed terminal, `kill -HUP`) ends a Python process at once by default: no handler runs, no `finally`. The
worker died silently and its flow runs crashed with their MLflow runs FAILED; a training job's own process died with its
run left RUNNING. Handled as SIGTERM instead: Prefect's handler then acts (a worker shuts down, a flow run raises
`TerminationSignal` and its job's MLflow run ends KILLED). Imports nothing from the project, so every layer may call it.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

_FORWARDING = False  # whether this process's SIGHUP is already forwarded as SIGTERM


def _hangup(signum: int, frame: FrameType | None) -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # whatever SIGTERM does now (Prefect's handler, or the default end)


def hangup_as_termination() -> bool:
    """Handle SIGHUP as SIGTERM in this process from now on: the handler sends the process SIGTERM, so whichever
    SIGTERM handler is in place then (Prefect's worker or flow engine, or the default) acts. Only the main thread can
    set a handler; elsewhere (and on a platform without SIGHUP) nothing is done. A SIGHUP that is ignored (`nohup`)
    stays ignored. Returns whether SIGHUP is now forwarded."""
    global _FORWARDING
    if _FORWARDING:
        return True
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        return False
    signal.signal(signal.SIGHUP, _hangup)
    _FORWARDING = True
    return True
