"""`cse run DEPLOYMENT [-p key=value ...]`: run a deployment through the worker, wait for it, and say in the terminal
what happened: each stage's cache hit or fresh write, and for a run that did not complete, the one-line reason of
the task that failed (its exception, read from the Prefect API), not only "finished in state Failed".

The parameters are those of `prefect deployment run`: `-p key=value`, where a value that parses as JSON is taken as
JSON (`-p 'config={"mask_ratio": 0.15}'`, `-p n=3`) and any other as a string.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

from cse.config.limits import MAX_DEPTH, ParameterRefused, check_parameter, cut
from cse.config.methods import DEFAULT_METHOD
from cse.ops.follow import REUSED_RUN, STAGE_LINE, Follower, Printer, flow_run_tree, reused_runs, summary
from cse.storage.secrets import redact

# Prefect's prefixes of a failed state's message: the reason is what follows them
_PREFIXES = ("Task run encountered an exception", "Flow run encountered an exception")
REASON_CHARS = 400
# A preflight failure (tasks/preflight.py) lists every missing thing with its fix: printed whole, never cut
UNCUT_REASONS = ("PreflightError: ",)
# How long the logs must stay unchanged before a finished run's stage lines are taken as complete; None: one batch
# interval of Prefect's log shipping (PREFECT_LOGGING_TO_API_BATCH_INTERVAL) + 0.5 s
LOG_QUIET_S: float | None = None
LATE_HINT_AFTER_S = 60.0
SECOND_INTERRUPT_S = 10.0  # after a Ctrl-C, a second one within this many seconds cancels the flow run
CANCEL_WAIT_S = 30.0  # how long `cse cancel` (and a second Ctrl-C) waits for the run to end cancelled


def parse_params(items: list[str] | None) -> dict[str, Any]:
    r"""`key=value` strings → parameters; a value that parses as JSON is JSON, any other a string, except a value that
    opens a JSON object or list (`{`, `[`) and does not parse: that is refused, naming the column.

    Args:
        items: the `-p` arguments, e.g. `["config={\"mask_ratio\": 0.15}", "n=3"]`.

    Raises:
        ValueError: an item without `=` or with an empty key (named); malformed JSON (its parameter, the error and the
            column, with the text around it).
        ParameterRefused: a value nested too deep or too long (`cse.config.limits`), named.
    """
    params: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"parameter {cut(item)!r} is not key=value (e.g. -p n=3 or -p 'config={{\"mask_ratio\": 0.15}}')"
            )
        key = key.strip()
        check_parameter(key, None, chars=len(value))  # refused before it is parsed: 10 MB is not settings
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            if value.lstrip().startswith(("{", "[")):
                near = cut(value[max(0, e.pos - 20) : e.pos + 1])
                raise ValueError(
                    f"parameter {key!r}: malformed JSON, {e.msg} at column {e.colno} of its value "
                    f"(…{near}⟵ here); the whole -p argument goes in single quotes, e.g. "
                    f"-p '{key}={{\"learning_rate\": 0.0001}}'"
                ) from None
            parsed = value
        except RecursionError:  # deeper than Python's JSON parser goes
            raise ParameterRefused(f"parameter {key!r} is nested deeper than {MAX_DEPTH} levels") from None
        params[key] = check_parameter(key, parsed, chars=len(value))
    return params


def one_line_reason(message: str | None) -> str:
    """A failed state's message as one line: Prefect's prefix dropped, whitespace collapsed, credentials masked,
    cut at `REASON_CHARS` (a preflight failure, `UNCUT_REASONS`, is never cut)."""
    text = " ".join((message or "").split())
    for prefix in _PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix) :].lstrip(" .:")
            break
    text = redact(text) or "(no message)"
    return text if len(text) <= REASON_CHARS or text.startswith(UNCUT_REASONS) else text[: REASON_CHARS - 1] + "…"


@dataclass
class Failure:
    """Where a flow run failed: the path of flow runs (`flow/run-name`) down to the failing one, the task (None: the
    flow's own code) and the one-line reason."""

    flows: list[str]
    task: str | None
    reason: str

    def __str__(self) -> str:
        where = " > ".join(self.flows) + (f" > task {self.task}" if self.task else "")
        return f"{where}: {self.reason}"


@dataclass
class RunOutcome:
    """A finished flow run: its final state, the stage lines of its logs, and (when it did not complete) why."""

    flow_run_id: UUID
    name: str
    state: str
    completed: bool
    stage_lines: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def state_name(run) -> str:
    """The name of a flow run's state ("unknown" while it has none)."""
    return (run.state.name if run.state else None) or "unknown"


def _failed(state) -> bool:
    return state is not None and state.type.value in ("FAILED", "CRASHED", "CANCELLED")


def _when(run) -> Any:
    return run.end_time or run.start_time or run.expected_start_time or run.created


async def failures_of(client, flow_run_id: UUID, _path: list[str] | None = None) -> list[Failure]:
    """Why flow run `flow_run_id` failed, deepest cause first: its failed task runs (by their state's message, the
    task's exception), recursing into failed child flow runs (subflows, and the deployments an experiment runs) in
    place of the task run that stands for them; the flow's own message when no task failed (an exception in the
    flow's body, a crash, a cancellation).

    Args:
        client: an open `prefect.client.orchestration.PrefectClient`.
        flow_run_id: the flow run.
    """
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import TaskRunSort

    run = await client.read_flow_run(flow_run_id)
    path = [*(_path or []), f"{(await client.read_flow(run.flow_id)).name}/{run.name}"]
    children = await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
    )
    stands_for_child = {c.parent_task_run_id for c in children}
    found: list[Failure] = []
    for child in sorted((c for c in children if _failed(c.state)), key=_when):
        found += await failures_of(client, child.id, path)
    tasks = await client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), sort=TaskRunSort.EXPECTED_START_TIME_ASC
    )
    for t in sorted((t for t in tasks if _failed(t.state) and t.id not in stands_for_child), key=_when):
        found.append(Failure(path, t.name, one_line_reason(t.state.message)))
    if not found and _failed(run.state):
        found.append(Failure(path, None, one_line_reason(run.state.message)))
    return found


