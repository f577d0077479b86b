"""Flow `ablate-d2cse`: the D2CSE paper's Table 6 matrix, variants (a)–(d) × [CLS] prompt on/off, a run per cell.

(a) prompts on the encoder only; h conditions the frozen PLM as discriminator (no prompts there);
(b) as (a) with a trainable copy of the PLM as discriminator;
(c) shared prompts on encoder and discriminator, no conditional input;
(d) shared prompts + conditional input (= D2CSE).
Every cell is a child run of one MLflow parent (flows/children.py); the result is the matrix of STS averages
beside the published Table 6 (Lee, 2023), logged to the parent and as Prefect artifacts. The variants are the
model class's `ablations` (models/methods/d2cse.py), the published cells `MethodSpec.published.ablation`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from cse.config.methods import REGISTRY
from cse.config.presets import deep_merge
from cse.config.training import resolve_train_config
from cse.flows.children import Child, ChildResult, Dispatch, Group, publish_table, raise_for_failures, run_children
from cse.flows.deployment_params import deployment_merged

# The method whose paper's ablation table this flow runs: the registry's one entry with ablation variants (its model
# class's `ablations`, models/methods/d2cse.py) and the paper's numbers for them (`published.ablation`, config/published.py).
ABLATED = next(spec for spec in REGISTRY.values() if spec.ablations)
VARIANTS: dict[str, dict[str, bool]] = {name: dict(fields) for name, fields in ABLATED.ablations.items()}


def ablation_children(
    preset: str, overrides: dict[str, Any] | None, variants: list[str], cls_prompt: list[bool]
) -> list[Child]:
    """The child runs of the d2cse ablation: one per variant and CLS mode (prompt or static).

    Args:
        preset: the preset of every child.
        overrides: config overrides shared by every child.
        variants: the ablation variants to run.
        cls_prompt: the CLS modes to run (True: CLS prompt, False: static CLS).

    Returns:
        The children.

    Raises:
        ValueError: an unknown variant.
    """
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown ablation variants {unknown}; known: {sorted(VARIANTS)}")
    return [
        Child(
            label=f"{v}-{'cls-prompt' if c else 'static-cls'}",
            method=ABLATED.name,
            preset=preset,
            overrides=deep_merge(overrides or {}, {"model": {**VARIANTS[v], "cls_prompt": c}}),
        )
        for v in variants
        for c in cls_prompt
    ]


def ablation_table(results: list[ChildResult], setting: str) -> list[dict[str, Any]]:
    """Rows comparing each ablation run's STS average with the published d2cse ablation (Lee, 2023).

    Args:
        results: the child results.
        setting: `sup` or `unsup`.

    Returns:
        One row per child with its score, the published score and their difference.
    """
    rows = []
    for r in results:
        variant, cls = r.label.split("-", 1)
        pub = ABLATED.published.ablation[variant].get((setting, cls == "cls-prompt"))
        ours = r.metrics.get("sts_avg")
        rows.append(
            {
                "variant": variant,
                "cls": cls,
                "state": r.state,
                "sts_avg": ours,
                "best_stsb_dev": r.best_stsb_dev,
                "published_avg": pub,
                "difference": None if ours is None or pub is None else round(ours - pub, 2),
                "run_id": r.run_id,
            }
        )
    return rows


@flow(name=f"ablate-{ABLATED.name}", log_prints=True)  # ablate-d2cse
def ablate_d2cse(
    preset: str = "default",
    overrides: dict[str, Any] | None = None,
    variants: list[str] | None = None,
    cls_prompt: list[bool] | None = None,
    dispatch: Dispatch = "deployment",
    deployment: str = "default",
) -> list[dict]:
    """Run the d2cse ablation (Lee, 2023) and publish a table against the paper's.

    Args:
        preset: the preset of every child.
        overrides: config overrides shared by every child.
        variants: the ablation variants (default: all).
        cls_prompt: the CLS modes (default: both).
        dispatch: how children are run.
        deployment: the deployment children run on.

    Returns:
        The table rows.
    """
    (overrides,) = deployment_merged(overrides=overrides)  # in a deployment run, merged into the deployment's
    variants = variants or list(VARIANTS)
    cls_prompt = [True, False] if cls_prompt is None else cls_prompt
    cfg = resolve_train_config(preset, overrides, method=ABLATED.name)
    children = ablation_children(preset, overrides, variants, cls_prompt)
    group = Group(
        "ablate",
        ABLATED.name,
        {"preset": preset, "overrides": overrides or {}, "variants": variants, "cls_prompt": cls_prompt},
    )
    results = run_children(group, children, dispatch=dispatch, deployment=deployment)
    setting = "sup" if cfg.supervised else "unsup"
    rows = ablation_table(results, setting)
    publish_table(group, rows, f"D2CSE ablation ({setting}, preset {preset}) vs paper Table 6", "ablation")
    raise_for_failures(results, "ablation cells")
    return rows
