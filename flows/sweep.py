"""Flow `sweep`: a hyperparameter grid, or the D2CSE appendix's two-step learning-rate search.

Selection uses STS-B dev only (each child's best dev score), never test; the registered model's alias `best` names
the selected child's version. Children are dispatched as deployment
runs so they spread over the work pool; GPU jobs queue on the `gpu` concurrency limit (flows/children.py).

- `strategy="grid"`: `grid` maps dotted config paths to value lists (`{"learning_rate": [0.01, 0.02],
  "model.prefix_len": [12, 16]}`); every combination is a child.
- `strategy="lr-two-step"` (D2CSE appendix): a coarse grid of learning rates (default 0.01 … 0.09 by 0.01), then
  a fine grid from the best to the second-best coarse value by `fine_step` (default 0.001), endpoints excluded.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

from prefect import flow

from cse.config.methods import DEFAULT_METHOD
from cse.config.presets import deep_merge
from cse.config.training import resolve_train_config
from cse.flows.children import (
    Child,
    ChildResult,
    Dispatch,
    Group,
    alias_best,
    publish_table,
    raise_for_failures,
    run_children,
)
from cse.flows.deployment_params import deployment_merged

COARSE_LR = [round(0.01 * i, 3) for i in range(1, 10)]


def nested(path: str, value: Any) -> dict[str, Any]:
    """`"model.prefix_len", 12` → `{"model": {"prefix_len": 12}}`."""
    return functools.reduce(lambda inner, key: {key: inner}, reversed(path.split(".")), value)


def grid_children(
    method: str, preset: str, overrides: dict[str, Any] | None, grid: dict[str, list[Any]], prefix: str = ""
) -> list[Child]:
    """The child runs of a grid over dotted config keys, one per combination of values.

    Args:
        method: the method of every child.
        preset: the preset of every child.
        overrides: config overrides shared by every child.
        grid: dotted config key → values to try.
        prefix: a prefix of every child label.

    Returns:
        The children.

    Raises:
        ValueError: the grid is empty or a key has no values.
    """
    if not grid or any(not v for v in grid.values()):
        raise ValueError(f"grid needs at least one value per key, got {grid}")
    keys = list(grid)
    children = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        ovr = dict(overrides or {})
        for k, v in zip(keys, combo):
            ovr = deep_merge(ovr, nested(k, v))
        label = prefix + ",".join(f"{k}={v}" for k, v in zip(keys, combo))
        children.append(Child(label=label, method=method, preset=preset, overrides=ovr))
    return children


def fine_grid(results: list[tuple[Any, float | None]], step: float) -> list[float]:
    """Values strictly between the best and second-best (lr, dev) pairs, every `step` (pairs without a dev score
    left out)."""
    scored = [(lr, dev) for lr, dev in results if dev is not None]
    ranked = sorted(scored, key=lambda r: r[1], reverse=True)
    if len(ranked) < 2:
        raise ValueError("the fine step needs at least two coarse results with a dev score")
    lo, hi = sorted((ranked[0][0], ranked[1][0]))
    n = round((hi - lo) / step)
    return [round(lo + i * step, 6) for i in range(1, n)]


def selection_rows(children: list[Child], results: list[ChildResult], stage: str) -> list[dict[str, Any]]:
    """Table rows of a sweep stage: each child's label, state, best dev score and run id.

    Args:
        children: the children of the stage.
        results: their results, in the same order.
        stage: the stage name.

    Returns:
        One row per child.
    """
    return [
        {"stage": stage, "child": c.label, "state": r.state, "best_stsb_dev": r.best_stsb_dev, "run_id": r.run_id}
        for c, r in zip(children, results)
    ]


@dataclass
class SweepRun:
    """The children of one sweep as they run: their group, where they run, and their results and table rows so far.

    Args:
        group: the sweep's group (its MLflow parent run and the children's tags).
        method: the method of every child.
        preset: the preset of every child.
        overrides: config overrides shared by every child.
        dispatch: how children are run.
        deployment: the deployment children run on.
    """

    group: Group
    method: str
    preset: str
    overrides: dict[str, Any] | None
    dispatch: Dispatch
    deployment: str
    results: list[ChildResult] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def stage(self, values: dict[str, list[Any]], stage: str, prefix: str = "") -> list[tuple[Any, float | None]]:
        """Run one grid as children; their results and table rows are added; returns (learning rate, dev score)s."""
        children = grid_children(self.method, self.preset, self.overrides, values, prefix=prefix)
        found = run_children(self.group, children, dispatch=self.dispatch, deployment=self.deployment)
        self.results.extend(found)
        self.rows.extend(selection_rows(children, found, stage))
        return [(c.overrides.get("learning_rate"), r.best_stsb_dev) for c, r in zip(children, found)]

    def run(
        self, strategy: str, grid: dict[str, list[Any]] | None, coarse: list[float] | None, fine_step: float
    ) -> None:
        """Run the children of `strategy`: the grid, or the coarse learning rates then the fine ones between the two
        best."""
        if strategy == "grid":
            self.stage(grid or {}, "grid")
        elif strategy == "lr-two-step":
            coarse_lrs = self.stage({"learning_rate": coarse or COARSE_LR}, "coarse", prefix="coarse:")
            if fine := fine_grid(coarse_lrs, fine_step):
                self.stage({"learning_rate": fine}, "fine", prefix="fine:")
        else:
            raise ValueError(f"strategy must be 'grid' or 'lr-two-step', not {strategy!r}")

    def select_best(self, what: str) -> dict[str, Any]:
        """The row of the child with the best dev score, logged on the group and published with every row under the
        title `what` (RuntimeError when no child has a dev score)."""
        scored = [r for r in self.rows if r["best_stsb_dev"] is not None]
        if not scored:
            raise RuntimeError("no child of the sweep produced a dev score")
        best = max(scored, key=lambda r: r["best_stsb_dev"])
        self.group.log(
            metrics={"best_stsb_dev": best["best_stsb_dev"]},
            tags={"best_child": best["child"], "best_run_id": str(best["run_id"])},
        )
        publish_table(self.group, self.rows, f"{what}; selected on STS-B dev: {best['child']}", "sweep")
        return best


@flow(name="sweep", log_prints=True)
def sweep(
    method: str = DEFAULT_METHOD,
    preset: str = "default",
    strategy: Literal["grid", "lr-two-step"] = "lr-two-step",
    grid: dict[str, list[Any]] | None = None,
    coarse: list[float] | None = None,
    fine_step: float = 0.001,
    overrides: dict[str, Any] | None = None,
    dispatch: Dispatch = "deployment",
    deployment: str = "default",
) -> dict:
    """Sweep hyperparameters by dev score: a grid, or a coarse then fine learning-rate search.

    Args:
        method: the method to train.
        preset: the preset.
        strategy: `grid` or `lr-two-step`.
        grid: dotted config key → values (strategy `grid`).
        coarse: the coarse learning rates (strategy `lr-two-step`).
        fine_step: the step of the fine learning-rate grid.
        overrides: config overrides shared by every child.
        dispatch: how children are run.
        deployment: the deployment children run on.

    Returns:
        The best child's row, the rows of all children, the group id and the `best` aliases set.
    """
    (overrides,) = deployment_merged(overrides=overrides)  # in a deployment run, merged into the deployment's
    resolve_train_config(preset, overrides, method=method)  # fail fast
    params = {
        "preset": preset,
        "strategy": strategy,
        "grid": grid,
        "coarse": coarse,
        "fine_step": fine_step,
        "overrides": overrides or {},
    }
    group = Group("sweep", method, params)
    run = SweepRun(group, method, preset, overrides, dispatch, deployment)
    run.run(strategy, grid, coarse, fine_step)
    best = run.select_best(f"sweep {method}/{preset} ({strategy})")
    best_versions = alias_best(group, run.results)
    raise_for_failures(run.results, "sweep children")
    return {"best": best, "children": run.rows, "group": group.id, "best_versions": best_versions}
