"""Fan a set of training jobs out as children of one parent (ablate-d2cse, seeds, sweep).

The parent opens an MLflow run (in the method's experiment) and gives every child the tags
`mlflow.parentRunId` (MLflow nests the child under it), `cse.group` and `cse.child`. Results are read back
from MLflow by those tags, so children may run anywhere that logs to the same tracking server.

Dispatch:
- `deployment` (default for the deployments): each child is a run of the deployment `train-<method>/<name>`,
  submitted all at once, so the children spread over the work pool's workers; GPU jobs queue on the `gpu`
  global concurrency limit (tasks/train.py), never sharing a GPU. The parent waits for all of them.
- `inline`: each child runs as a subflow in this process, one after the other (tests, a single machine).

A child that already finished (same config and data) is not trained again: its job folder holds the result
(tasks/train.py `finished_result`), so rerunning a parent after a crash redoes only unfinished children. The
group id is a hash of the parent's flow and parameters, so the rerun finds the same MLflow parent run.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal, cast

from pydantic import BaseModel

from cse.config.methods import get_method
from cse.storage.hashing import stable_hash
from cse.tracking.group_runs import start_group_run
from cse.tracking.model_export import BEST_ALIAS, set_best_alias
from cse.tracking.provenance import prefect_flow_run_id
from cse.tracking.reporting import markdown_table, publish_artifacts, two_decimals
from cse.tracking.stage_runs import log_run_results
from cse.tracking.store import ensure_experiment, search_runs

Dispatch = Literal["deployment", "inline"]
_FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class Child(BaseModel):
    """One training job: a preset of `method` with overrides; `label` names it in tables."""

    label: str
    method: str
    preset: str
    overrides: dict[str, Any] = {}


class ChildResult(BaseModel):
    """The outcome of a child training run: final state, MLflow run id, best dev score, metrics and error."""

    label: str
    state: str  # COMPLETED | FAILED | CRASHED | CANCELLED
    run_id: str | None = None
    best_stsb_dev: float | None = None
    metrics: dict[str, float] = {}
    error: str | None = None


def member_tag(group_id: str) -> str:
    """The tag that makes a training run a member of a group, valued with its child label. A job can belong to
    several groups: one whose result is reused (the same job already finished for another experiment, e.g. an
    ablation cell that equals a seed) gets the tag of each group that asked for it (tasks/train.py)."""
    return f"cse.member.{group_id}"


class Group:
    """The parent MLflow run of a set of children (found again when the parent flow is rerun)."""

    def __init__(self, kind: str, method: str, params: dict[str, Any]):
        self.kind, self.method = kind, method
        self.id = stable_hash({"kind": kind, "method": method, "params": params})[:16]
        exp_id = ensure_experiment(method)
        found = search_runs([exp_id], {"cse.group": self.id, "cse.parent": "true"}, max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            tags = {"cse.group": self.id, "cse.parent": "true", "cse.kind": kind, "method": method}
            if (fr := prefect_flow_run_id()) is not None:
                tags["prefect_flow_run_id"] = str(fr)
            self.run_id = start_group_run(exp_id, f"{kind}-{method}-{self.id[:6]}", tags, params)

    def child_tags(self, child: Child) -> dict[str, str]:
        return {
            "mlflow.parentRunId": self.run_id,
            "cse.group": self.id,
            "cse.child": child.label,
            "cse.kind": self.kind,
            member_tag(self.id): child.label,
        }

    def log(
        self,
        metrics: dict[str, float] | None = None,
        artifacts: dict[str, str] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        """Log to the parent run through the client (no fluent active-run or active-experiment state involved)."""
        log_run_results(self.run_id, metrics=metrics, tags=tags, texts=artifacts)

    def read(self, child: Child, state: str, error: str | None = None) -> ChildResult:
        """The child's newest MLflow run with its metrics (`state` from the orchestrator)."""
        exp_id = ensure_experiment(child.method)
        runs = search_runs([exp_id], {member_tag(self.id): child.label}, newest_first=True, max_results=1)
        if not runs:
            return ChildResult(
                label=child.label,
                state=state if state != "COMPLETED" else "FAILED",
                error=error or "no MLflow run found for this child",
            )
        run = runs[0]
        metrics = dict(run.data.metrics)
        return ChildResult(
            label=child.label,
            state=state,
            run_id=run.info.run_id,
            best_stsb_dev=metrics.get("best_stsb_dev"),
            metrics=metrics,
            error=error,
        )