async def stage_lines(client, flow_run_id: UUID) -> list[str]:
    """The log lines of the flow run and its child flow runs that say whether a stage reused its result (cache hit,
    an already finished job) or wrote it, oldest first: those the stage tasks log, else those the flows print."""
    return (await stage_and_warning_lines(client, flow_run_id))[0]


async def stage_and_warning_lines(client, flow_run_id: UUID) -> tuple[list[str], list[str]]:
    """`stage_lines`, and the first line of each warning (level WARNING and above) logged, once each."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    ids, _ = await flow_run_tree(client, flow_run_id)
    # a run's processes send their logs in batches (every PREFECT_LOGGING_TO_API_BATCH_INTERVAL seconds): its last
    # lines may reach the server after its final state; read until nothing new came for one interval (+0.5 s)
    from prefect.settings import PREFECT_LOGGING_TO_API_BATCH_INTERVAL

    quiet_s = (
        LOG_QUIET_S
        if LOG_QUIET_S is not None
        else min(max(float(PREFECT_LOGGING_TO_API_BATCH_INTERVAL.value()) + 0.5, 1.0), 5.0)
    )
    logs, previous = [], -1
    for _ in range(4):
        logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)), sort=LogSort.TIMESTAMP_ASC)
        if len(logs) == previous:
            break
        previous = len(logs)
        await asyncio.sleep(quiet_s)
    found = [
        (log.task_run_id is not None, (log.message.strip().splitlines() or [""])[0]) for log in logs if log.level == 20
    ]  # INFO: no tracebacks
    found = [(in_task, line) for in_task, line in found if STAGE_LINE.search(line)]
    if any(in_task for in_task, _ in found):  # the stage tasks' own lines; the flows print a summary of the same
        # (and a finished job's line: the training flow returns it itself, outside any task)
        found = [(in_task, line) for in_task, line in found if in_task or REUSED_RUN.search(line)]
    warned = [
        redact(" ".join((log.message.strip().splitlines() or [""])[0].split())) for log in logs if log.level >= 30
    ]
    return [redact(" ".join(line.split())) for _, line in found], list(dict.fromkeys(warned))


async def outcome_of(flow_run_id: UUID, with_stage_lines: bool = True) -> RunOutcome:
    """What a finished flow run did: its state, its stage lines and warnings (read once its last logs arrived; unless
    `with_stage_lines` is False) and, unless it completed, its failures."""
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        run = await client.read_flow_run(flow_run_id)
        completed = run.state is not None and run.state.is_completed()
        lines, warnings = await stage_and_warning_lines(client, flow_run_id) if with_stage_lines else ([], [])
        return RunOutcome(
            flow_run_id,
            run.name,
            state_name(run),
            completed,
            stage_lines=lines,
            failures=[] if completed else await failures_of(client, flow_run_id),
            warnings=warnings,
        )


_FIELD = re.compile(r"Validation failed for field '([^']+)'")


def schema_keys(schema: dict[str, Any], field_path: str) -> list[str]:
    """The keys a parameter's JSON schema (a deployment's `parameter_openapi_schema`) knows at `field_path`
    (`config`, `ingest_config.wiki`); [] where the schema has no object there."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in node or ("properties" not in node and any(k in node for k in ("allOf", "anyOf"))):
            if "$ref" in node:
                node = defs.get(node["$ref"].rsplit("/", 1)[-1], {})
            else:
                options = [resolve(o) for k in ("allOf", "anyOf") for o in node.get(k, [])]
                node = next((o for o in options if "properties" in o), {})
        return node

    node = schema
    for name in field_path.split("."):
        node = resolve(node.get("properties", {}).get(name, {}))
    return list(node.get("properties", {}))


