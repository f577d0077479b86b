"""Flow `train-d2cse`: ingest → tokenise → corrupt → train → evaluate, every stage cached by its inputs.

Deployments name a preset of config/presets.py; `overrides` (a nested dict) changes any field:
    prefect deployment run train-d2cse/default -p 'overrides={"learning_rate": 0.03, "model": {"prefix_len": 12}}'
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from config.presets import resolve_train_config
from flows.corrupt import corrupt
from flows.tokenize import prepare_tokens
from tasks.ingest import ingest_dataset
from tasks.train import TrainResult, train_model

SEVEN = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")


def sts_table_text(metrics: dict[str, float]) -> str:
    head = "| " + " | ".join(t.upper().replace("SICKR", "SICK-R").replace("STSB", "STS-B") for t in SEVEN) + " | Avg. |"
    row = "| " + " | ".join(f"{metrics[t]:.2f}" for t in SEVEN) + f" | {metrics['sts_avg']:.2f} |"
    return "\n".join([head, "|" + "---|" * (len(SEVEN) + 1), row])


@flow(name="train-d2cse", log_prints=True)
def train_d2cse(preset: str = "default", overrides: dict[str, Any] | None = None, stop_after: int | None = None) -> TrainResult:
    """`stop_after` interrupts training after that many steps (tests of resume-after-kill)."""
    cfg = resolve_train_config(preset, overrides)
    tokens = prepare_tokens(cfg.dataset, cfg.ingest, cfg.tokenize_config())
    sts = ingest_dataset("sts", cfg.ingest)
    corruption = corrupt(tokens_key=tokens.key, config=cfg.corrupt)
    result = train_model(cfg, tokens, corruption, sts, stop_after=stop_after)
    print(f"MLflow run {result.run_id}: {result.steps} steps, best STS-B dev {result.best_stsb_dev:.2f}"
          + (f" (resumed from step {result.resumed_from})" if result.resumed_from is not None else ""))
    if result.test_metrics:
        print("\n" + sts_table_text(result.test_metrics))
    return result