def run_children(
    group: Group,
    children: list[Child],
    dispatch: Dispatch = "deployment",
    deployment: str = "default",
    poll_seconds: float = 5.0,
) -> list[ChildResult]:
    """Run every child and return their results in order; a failed child is reported, not raised."""
    for c in children:  # fail before anything runs: an unknown method or preset, or a deployment the registry lacks
        get_method(c.method).preset(c.preset)
        get_method(c.method).deployment(deployment)
    labels = [c.label for c in children]
    if len(set(labels)) != len(labels):
        raise ValueError(f"child labels must be unique: {labels}")
    if dispatch == "inline":
        return [_run_inline(group, c) for c in children]
    if dispatch == "deployment":
        return _run_deployments(group, children, deployment, poll_seconds)
    raise ValueError(f"dispatch must be 'deployment' or 'inline', not {dispatch!r}")


def _run_inline(group: Group, child: Child) -> ChildResult:
    from cse.flows.train import TRAIN_FLOWS

    try:
        TRAIN_FLOWS[child.method](preset=child.preset, overrides=child.overrides, tags=group.child_tags(child))
    except Exception as exc:  # noqa: BLE001 - one failed child must not stop the others
        return group.read(child, "FAILED", error=f"{type(exc).__name__}: {exc}")
    return group.read(child, "COMPLETED")


def _parameters(group: Group, child: Child) -> dict[str, Any]:
    return {"preset": child.preset, "overrides": child.overrides, "tags": group.child_tags(child)}


def _run_deployments(group: Group, children: list[Child], deployment: str, poll_seconds: float) -> list[ChildResult]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment

    # the child's preset travels as a parameter; `deployment` names the one it runs through (registry: train-<method>/...)
    # (called from this synchronous flow, run_deployment runs its synchronous implementation: a FlowRun, not a
    # coroutine; its annotation is the union of both)
    runs = [
        cast(
            FlowRun,
            run_deployment(
                name=get_method(c.method).deployment(deployment),
                parameters=_parameters(group, c),
                timeout=0,
                as_subflow=True,
                tags=["child", group.kind],
            ),
        )
        for c in children
    ]
    with get_client(sync_client=True) as client:
        states = _wait(lambda rid: client.read_flow_run(rid), runs, poll_seconds)
    return [group.read(c, states[r.id][0], states[r.id][1]) for c, r in zip(children, runs)]


def _wait(read, runs, poll_seconds: float) -> dict:
    """Poll until every flow run is final; returns {id: (STATE, message)}."""
    pending = {r.id for r in runs}
    states: dict = {}
    while pending:
        for rid in list(pending):
            fr = read(rid)
            if fr.state is not None and fr.state.type.value in _FINAL:
                msg = None if fr.state.type.value == "COMPLETED" else (fr.state.message or fr.state.name)
                states[rid] = (fr.state.type.value, msg)
                pending.discard(rid)
        if pending:
            time.sleep(poll_seconds)
    return states


def publish_table(group: Group, rows: list[dict[str, Any]], title: str, key: str) -> str:
    """The table as markdown on the MLflow parent and as Prefect table + markdown artifacts, printed."""
    md = markdown_table(rows, title=title, cell=two_decimals)
    group.log(artifacts={f"{key}.md": md, f"{key}.json": json.dumps(rows, indent=2, default=str)})
    publish_artifacts(tables={key: (rows, title)}, markdown={f"{key}-md": (md, title)})
    print(md)
    return md


def alias_best(group: Group, results: list[ChildResult]) -> dict[str, str]:
    """Point the registry alias `best` of the children's registered model(s) at the version of the completed child
    with the best STS-B dev (`cse.tracking.model_export.set_best_alias`); the parent run gets a tag
    `cse.best.<registered model>` = version for each. Returns {registered model: version}."""
    best = set_best_alias([r.run_id for r in results if r.state == "COMPLETED" and r.run_id])
    if best:
        group.log(tags={f"cse.best.{name}": version for name, version in best.items()})
        print("; ".join(f"models:/{name}@{BEST_ALIAS} = version {version}" for name, version in best.items()))
    return best


def raise_for_failures(results: list[ChildResult], what: str) -> None:
    """After the table is published: fail the parent when a child failed, naming them (a rerun of the parent
    trains only those: finished children are found again and not trained twice)."""
    failed = [r.label for r in results if r.state != "COMPLETED"]
    if failed:
        errors = "; ".join(f"{r.label}: {r.error}" for r in results if r.state != "COMPLETED" and r.error)
        raise RuntimeError(
            f"{what} failed: {failed} ({errors}). Run the flow again: finished children are not trained again"
        )