async def refused_parameters(deployment: str, detail: str) -> str:
    """One line for parameters the server refused: its reason and, for unknown keys, the keys that field knows."""
    from prefect.client.orchestration import get_client

    line = f"deployment {deployment!r} refused the parameters: {detail.removeprefix('Error creating flow run: ')}"
    if "Additional properties" in detail and (m := _FIELD.search(detail)):
        async with get_client() as client:
            schema = (await client.read_deployment_by_name(deployment)).parameter_openapi_schema or {}
        if known := schema_keys(schema, m.group(1)):
            line += f"; known keys of {m.group(1)}: {', '.join(known)}"
    return line


class ServicesDown(RuntimeError):
    """The Prefect server did not answer: names the URL tried and how to start the services."""


def services_down(e: BaseException) -> ServicesDown:
    """The error to show when the Prefect API at the configured URL cannot be reached."""
    from prefect.settings import PREFECT_API_URL

    url = redact(PREFECT_API_URL.value() or "(no PREFECT_API_URL: Prefect would start a temporary server)")
    return ServicesDown(
        f"no Prefect server answers at {url} ({type(e).__name__}: {' '.join(str(e).split()) or 'no answer'}): "
        "start the services with `bash scripts/services.sh up` (or `make main`) from the checkout, or point "
        "PREFECT_API_URL at your team's server"
    )


class ServerWentAway(RuntimeError):
    """The Prefect server stopped answering while `cse run` followed a flow run: names the server and the run, says
    that the run may go on and how to look at it later."""


def server_went_away(e: BaseException, run_name: str, run_id: UUID, link: str | None) -> ServerWentAway | None:
    """The error to show when the Prefect server `cse run` follows goes away (the connection refused, reset or timed
    out: `httpx.TransportError`, an `OSError` about a connection); None for any other error.

    Args:
        e: the error of a call to the server.
        run_name, run_id: the flow run followed.
        link: its page in the Prefect UI, if known.
    """
    import httpx
    from prefect.settings import PREFECT_API_URL

    if not (isinstance(e, httpx.TransportError) or _unreachable(e)):
        return None
    url = redact(PREFECT_API_URL.value() or "(no PREFECT_API_URL)")
    page = f", its page {link}" if link else ""
    return ServerWentAway(
        f"the Prefect server at {url} went away while following flow run {run_name} ({run_id}) "
        f"({type(e).__name__}: {' '.join(str(e).split()) or 'no answer'}): the run itself may still go on (its worker "
        f"runs it and reports to the server once it is back); start the server again (`bash scripts/services.sh up`) "
        f"and look at the run later: `prefect flow-run inspect {run_id}`, `prefect flow-run logs {run_id}`{page}"
    )


