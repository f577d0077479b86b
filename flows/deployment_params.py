"""A deployment run's nested parameters merge into the deployment's own: one rule for every flow.

Prefect merges a run's parameters over its deployment's one level deep: `prefect deployment run corrupt/smoke -p
'config={"mask_ratio": 0.15}'` would replace the deployment's whole `config` (its generator, shard size...) by a
config of defaults with that one key. Every flow with a nested parameter (a stage's `config`, `ingest_config`,
`tokenize_config`, an experiment's `overrides`) calls `deployment_merged` first, before any work: for each of those
parameters that both the deployment and the run give as mappings, the run's keys are merged recursively over the
deployment's (`cse.config.presets.deep_merge`: nested mappings merge, any other value, lists and null included,
replaces), the way training `overrides` merge into a preset. A key the parameter's config does not know is refused
by name with the known keys (`cse.config.stages._Config`), as the flow run's failure reason.

Outside a deployment run (a plain Python call, a subflow, a test) the values are returned as given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from uuid import UUID

from pydantic import BaseModel

from cse.config.limits import check_parameter
from cse.config.presets import deep_merge


def _deployment_run() -> tuple[UUID, dict[str, Any]] | None:
    """(deployment id, the run's raw parameters) when this flow run was created from a deployment, else None.

    A subflow's run has no deployment of its own (its parent's run has), so it keeps the values it was called with.
    """
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    run = getattr(ctx, "flow_run", None)
    if run is None or run.deployment_id is None:
        return None
    return run.deployment_id, dict(run.parameters or {})


def _deployment_parameters(deployment_id: UUID) -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return dict(client.read_deployment(deployment_id).parameters or {})


def merge_parameter(value: Any, deployment_value: Any, run_value: Any) -> Any:
    """One parameter of a deployment run: the run's keys (`run_value`, as the run gave them) merged over the
    deployment's (`deployment_value`) when both are mappings, validated again as `value`'s config class; `value`
    itself otherwise (the run gave a whole non-mapping value, or the deployment has none).

    Args:
        value: the parameter as Prefect validated it (a pydantic config built from the run's keys alone, or a dict).
        deployment_value: the deployment's value of the parameter (raw JSON), or None.
        run_value: the flow run's value of the parameter (raw JSON, after Prefect's shallow merge).
    """
    if not (isinstance(deployment_value, Mapping) and isinstance(run_value, Mapping)):
        return value
    merged = deep_merge(dict(deployment_value), dict(run_value))
    if isinstance(value, BaseModel):
        return type(value).model_validate(merged)
    return merged


def deployment_merged(**values: Any) -> tuple[Any, ...]:
    """The flow's nested parameters `values` (name=value, as the flow received them) with, in a deployment run, each
    one the deployment gives as a mapping deep-merged under the run's keys; in the order given.

    Args:
        values: the flow's parameters to merge, by their parameter names.

    Returns:
        The values in the order of `values` (unchanged outside a deployment run).

    Raises:
        pydantic.ValidationError: a merged config is invalid (unknown keys are named with the known ones).
        ParameterRefused: a run's value nested too deep or too long (`cse.config.limits`).
    """
    found = _deployment_run()
    if found is None:
        return tuple(values.values())
    deployment_id, given = found
    for name in values:  # a 900-level or 10 MB value is refused by name before any merge walks it
        check_parameter(name, given.get(name))
    names = [n for n, v in values.items() if isinstance(given.get(n), Mapping)]
    if not names:
        return tuple(values.values())
    base = _deployment_parameters(deployment_id)
    return tuple(merge_parameter(v, base.get(n), given.get(n)) for n, v in values.items())
