"""What a Prefect server needs before the pipeline's workers use it, set up in one process, idempotently.

Work pools (process type), global concurrency limits (the `gpu` slot and each GPU worker's own) and the crashed-run
automation of `cse.ops.automations`. Each is created only when no object of that name exists; an existing one is kept
as it is (a limit's size included). One process instead of a `prefect` command per check and per creation: each of
those imports Prefect anew, about 2.5 s of CPU, and `scripts/team.sh up` made eight of them.

    python -m cse.ops.prefect_setup --pool local --pool gpu --limit gpu=1 [--limit gpu-w1=2] [--automation]

scripts/services.sh, scripts/team.sh and docker/prefect_setup.sh run it; a worker that starts meanwhile and creates
its pool itself is no error (the pool exists: kept).
"""

from __future__ import annotations

import argparse
import re

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _limit(text: str) -> tuple[str, int]:
    """`NAME=SLOTS` → (name, slots), for argparse."""
    name, sep, slots = text.partition("=")
    if not sep or not _NAME.match(name) or not slots.isdigit() or int(slots) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME=SLOTS with SLOTS ≥ 1, not {text!r}")
    return name, int(slots)


def _ensure(names, read, create) -> list[str]:
    """Call `create(name)` for each name `read(name)` does not find (Prefect's ObjectNotFound); returns the names
    created. One created meanwhile by another process (ObjectAlreadyExists) is kept as it is."""
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    created = []
    for name in names:
        try:
            read(name)
        except ObjectNotFound:
            try:
                create(name)
                created.append(name)
            except ObjectAlreadyExists:  # a worker created it meanwhile
                pass
    return created


def ensure_pools(client, names: list[str]) -> list[str]:
    """Create each process work pool of `names` that does not exist; returns the ones created.

    Args:
        client: a synchronous Prefect client (`prefect.get_client(sync_client=True)`).
        names: the pools' names (repeats are set up once).
    """
    from prefect.client.schemas.actions import WorkPoolCreate

    return _ensure(
        dict.fromkeys(names),
        client.read_work_pool,
        lambda name: client.create_work_pool(WorkPoolCreate(name=name, type="process")),
    )


def ensure_limits(client, limits: dict[str, int]) -> list[str]:
    """Create each global concurrency limit of `limits` (name → slots) that does not exist; returns the ones created.

    Args:
        client: a synchronous Prefect client.
        limits: name → number of slots; an existing limit keeps its own size.
    """
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    return _ensure(
        limits,
        client.read_global_concurrency_limit_by_name,
        lambda name: client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name=name, limit=limits[name])
        ),
    )


def main(argv: list[str] | None = None) -> None:
    """Set up the pools, limits and automation named on the command line, and say what was created.

    Args:
        argv: the command-line arguments; `None` reads `sys.argv`.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool", action="append", default=[], help="a process work pool (repeatable)")
    parser.add_argument(
        "--limit", action="append", type=_limit, default=[], help="a global concurrency limit NAME=SLOTS (repeatable)"
    )
    parser.add_argument("--automation", action="store_true", help="the crashed-run automation (cse.ops.automations)")
    args = parser.parse_args(argv)
    from prefect import get_client

    with get_client(sync_client=True) as client:
        pools = ensure_pools(client, args.pool)
        limits = ensure_limits(client, dict(args.limit))
    print(f"work pools {', '.join(dict.fromkeys(args.pool)) or '-'} (created: {', '.join(pools) or 'none'})")
    print(f"concurrency limits {', '.join(n for n, _ in args.limit) or '-'} (created: {', '.join(limits) or 'none'})")
    if args.automation:
        from cse.ops.automations import NAME, ensure_zombie_automation

        print(f"automation {NAME}: {ensure_zombie_automation()}")


if __name__ == "__main__":
    main()