def require_api_url() -> str:
    """The configured Prefect API URL; without one, `ServicesDown` (Prefect would start a temporary server of its own,
    which knows no deployment)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ServicesDown(
            "no Prefect server is configured (PREFECT_API_URL is unset and the Prefect profile `cse` is not active): "
            "start the services with `bash scripts/services.sh up` (or `make main`) from the checkout, which also "
            "writes the profile, or point PREFECT_API_URL at your team's server"
        )
    return url


def _unreachable(e: BaseException) -> bool:
    import httpx

    return isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout, ConnectionRefusedError)) or (
        isinstance(e, OSError) and "connection" in str(e).lower()
    )


async def deployment_names(client) -> list[str]:
    """Every deployment on the server as `flow/deployment`, sorted."""
    flows = {f.id: f.name for f in await client.read_flows()}
    return sorted(f"{flows.get(d.flow_id, '?')}/{d.name}" for d in await client.read_deployments())


async def list_deployments() -> list[tuple[str, str]]:
    """`cse deployments`: (flow/deployment, first sentence of its description) of every deployment on the server.

    Raises:
        ServicesDown: no server answers.
    """
    from prefect.client.orchestration import get_client

    require_api_url()
    try:
        async with get_client() as client:
            flows = {f.id: f.name for f in await client.read_flows()}
            found = await client.read_deployments()
    except Exception as e:  # an unreachable server is said with its URL and the fix
        if _unreachable(e):
            raise services_down(e) from None
        raise
    rows = [(f"{flows.get(d.flow_id, '?')}/{d.name}", (d.description or "").split(". ")[0].strip()) for d in found]
    return sorted(rows)


def training_spec(flow_name: str, parameters: dict[str, Any]):
    """The registry method a flow's `preset` and `overrides` belong to: its `method` parameter, else the method the flow
    name ends with (`train-<method>`, `ablate-<method>`); None for a flow of no method."""
    from cse.config.methods import REGISTRY

    if isinstance(parameters.get("method"), str) and parameters["method"] in REGISTRY:
        return REGISTRY[parameters["method"]]
    return next((spec for name, spec in REGISTRY.items() if flow_name.endswith(f"-{name}")), None)


def check_training_parameters(flow_name: str, deployment_params: dict[str, Any], given: dict[str, Any]) -> None:
    """Before a flow run is created: the `preset` and `overrides` a run of a training or experiment flow would train
    with (the run's merged over the deployment's, as the flow merges them: flows/deployment_params.py) resolve to a
    valid `TrainConfig`, else a ValueError naming every refused key with the closest known one and the full list.

    Args:
        flow_name: the deployment's flow (`train-<method>`, `seeds`, `sweep`, `ablate-<method>`, ...).
        deployment_params: the deployment's own parameters.
        given: the run's parameters (`-p`).
    """
    from pydantic import ValidationError

    from cse.config.presets import deep_merge
    from cse.config.training import resolve_train_config

    merged = {**deployment_params, **given}
    if "overrides" not in merged and "preset" not in merged and not flow_name.startswith("train-"):
        return
    spec = training_spec(flow_name, merged)
    if spec is None:
        return
    overrides = given.get("overrides", deployment_params.get("overrides"))
    if isinstance(given.get("overrides"), dict) and isinstance(deployment_params.get("overrides"), dict):
        overrides = deep_merge(dict(deployment_params["overrides"]), dict(given["overrides"]))
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"parameter 'overrides' must be a JSON object of TrainConfig fields, got {overrides!r}")
    try:
        resolve_train_config(merged.get("preset", "default"), overrides, method=spec.name)
    except ValidationError as e:
        errors = "; ".join(
            ((".".join(map(str, err["loc"])) + ": ") if err["loc"] else "") + err["msg"].removeprefix("Value error, ")
            for err in e.errors()
        )
        raise ValueError(f"refused before any flow run was created: {errors}") from None
    except ValueError as e:
        raise ValueError(f"refused before any flow run was created: {e}") from None


async def start(deployment: str, parameters: dict[str, Any]):
    """Create a flow run of `deployment` (`flow-name/deployment-name`) with `parameters`; returns the flow run. The
    training parameters (`preset`, `overrides`) are checked first (`check_training_parameters`): a mistake creates
    no flow run.

    Raises:
        LookupError: the deployment is not on the server (names the API URL, the closest deployment names and how to
            register them).
        ValueError: the parameters were refused (their reason, and for an unknown key the known ones).
        ServicesDown: no Prefect server answers.
    """
    from prefect.client.orchestration import get_client
    from prefect.deployments import arun_deployment
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_URL

    from cse.config.suggest import closest

    if "/" not in deployment:
        raise ValueError(f"deployment {deployment!r} is not FLOW/DEPLOYMENT (e.g. train-{DEFAULT_METHOD}/smoke)")
    require_api_url()
    try:
        async with get_client() as client:
            try:
                found = await client.read_deployment_by_name(deployment)
            except ObjectNotFound:
                names = await deployment_names(client)
                hint = closest(deployment, names)
                raise LookupError(
                    f"deployment {deployment!r} not found on the Prefect server at {redact(PREFECT_API_URL.value())}"
                    + (f" (did you mean {hint!r}?)" if hint else "")
                    + "; `cse deployments` lists them (`make main` or `scripts/services.sh up` registers them)"
                ) from None
            flow = await client.read_flow(found.flow_id)
        check_training_parameters(flow.name, dict(found.parameters or {}), parameters)
        return await arun_deployment(deployment, parameters=parameters, timeout=0)
    except PrefectHTTPStatusError as e:  # 409: the parameters fail the deployment's schema (no flow run was made)
        if e.response.status_code != 409:
            raise
        raise ValueError(await refused_parameters(deployment, e.response.json().get("detail", str(e)))) from None
    except Exception as e:  # whatever the client raises: an unreachable server is said with its URL, the rest re-raised
        if _unreachable(e):
            raise services_down(e) from None
        raise


async def wait(
    flow_run_id: UUID,
    on_state: Callable[[str], None],
    poll_s: float = 2.0,
    timeout_s: float | None = None,
    on_poll: Callable[[Any, bool], Awaitable[None]] | None = None,
) -> None:
    """Poll the flow run until its state is final, calling `on_state(line)` at each change of state (and once with a
    hint when no worker has picked it up after a minute) and `on_poll(client, final)` after each poll (`final` on the
    last, once the state is final).

    Raises:
        TimeoutError: not final after `timeout_s` seconds (the run goes on).
    """
    from prefect.client.orchestration import get_client

    began, last, hinted = time.monotonic(), None, False
    async with get_client() as client:
        while True:
            run = await client.read_flow_run(flow_run_id)
            name = state_name(run)
            final = run.state is not None and run.state.is_final()
            if on_poll is not None:
                await on_poll(client, final)
            if name != last:
                on_state(name)
                last = name
            if final:
                return
            waited = time.monotonic() - began
            if not hinted and run.state is not None and run.state.is_scheduled() and waited > LATE_HINT_AFTER_S:
                on_state(f"{name}: {await why_waiting(client, run, waited)}")
                hinted = True
            if timeout_s is not None and waited > timeout_s:
                raise TimeoutError(
                    f"flow run {run.name} ({flow_run_id}) not finished after {timeout_s:.0f} s: it goes on"
                )
            await asyncio.sleep(poll_s)


async def why_waiting(client, run, waited: float) -> str:
    """Why flow run `run` is still scheduled after `waited` seconds: no worker of its work pool is online (how to
    start one), or the pool's workers are busy with runs of their own (how many run, how many wait ahead of it)."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType

    pool = run.work_pool_name
    workers = await client.read_workers_for_work_pool(pool) if pool else []
    online = [w for w in workers if str(getattr(w.status, "value", w.status)).upper() == "ONLINE"]
    if not online:
        return (
            f"no worker has taken it after {waited:.0f} s: no worker of pool {pool or '?'} is online "
            "(`scripts/services.sh status`; `scripts/services.sh worker` starts it)"
        )

    def of_pool(*types: StateType) -> FlowRunFilter:
        return FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(types))))

    pools = WorkPoolFilter(name=WorkPoolFilterName(any_=[pool]))
    busy = await client.read_flow_runs(
        flow_run_filter=of_pool(StateType.RUNNING, StateType.PENDING), work_pool_filter=pools
    )
    queued = await client.read_flow_runs(flow_run_filter=of_pool(StateType.SCHEDULED), work_pool_filter=pools)
    mine = run.expected_start_time or run.created
    ahead = [r for r in queued if r.id != run.id and (r.expected_start_time or r.created) <= mine]
    names = ", ".join(w.name for w in online)
    return (
        f"waiting {waited:.0f} s: the worker of pool {pool} is busy ({names} online, {len(busy)} flow run(s) running); "
        f"{len(ahead)} run(s) ahead of this one; it starts when a slot frees (CSE_WORKER_LIMIT sets the worker's slots)"
    )


