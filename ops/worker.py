"""`python -m cse.ops.worker start --pool POOL ...`: `prefect worker start` with SIGHUP handled as SIGTERM.

Prefect's worker handles SIGINT and SIGTERM (it stops taking flow runs and shuts down the ones it runs, which end their
jobs' MLflow runs KILLED), but not SIGHUP: a `kill -HUP` (or a closed terminal) ended it at once, silently, and its flow
runs crashed with their MLflow runs FAILED. This entry point sets SIGHUP to send the process SIGTERM
(`cse.storage.signals.hangup_as_termination`) and SIGINT to raise KeyboardInterrupt (a shell script's background job
starts with SIGINT ignored, and Prefect's SIGTERM handler stops the worker by sending it SIGINT: under
`scripts/services.sh` SIGTERM stopped nothing, and `down` had to kill the worker), then runs Prefect's command line with
`worker` and the arguments given, in this process. `scripts/services.sh` starts the worker through it.
"""

from __future__ import annotations

import signal
import sys

from cse.storage.signals import hangup_as_termination


def main(argv: list[str] | None = None) -> int:
    """Run `prefect worker <argv>` in this process with SIGHUP handled as SIGTERM; returns its exit status.

    Args:
        argv: the arguments after `worker` (`start --pool local --limit 2`); None reads `sys.argv[1:]`.
    """
    from prefect.cli import app

    # Prefect's worker shuts down by sending itself SIGINT (its SIGTERM handler does): a script's background job
    # (`setsid prefect worker start … &` in scripts/services.sh) starts with SIGINT ignored, so SIGTERM did nothing
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    hangup_as_termination()
    args = sys.argv[1:] if argv is None else list(argv)
    sys.argv = ["prefect", "worker", *args]  # (Prefect's entry point reads its arguments there)
    try:
        app()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
