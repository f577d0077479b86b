"""Training flows, one per method of the registry (config/methods.py): ingest → tokenise → (corrupt) → train → evaluate, each stage cached by its inputs.

`train-<method>` flows (train-d2cse, train-simcse, train-dcpcse, train-diffcse, train-diffaug) take a preset of
config/presets.py and `overrides` (a nested dict merged into it), so any field changes per deployment or run:
    prefect deployment run train-d2cse/default -p 'overrides={"learning_rate": 0.03, "model": {"prefix_len": 12}}'
Only the stages a method needs run: the corruption stage for D2CSE and DiffCSE, NLI tokens for DiffAug's prefix
phase and auxiliary loss. `tags` are added to the MLflow run (sweeps use them to nest children under a parent).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from config.methods import REGISTRY, MethodSpec
from config.training import resolve_train_config
from config.training import TrainConfig
from flows.corrupt import corrupt
from flows.tokenization import prepare_tokens
from storage.readers import SEVEN_TASKS
from tasks.ingest import ingest_dataset
from tasks.train import TrainResult, train_model
from tracking.reporting import markdown_table, two_decimals


def sts_table_text(metrics: dict[str, float]) -> str:
    """The seven STS test scores and their average as a markdown table (header, rule, one row; no final newline)."""
    row = {t.upper().replace("SICKR", "SICK-R").replace("STSB", "STS-B"): float(metrics[t]) for t in SEVEN_TASKS}
    return markdown_table([{**row, "Avg.": float(metrics["sts_avg"])}], cell=two_decimals).rstrip("\n")


def run_training(cfg: TrainConfig, stop_after: int | None = None, tags: dict[str, str] | None = None) -> TrainResult:
    """The stages of one training job, inside whichever flow calls it. Every dataset it reuses is verified down to
    its content hash before training (a damaged one is quarantined and rebuilt)."""
    tokens = prepare_tokens(cfg.dataset, cfg.ingest, cfg.tokenize_config(), verify=True)
    nli_tokens = None
    if cfg.needs_nli:
        nli_tokens = tokens if cfg.dataset == "nli" else prepare_tokens("nli", cfg.ingest, cfg.tokenize_config(), verify=True)
    sts = ingest_dataset("sts", cfg.ingest, verify=True)
    corruption = corrupt(tokens_key=tokens.key, config=cfg.corrupt, verify=True) if cfg.uses_corruption else None
    result = train_model(cfg, tokens, corruption, sts, nli_tokens=nli_tokens, stop_after=stop_after, extra_tags=tags)
    print(f"{cfg.method}/{cfg.preset}: MLflow run {result.run_id}, {result.steps} steps, best STS-B dev "
          f"{result.best_stsb_dev:.2f}" + (f" (resumed from step {result.resumed_from})" if result.resumed_from is not None else ""))
    if result.test_metrics:
        print("\n" + sts_table_text(result.test_metrics))
    return result


def _train_flow(spec: MethodSpec):
    @flow(name=spec.flow_name, log_prints=True, description=f"Train one {spec.title} job: {spec.summary}.")
    def train(preset: str = "default", overrides: dict[str, Any] | None = None, stop_after: int | None = None,
              tags: dict[str, str] | None = None) -> TrainResult:
        """Train one job of this method (`stop_after` interrupts after that many steps: resume tests)."""
        return run_training(resolve_train_config(preset, overrides, method=spec.name), stop_after, tags)

    train.__name__ = train.__qualname__ = spec.flow_function
    return train


# One flow per registry entry, bound to this module's names (prefect.yaml's entrypoints `flows/train.py:train_<method>`).
TRAIN_FLOWS = {name: _train_flow(spec) for name, spec in REGISTRY.items()}
globals().update({spec.flow_function: TRAIN_FLOWS[name] for name, spec in REGISTRY.items()})
