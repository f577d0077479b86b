"""Named training presets (the papers' hyperparameter tables) and override merging.

A deployment names a preset and may pass `overrides` (a nested dict merged into it), so every
field of the resolved TrainConfig can be changed per deployment or per run.
"""

from __future__ import annotations

from typing import Any

from config.training import TrainConfig

# D2CSE paper Table 7 (methods.md §5): masking 0.3 and λ 0.005 everywhere.
D2CSE_PRESETS: dict[str, dict[str, Any]] = {
    "default": {},  # unsupervised BERT-base: the TrainConfig defaults
    "bert-large": {"backbone": "bert-large-uncased", "learning_rate": 0.034},
    "roberta-base": {
        "backbone": "roberta-base", "batch_size": 128, "learning_rate": 0.044,
        "model": {"cls_prompt": True}, "corrupt": {"generator": "distilroberta-base"},
    },
    "sup": {
        "supervised": True, "batch_size": 256, "learning_rate": 0.055, "epochs": 10,
        "model": {"prefix_len": 12, "cls_prompt": True},
    },
    "sup-roberta-base": {
        "supervised": True, "backbone": "roberta-base", "batch_size": 256, "learning_rate": 0.024, "epochs": 10,
        "model": {"prefix_len": 12, "cls_prompt": True}, "corrupt": {"generator": "distilroberta-base"},
    },
    # The packaged MiniLM, the local Wiki1M sample, a small random generator: minutes on 2 CPU cores.
    "smoke": {
        "backbone": "packaged:minilm", "batch_size": 32, "learning_rate": 0.02, "epochs": 1, "max_steps": 40,
        "max_train_sentences": 2048, "eval_steps": 20, "log_steps": 5, "system_metrics": False,
        "model": {"prefix_len": 8},
        "corrupt": {"generator": "random-init:distilbert-tiny", "shard_size": 4096, "batch_size": 128},
    },
}


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in overrides.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_train_config(preset: str = "default", overrides: dict[str, Any] | None = None) -> TrainConfig:
    if preset not in D2CSE_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(D2CSE_PRESETS)}")
    base = TrainConfig(preset=preset).model_dump()
    merged = deep_merge(deep_merge(base, D2CSE_PRESETS[preset]), overrides or {})
    return TrainConfig.model_validate(merged)


