"""Flow `seeds`: n seeds of one preset as child runs, reported as mean ± std per task (test metrics).

The papers report means over several runs (DCPCSE: 10, DiffAug: 3 or 15); selection of each seed's checkpoint
stays on STS-B dev. The summary table goes to the MLflow parent run (metrics `<task>_mean` / `<task>_std`) and
to Prefect artifacts. The registered model's alias `best` names the seed with the best STS-B dev.
"""

from __future__ import annotations

import statistics
from typing import Any

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
from cse.storage.readers import SEVEN_TASKS

SUMMARY_METRICS = (*SEVEN_TASKS, "sts_avg", "best_stsb_dev", "retrieval_r1", "alignment", "uniformity")


def seed_summary(results: list[ChildResult], metrics: tuple[str, ...] = SUMMARY_METRICS) -> list[dict[str, Any]]:
    """One row per metric: mean, sample std (0 for one run), n, min, max over the completed seeds."""
    done = [r for r in results if r.state == "COMPLETED"]
    rows = []
    for m in metrics:
        if values := [r.metrics[m] for r in done if m in r.metrics]:
            rows.append(
                {
                    "metric": m,
                    "mean": statistics.fmean(values),
                    "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                    "n": len(values),
                    "min": min(values),
                    "max": max(values),
                }
            )
    return rows


@flow(name="seeds", log_prints=True)
def seeds(
    method: str = DEFAULT_METHOD,
    preset: str = "default",
    n: int = 5,
    seed_list: list[int] | None = None,
    overrides: dict[str, Any] | None = None,
    dispatch: Dispatch = "deployment",
    deployment: str = "default",
) -> list[dict]:
    """Train one method with several seeds and publish the mean and standard deviation of its metrics.

    Args:
        method: the method to train.
        preset: the preset.
        n: the number of seeds when `seed_list` is not given (from the preset's seed).
        seed_list: explicit seeds.
        overrides: config overrides shared by every child.
        dispatch: how children are run.
        deployment: the deployment children run on.

    Returns:
        One row per metric with its mean and standard deviation.
    """
    (overrides,) = deployment_merged(overrides=overrides)  # in a deployment run, merged into the deployment's
    base = resolve_train_config(preset, overrides, method=method)  # fail fast on a bad preset/override
    seed_list = seed_list or [base.seed + i for i in range(n)]  # from the preset's own seed (42; DiffAug's scripts: 0)
    children = [
        Child(label=f"seed-{s}", method=method, preset=preset, overrides=deep_merge(overrides or {}, {"seed": s}))
        for s in seed_list
    ]
    group = Group("seeds", method, {"preset": preset, "overrides": overrides or {}, "seeds": seed_list})
    results = run_children(group, children, dispatch=dispatch, deployment=deployment)
    rows = seed_summary(results)
    group.log(metrics={f"{r['metric']}_mean": r["mean"] for r in rows} | {f"{r['metric']}_std": r["std"] for r in rows})
    publish_table(group, rows, f"{method}/{preset}: mean ± std over seeds {seed_list}", "seeds")
    alias_best(group, results)
    raise_for_failures(results, "seeds")
    return rows