def _stdout(line: str) -> None:
    print(line, flush=True)  # in order with the stderr lines, even through a pipe or a log file


@dataclass
class Terminal:
    """Where `cse run` writes: `out` and `err` take whole lines, `printer` the live lines and bar; `quiet` as
    `cse run --quiet`."""

    out: Callable[[str], None]
    err: Callable[[str], None]
    printer: Printer
    quiet: bool = False
    json: bool = False


def flow_run_link(run_id: UUID) -> str | None:
    """The flow run's page in the Prefect UI (None when no UI address is configured)."""
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    return f"{ui.rstrip('/')}/runs/flow-run/{run_id}" if ui else None


def progress_poller(follower: Follower, printer: Printer) -> Callable[[Any, bool], Awaitable[None]]:
    """The `on_poll` of `wait`: the follower's lines at each poll; an error of following is said once and the run
    goes on (following is a courtesy)."""
    warned: list[str] = []

    async def follow(client, final: bool) -> None:
        try:
            await follower.poll(client, final)
        except Exception as e:  # noqa: BLE001 - following is a courtesy: the run goes on, said once
            if not warned:
                warned.append(str(e))
                printer.line(f"    (not following the progress: {type(e).__name__}: {redact(str(e))[:200]})")

    return follow


def report_outcome(
    deployment: str,
    run_id: UUID,
    result: RunOutcome,
    follower: Follower,
    link: str | None,
    began: float,
    term: Terminal,
) -> int:
    """Print how the run ended: its stage lines (quiet), then completed in how long, or the reason of each failing
    task and where the full log is; then the summary of the run: with its tables, or (quiet) each MLflow run's id,
    page and job folder; the warnings the stages logged. `--json`: one JSON object on stdout instead (`json_record`).
    Returns the exit status (0: completed)."""
    seconds = time.monotonic() - began
    reused = reused_runs(result.stage_lines + follower.stage_texts)
    warnings = list(dict.fromkeys(follower.warnings + result.warnings))
    if term.json:
        from cse.tracking.progress import runs_by_id, runs_of_flow_runs, summary_record, summary_runs

        views = summary_runs(runs_of_flow_runs([str(i) for i in follower.flow_runs or [run_id]]))
        views += [v for v in runs_by_id(reused) if v.run_id not in {m.run_id for m in views}]
        term.out(
            json.dumps(
                json_record(deployment, run_id, result, link, seconds, [summary_record(v) for v in views], warnings)
            )
        )
        for failure in result.failures:
            term.err(f"    reason: {failure}")
        return 0 if result.completed else 1
    if term.quiet:
        for line in result.stage_lines:
            term.out(f"    stage: {line}")
    if result.completed:
        term.out(f"==> {deployment}: {result.state} in {seconds:.0f} s")
    else:
        term.err(f"==> {deployment}: flow run {result.name} ended {result.state}")
        for failure in result.failures or [Failure([result.name], None, "(no reason recorded)")]:
            term.err(f"    reason: {failure}")
        term.err(f"    full log: prefect flow-run logs {run_id}")
    summary(  # (--quiet: the first line named the page; each MLflow run's id, page and job folder, no table)
        follower.flow_runs or [run_id],
        term.printer,
        None if term.quiet else link,
        reused=reused,
        table=not term.quiet,
        warnings=warnings,
    )
    return 0 if result.completed else 1


