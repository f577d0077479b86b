"""Named training presets per method (the papers' hyperparameter tables) and override merging.

A deployment names a preset and may pass `overrides` (a nested dict merged into it), so every
field of the resolved TrainConfig can be changed per deployment or per run.
"""

from __future__ import annotations

from typing import Any

from config.training import TrainConfig

_SMOKE_CORRUPT = {"generator": "random-init:distilbert-tiny", "shard_size": 4096, "batch_size": 128}
# The packaged MiniLM, the local Wiki1M sample: minutes on 2 CPU cores (STS-B dev every 20 steps).
_SMOKE = {"backbone": "packaged:minilm", "batch_size": 32, "epochs": 1, "max_steps": 40, "max_train_sentences": 2048,
          "eval_steps": 20, "log_steps": 5, "system_metrics": False}

# Per method: preset name → the fields that differ from the TrainConfig defaults (D2CSE unsup BERT-base).
# Every preset states its method; "default" is the paper's BERT-base unsupervised setting unless noted.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # D2CSE paper Table 7 (methods.md §5): masking 0.3 and λ 0.005 everywhere.
    "d2cse": {
        "default": {},
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
        "smoke": {**_SMOKE, "learning_rate": 0.02, "model": {"prefix_len": 8}, "corrupt": _SMOKE_CORRUPT},
    },
    # SimCSE README / paper appendix (methods.md §2): τ 0.05, max length 32, full fine-tuning.
    "simcse": {
        "default": {"batch_size": 64, "learning_rate": 3e-5, "epochs": 1, "model": {"mlp_only_train": True}},
        "bert-large": {"backbone": "bert-large-uncased", "batch_size": 64, "learning_rate": 1e-5, "epochs": 1,
                       "model": {"mlp_only_train": True}},
        "roberta-base": {"backbone": "roberta-base", "batch_size": 512, "learning_rate": 1e-5, "epochs": 1,
                         "model": {"mlp_only_train": True}},
        "sup": {"supervised": True, "batch_size": 512, "learning_rate": 5e-5, "epochs": 3, "model": {"mlp_only_train": False}},
        "sup-bert-large": {"supervised": True, "backbone": "bert-large-uncased", "batch_size": 512, "learning_rate": 1e-5,
                           "epochs": 3, "model": {"mlp_only_train": False}},
        "sup-roberta-base": {"supervised": True, "backbone": "roberta-base", "batch_size": 512, "learning_rate": 5e-5,
                             "epochs": 3, "model": {"mlp_only_train": False}},
        "smoke": {**_SMOKE, "learning_rate": 3e-5, "model": {"mlp_only_train": True}},
    },
    # DCPCSE paper appendix Tables 3/4 (methods.md §3); MLM auxiliary only for RoBERTa unsupervised.
    "dcpcse": {
        "default": {"batch_size": 256, "learning_rate": 3e-2, "epochs": 1, "model": {"prefix_len": 16}},
        "bert-large": {"backbone": "bert-large-uncased", "batch_size": 256, "learning_rate": 3e-2, "epochs": 1,
                       "model": {"prefix_len": 10}},
        "roberta-base": {"backbone": "roberta-base", "batch_size": 64, "learning_rate": 3e-2, "epochs": 1,
                         "model": {"prefix_len": 14, "mlm": True}},
        "sup": {"supervised": True, "batch_size": 256, "learning_rate": 5e-3, "epochs": 10,
                "model": {"prefix_len": 12, "mlp_only_train": False}},
        "sup-bert-large": {"supervised": True, "backbone": "bert-large-uncased", "batch_size": 256, "learning_rate": 5e-3,
                           "epochs": 10, "model": {"prefix_len": 12, "mlp_only_train": False}},
        "sup-roberta-base": {"supervised": True, "backbone": "roberta-base", "batch_size": 256, "learning_rate": 1e-2,
                             "epochs": 10, "model": {"prefix_len": 10, "mlp_only_train": False}},
        "smoke": {**_SMOKE, "learning_rate": 0.02, "model": {"prefix_len": 8}},
    },
    # DiffCSE paper Tables 12/13 (methods.md §4): STS settings; no BERT-large configuration exists.
    "diffcse": {
        "default": {"batch_size": 64, "learning_rate": 7e-6, "epochs": 2, "model": {"rtd_weight": 0.005},
                    "corrupt": {"mask_ratio": 0.3}},
        "roberta-base": {"backbone": "roberta-base", "batch_size": 64, "learning_rate": 1e-5, "epochs": 2,
                         "model": {"rtd_weight": 0.005},
                         "corrupt": {"mask_ratio": 0.2, "generator": "distilroberta-base"}},
        "smoke": {**_SMOKE, "learning_rate": 2e-5, "model": {"rtd_weight": 0.005}, "corrupt": _SMOKE_CORRUPT},
    },
    # DiffAug paper Table 5 and scripts (methods.md §6). Sentences are cut to 32 tokens inside the template, so the
    # tokeniser keeps 34 ids ([CLS] + 32 + [SEP]). The reference's global batches are used (2 GPUs × 128 = 256 for
    # semi; the supervised script's gradient accumulation 4 is not reproduced: contrastive batch 128 either way).
    "diffaug": {
        "semi": {"batch_size": 256, "learning_rate": 1e-5, "epochs": 1, "max_length": 34,
                 "prefix_phase": {"steps": 2000, "learning_rate": 1e-3, "batch_size": 128}},
        "semi-aux": {"batch_size": 256, "learning_rate": 1e-5, "epochs": 1, "max_length": 34, "aux_nli_batch_size": 128,
                     "model": {"aux_weight": 1e-3},
                     "prefix_phase": {"steps": 1500, "learning_rate": 1e-3, "batch_size": 128}},
        "sup": {"supervised": True, "batch_size": 128, "learning_rate": 5e-5, "epochs": 3, "max_length": 34,
                "prefix_phase": {"steps": 1250, "learning_rate": 1e-3, "batch_size": 128}},
        "smoke": {**_SMOKE, "max_steps": 20, "learning_rate": 2e-5, "max_length": 34, "eval_steps": 10,
                  "aux_nli_batch_size": 16, "model": {"aux_weight": 1e-3},
                  "prefix_phase": {"steps": 10, "learning_rate": 1e-3, "batch_size": 32}},
    },
}
D2CSE_PRESETS = PRESETS["d2cse"]


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in overrides.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_train_config(preset: str = "default", overrides: dict[str, Any] | None = None, method: str = "d2cse") -> TrainConfig:
    """The TrainConfig of `method`'s `preset` with `overrides` (a nested dict) merged in."""
    if method not in PRESETS:
        raise ValueError(f"unknown method {method!r}; known: {sorted(PRESETS)}")
    if preset not in PRESETS[method]:
        raise ValueError(f"unknown {method} preset {preset!r}; known: {sorted(PRESETS[method])}")
    overrides = dict(overrides or {})
    if overrides.get("method", method) != method:
        raise ValueError(f"overrides name method {overrides['method']!r} but the preset belongs to {method!r}")
    base = {"method": method, "preset": preset}
    merged = deep_merge(deep_merge(base, PRESETS[method][preset]), overrides)
    return TrainConfig.model_validate(merged)
