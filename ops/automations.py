"""Server-side automations the services need: crashed-run detection for killed workers.

A worker killed with its flow runs (SIGKILL, a lost machine) cannot report anything: its flow runs would stay
RUNNING for ever. Flow runs started by a worker emit `prefect.flow-run.heartbeat` events every
`PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds; the automation `crash-zombie-flow-runs` marks a run CRASHED when,
after a heartbeat, neither another heartbeat nor a final state arrives within `miss_factor` heartbeat periods
(`CSE_MISSED_HEARTBEATS`, default 3, at least 2; Prefect's documented recipe for self-hosted servers). Running the deployment again then resumes the job from its
last checkpoint (tasks/train.py).

    python -m cse.ops.automations [--heartbeat-seconds 30]    # idempotent; the services' scripts create it through
                                                              # python -m cse.ops.prefect_setup --automation
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from cse.storage.settings import env_int

NAME = "crash-zombie-flow-runs"
DEFAULT_HEARTBEAT_SECONDS = 30  # Prefect's minimum
DEFAULT_MISSED_HEARTBEATS = 3


def heartbeat_seconds() -> int:
    """The heartbeat period workers are started with (`PREFECT_FLOWS_HEARTBEAT_FREQUENCY`, else 30 s)."""
    return env_int("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", minimum=30) or DEFAULT_HEARTBEAT_SECONDS


def missed_heartbeats() -> int:
    """How many heartbeat periods without one mark a run CRASHED (`CSE_MISSED_HEARTBEATS`, else 3; at least 2, so
    that one late heartbeat never crashes a live run)."""
    return env_int("CSE_MISSED_HEARTBEATS", minimum=2) or DEFAULT_MISSED_HEARTBEATS


def zombie_automation(heartbeat: int, miss_factor: int = DEFAULT_MISSED_HEARTBEATS):
    """The automation (not yet created): CRASHED after `miss_factor × heartbeat` seconds without a heartbeat."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return Automation(
        name=NAME,
        description=f"Mark a flow run CRASHED when it misses {miss_factor} heartbeats of {heartbeat} s (a killed worker).",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=miss_factor * heartbeat),
        ),
        actions=[
            ChangeFlowRunState(
                name=None,  # the state type's own name
                state=StateType.CRASHED,
                message=(
                    f"no heartbeat for {miss_factor * heartbeat} s: the worker or its machine died. "
                    "Run the deployment again to resume from the last checkpoint."
                ),
                force=False,
            )
        ],
    )


def ensure_zombie_automation(heartbeat: int | None = None) -> str:
    """Create the automation unless one of that name exists; returns its id."""
    from prefect.automations import Automation
    from prefect.exceptions import ObjectNotFound

    try:
        return str(Automation.read(name=NAME).id)  # type: ignore[attr-defined]  # sync here; typed only as async
    except (ObjectNotFound, ValueError):
        return str(zombie_automation(heartbeat or heartbeat_seconds(), missed_heartbeats()).create().id)


def main(argv: list[str] | None = None) -> None:
    """Ensure the Prefect automation that marks flow runs of lost workers as crashed exists, and print its id.

    Args:
        argv: the command-line arguments; `None` reads `sys.argv`.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--heartbeat-seconds",
        type=int,
        default=None,
        help="heartbeat period of the workers (default: $PREFECT_FLOWS_HEARTBEAT_FREQUENCY or 30)",
    )
    args = parser.parse_args(argv)
    print(f"automation {NAME}: {ensure_zombie_automation(args.heartbeat_seconds)}")


if __name__ == "__main__":
    main()