def json_record(
    deployment: str,
    run_id: UUID,
    result: RunOutcome,
    link: str | None,
    seconds: float,
    runs: list[dict[str, Any]],
    warnings: list[str],
) -> dict[str, Any]:
    """What `cse run --json` prints when the run ended: the deployment, the flow run (id, name, state, whether it
    completed, seconds, page), each MLflow run shown in the summary (`cse.tracking.progress.summary_record`), the
    failures' reasons and the warnings the stages logged."""
    return {
        "deployment": deployment,
        "flow_run_id": str(run_id),
        "flow_run_name": result.name,
        "state": result.state,
        "completed": result.completed,
        "seconds": round(seconds, 1),
        "prefect_url": link,
        "runs": runs,
        "failures": [str(f) for f in result.failures],
        "warnings": warnings,
    }


async def follow_deployment(
    deployment: str,
    parameters: dict[str, Any],
    timeout_s: float | None,
    poll_s: float,
    term: Terminal,
    started: dict[str, Any] | None = None,
) -> int:
    """Start `deployment` with `parameters`, follow it until it ends (or `timeout_s`), report how it ended. `started`
    is given the flow run (`run`) and its page (`link`) as soon as it exists (what a Ctrl-C names)."""
    run = await start(deployment, parameters)
    link = flow_run_link(run.id)
    if started is not None:
        started.update(run=run, link=link)
    head = f"==> {deployment}: flow run {run.name} ({run.id})" + (f"  {link}" if link else "")
    (term.err if term.json else term.out)(head)
    began = time.monotonic()
    follower = Follower(run.id, term.printer, began=began)

    def state(line: str) -> None:
        term.printer.line(f"    {time.monotonic() - began:6.0f} s  {line}")

    on_poll = None if term.quiet or term.json else progress_poller(follower, term.printer)
    try:
        await wait(run.id, state, poll_s, timeout_s, on_poll=on_poll)
        term.printer.close()
        result = await outcome_of(run.id)
    except Exception as e:  # the server gone: said with the run (it may go on); anything else re-raised
        term.printer.close()
        if (gone := server_went_away(e, run.name, run.id, link)) is None:
            raise
        raise gone from None
    return report_outcome(deployment, run.id, result, follower, link, began, term)


def _masked(write: Callable[[str], None]) -> Callable[[str], None]:
    """`write` of every line with its credentials masked (`redact`)."""

    def masked(line: str) -> None:
        write(redact(line))

    return masked


def run_deployment_cli(
    deployment: str,
    params: list[str] | None,
    timeout_s: float | None = None,
    poll_s: float = 2.0,
    out: Callable[[str], None] = _stdout,
    err: Callable[[str], None] | None = None,
    quiet: bool = False,
    tty: bool | None = None,
    as_json: bool = False,
    ask: bool | None = None,
) -> int:
    """`cse run`: start `deployment` and follow it (cse.ops.follow: a line per stage as it ends, the stages' cache hits
    and writes as they come, the evaluations' and the training steps' progress; at the end the result's table, the
    MLflow run id, the job folder and the Prefect and MLflow pages, a cache-hit rerun's as a fresh run's); on failure
    the reason of each failing task. `quiet`: only the changes of state, then the stage lines, the reasons and each
    MLflow run's id, page and job folder (for scripts); `as_json`: the lines on stderr, then one JSON object on stdout
    (`json_record`). Returns 0 when the run completed, else 1; 130 after Ctrl-C (`interrupted`: the run goes on unless
    cancelled). Every line passes the masking rule (`redact`): the flow run's Prefect page is built on
    `PREFECT_UI_URL`, which Prefect derives from `PREFECT_API_URL` with its user-info, and the MLflow pages on the
    tracking server's URL.

    Args:
        deployment: `flow-name/deployment-name`.
        params: `key=value` strings (`parse_params`).
        timeout_s: give up waiting after this many seconds (exit 1; the run goes on).
        poll_s: seconds between state checks.
        out, err: where lines go (stdout, stderr).
        quiet: print what `cse run --quiet` prints.
        tty: whether stdout is a terminal (the bar is redrawn in place); None: ask stdout.
        as_json: print what `cse run --json` prints.
        ask: after Ctrl-C, ask whether to cancel (a terminal is attached); None: ask stdin.
    """
    import sys

    err = err or (lambda line: print(line, file=sys.stderr, flush=True))
    out, err = _masked(out), _masked(err)
    if timeout_s is not None and not 0 < timeout_s < float("inf"):  # checked before a flow run is created
        raise ValueError(f"timeout {timeout_s!r}: a finite number of seconds > 0, or None to wait until the run ends")
    parameters = parse_params(params)
    term = Terminal(
        out,
        err,
        Printer(err if as_json else out, (sys.stdout.isatty() if tty is None else tty) and not as_json),
        quiet,
        as_json,
    )
    started: dict[str, Any] = {}
    # Ctrl-C is counted (`_SIGINTS`) as well as raised: a KeyboardInterrupt raised while a finaliser (`__del__`) runs
    # is printed and dropped by Python, and so is a task cancellation that a library swallows (asyncio.run's own
    # handler only cancels the main task). Seen under load: `cse run` followed the run on to its end and exited 0.
    # `_interruptible` raises it again from the loop when it was counted but lost.
    _SIGINTS.clear()
    previous = signal.signal(signal.SIGINT, _raise_interrupt) if _main_thread() else None
    try:
        return asyncio.run(_interruptible(follow_deployment(deployment, parameters, timeout_s, poll_s, term, started)))
    except KeyboardInterrupt:
        term.printer.close()
        if "run" not in started:
            err("==> interrupted before a flow run was created: nothing runs")
            return 130
        return interrupted(started["run"], started["link"], err, sys.stdin.isatty() if ask is None else ask)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


_SIGINTS: list[float] = []  # when each Ctrl-C of this `cse run` came (time.monotonic)


def _raise_interrupt(signum: int, frame: Any) -> None:
    _SIGINTS.append(time.monotonic())
    raise KeyboardInterrupt


async def _interruptible(work: Awaitable[int], check_s: float = 0.2) -> int:
    """`work`'s result; KeyboardInterrupt as soon as a Ctrl-C has been counted, even where its own was dropped."""
    task = asyncio.ensure_future(work)
    while not task.done():
        if _SIGINTS:
            task.cancel()
            raise KeyboardInterrupt
        await asyncio.wait({task}, timeout=check_s)
    return task.result()


def _main_thread() -> bool:
    """Whether this is the main thread (the only one that may set a signal handler)."""
    import threading

    return threading.current_thread() is threading.main_thread()


def interrupted(run, link: str | None, err: Callable[[str], None], ask: bool) -> int:
    """After Ctrl-C in `cse run`: say that the flow run goes on on the server (its state, id, page, how to cancel it
    and follow it), then offer to cancel it: a prompt when a terminal is attached (`ask`), else a second Ctrl-C within
    `SECOND_INTERRUPT_S` seconds. Returns 130 (the exit status of an interrupted command)."""
    try:
        state = asyncio.run(_state_of(run.id))
    except Exception as e:  # noqa: BLE001 - the server may be gone too: said, the rest still printed
        state = f"unknown: {type(e).__name__}"
    err(
        f"==> interrupted: flow run {run.name} ({run.id}) goes on on the server (state {state}); `cse run` only stopped following it"
    )
    if link:
        err(f"    its page: {link}")
    err(f"    cancel it: cse cancel {run.id}    its log: prefect flow-run logs {run.id}")
    cancel = False
    try:
        if ask:
            cancel = input("    Cancel it now? [y/N] ").strip().lower() in ("y", "yes")
        else:
            err(f"    Ctrl-C again within {SECOND_INTERRUPT_S:.0f} s cancels it")
            seen, until = len(_SIGINTS), time.monotonic() + SECOND_INTERRUPT_S
            while time.monotonic() < until and len(_SIGINTS) == seen:  # (counted even where its raise was dropped)
                time.sleep(0.1)
            cancel = len(_SIGINTS) > seen
    except KeyboardInterrupt:
        cancel = True
    except EOFError:
        cancel = False
    if cancel:
        try:
            cancel_cli(str(run.id), err)
        except KeyboardInterrupt:
            err(f"    not waiting for it to end: `prefect flow-run inspect {run.id}` says its state")
        except Exception as e:  # noqa: BLE001 - one line, and how to do it by hand
            err(f"    not cancelled ({type(e).__name__}: {redact(str(e))[:200]}): `cse cancel {run.id}`")
    else:
        err(f"    not cancelled: flow run {run.id} goes on")
    return 130


async def _state_of(run_id: UUID) -> str:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return state_name(await client.read_flow_run(run_id))


async def find_flow_run(client, ref: str):
    """The flow run that `ref` names: its id, or its name (`adjective-animal`); `LookupError` when none does."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.exceptions import ObjectNotFound

    try:
        run_id = UUID(ref.strip())
    except ValueError:
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[ref.strip()])))
        if not runs:
            raise LookupError(f"no flow run named {cut(ref)!r} (an id or a name, as `cse run` printed it)") from None
        if len(runs) > 1:
            raise LookupError(f"{len(runs)} flow runs are named {cut(ref)!r}: give its id") from None
        return runs[0]
    try:
        return await client.read_flow_run(run_id)
    except ObjectNotFound:
        raise LookupError(f"no flow run {run_id} on the Prefect server") from None


async def cancel_flow_run(ref: str, wait_s: float = CANCEL_WAIT_S, say: Callable[[str], None] | None = None):
    """Cancel the flow run `ref` names (id or name): one not yet started (scheduled, or pending without a process)
    is set Cancelled at once; a running one Cancelling, which its worker turns into Cancelled once it has stopped
    the run's process (its job's MLflow run then ends KILLED, resumable). Waits up to `wait_s` seconds for a final
    state; returns the flow run as last read. A run already ended is returned as it is.

    Raises:
        LookupError: no flow run of that id or name.
        ServicesDown: no Prefect server answers.
    """
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Cancelling

    require_api_url()
    try:
        async with get_client() as client:
            run = await find_flow_run(client, ref)
            if run.state is not None and run.state.is_final():
                return run
            started = run.state is not None and (run.state.is_running() or run.state.is_cancelling())
            if not started and run.infrastructure_pid is None:
                await client.set_flow_run_state(run.id, Cancelled(message="cancelled by `cse cancel`"), force=True)
            else:
                await client.set_flow_run_state(run.id, Cancelling(message="cancelled by `cse cancel`"), force=True)
            if say is not None:
                say(f"    cancelling flow run {run.name} ({run.id}) ...")
            deadline = time.monotonic() + wait_s
            while True:
                run = await client.read_flow_run(run.id)
                if (run.state is not None and run.state.is_final()) or time.monotonic() > deadline:
                    return run
                await asyncio.sleep(1.0)
    except (LookupError, ServicesDown):
        raise
    except Exception as e:
        if _unreachable(e):
            raise services_down(e) from None
        raise


def cancel_cli(ref: str, out: Callable[[str], None], wait_s: float = CANCEL_WAIT_S) -> int:
    """`cse cancel RUN`: cancel the flow run and say its state: 0 when it ended cancelled (or had already ended: said
    so), 1 when it was still cancelling after `wait_s` seconds."""
    run = asyncio.run(cancel_flow_run(ref, wait_s, say=out))
    name = state_name(run)
    if run.state is not None and run.state.is_cancelled():
        out(f"==> flow run {run.name} ({run.id}): {name}")
        return 0
    if run.state is not None and run.state.is_final():
        out(f"==> flow run {run.name} ({run.id}) had already ended {name}: nothing to cancel")
        return 0
    out(
        f"==> flow run {run.name} ({run.id}): {name} after {wait_s:.0f} s (its worker stops it when it next polls; "
        f"`prefect flow-run inspect {run.id}` says its state)"
    )
    return 1


# prefect.yaml's training block: the generated entries run from the line after its comment (the first line starting
# with TRAINING_COMMENT, and its following comment lines) to the comment of the experiments (EXPERIMENTS_COMMENT).
TRAINING_COMMENT = "  # Training: one flow per method"
EXPERIMENTS_COMMENT = "  # Experiments over many training runs"


def generated_prefect_yaml(text: str) -> str:
    """prefect.yaml's text `text` with its training deployments replaced by those the registry generates (one per
    preset of every method, `cse.config.methods.training_deployments_yaml`); everything else kept byte for byte.

    Args:
        text: the file's current text.

    Raises:
        ValueError: the file lacks the training block's comment or the experiments' comment after it (named).
    """
    from cse.config.methods import training_deployments_yaml

    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith(TRAINING_COMMENT)]
    ends = [i for i, line in enumerate(lines) if line.startswith(EXPERIMENTS_COMMENT)]
    if not starts or not ends or ends[0] < starts[0]:
        raise ValueError(
            f"prefect.yaml: the training deployments are generated between a line starting {TRAINING_COMMENT.strip()!r}"
            f" and one starting {EXPERIMENTS_COMMENT.strip()!r} after it; put both back"
        )
    first = starts[0]
    while first < len(lines) and lines[first].lstrip().startswith("#"):
        first += 1  # the training comment stays as written
    return "".join(lines[:first]) + training_deployments_yaml() + "".join(lines[ends[0] :])


def write_prefect_yaml(path: Path, check: bool = False) -> bool:
    """Generate prefect.yaml's training deployments from the registry into `path` (`cse prefect-yaml`).

    Args:
        path: the prefect.yaml to rewrite.
        check: only compare: write nothing.

    Returns:
        Whether the file already was what the registry generates.
    """
    from cse.storage.atomic import atomic_file

    text = path.read_text()
    generated = generated_prefect_yaml(text)
    if generated != text and not check:
        with atomic_file(path) as tmp:
            tmp.write_text(generated)
    return generated == text
