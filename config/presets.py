"""Named training presets per method (the papers' hyperparameter tables): plain data, read by the method registry
(config/methods.py) and resolved into a TrainConfig by `cse.config.training.resolve_train_config`.

A deployment names a preset and may pass `overrides` (a nested dict merged into it), so every
field of the resolved TrainConfig can be changed per deployment or per run.
"""

from __future__ import annotations

from typing import Any

# Where the presets' data come from by default (config/stages.py's source URLs): the SimCSE authors' release of
# Wiki1M, the NLI triplets and SentEval on the HF hub, which every paper here trains and evaluates on.
PRESET_DATA_URL = "https://huggingface.co/datasets/princeton-nlp/datasets-for-simcse/resolve/main"

_SMOKE_CORRUPT = {"generator": "random-init:distilbert-tiny", "shard_size": 4096, "batch_size": 128}
# The cheaper, non-reference corruption: one variant per sentence shared by every view and epoch, generator dropout
# off (the stage then costs 1/(epochs x views) of the reference's). Logged as the run parameter `corruption_reuse`.
SINGLE_CORRUPTION = {"variants": 1, "generator_dropout": False}
# The RoBERTa runs' corruption generator (the D2CSE and DiffCSE papers).
_ROBERTA_GENERATOR = {"generator": "distilroberta-base"}


def _preset(
    batch_size: int,
    learning_rate: float,
    epochs: int,
    model: dict[str, Any],
    backbone: str | None = None,
    supervised: bool = False,
    **more: Any,
) -> dict[str, Any]:
    """A preset's optimisation and model fields (and `more`); `backbone` and `supervised` only where not the default."""
    fields = {"batch_size": batch_size, "learning_rate": learning_rate, "epochs": epochs, "model": model, **more}
    return ({"backbone": backbone} if backbone else {}) | ({"supervised": True} if supervised else {}) | fields


def _simcse(
    batch_size: int, learning_rate: float, backbone: str | None = None, supervised: bool = False
) -> dict[str, Any]:
    """A SimCSE preset: 1 epoch with the MLP at training only, or supervised 3 epochs with the MLP kept."""
    model = {"mlp_only_train": not supervised}
    return _preset(batch_size, learning_rate, 3 if supervised else 1, model, backbone, supervised)


def _dcpcse_sup(learning_rate: float, prefix_len: int, backbone: str | None = None) -> dict[str, Any]:
    """A supervised DCPCSE preset: batch 256, 10 epochs, the MLP kept."""
    model = {"prefix_len": prefix_len, "mlp_only_train": False}
    return _preset(256, learning_rate, 10, model, backbone, supervised=True)


# SimCSE's supervised optimisation (Gao et al., 2021) used by the D2CSE paper's self-built supervised DiffCSE (its
# Table 8 gives no hyperparameters; [inferred]): batch 512, 3 epochs on NLI, LR 5e-5 (base) / 1e-5 (large).
_DIFFCSE_SUP = _preset(512, 5e-5, 3, {"rtd_weight": 0.005}, supervised=True)
# The packaged MiniLM, the local Wiki1M sample: minutes on 2 CPU cores (STS-B dev every 20 steps).
_SMOKE = {
    "backbone": "packaged:minilm",
    "batch_size": 32,
    "epochs": 1,
    "max_steps": 40,
    "max_train_sentences": 2048,
    "eval_steps": 20,
    "log_steps": 5,
    "system_metrics": False,
}

_DIFFAUG = {"max_length": 34, "eval_steps": 50, "seed": 0}
# DiffAug's main semi-supervised setting (paper Table 1; stage 1 NLI prefix tuning, stage 2 Wiki1M): also its `default`,
# the preset experiment children start from.
_DIFFAUG_SEMI = {
    **_DIFFAUG,
    "batch_size": 256,
    "learning_rate": 1e-5,
    "epochs": 1,
    "prefix_phase": {"steps": 2000, "learning_rate": 1e-3, "batch_size": 128},
}

# Per method: preset name → the fields that differ from the TrainConfig defaults (D2CSE unsup BERT-base).
# Every preset states its method; "default" is the paper's BERT-base unsupervised setting unless noted.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # D2CSE paper Table 7 (Lee, 2023): masking 0.3 and λ 0.005 everywhere.
    "d2cse": {
        "default": {},
        "single-corruption": {"corrupt": SINGLE_CORRUPTION},
        "bert-large": {"backbone": "bert-large-uncased", "learning_rate": 0.034},
        "roberta-base": {
            "backbone": "roberta-base",
            "batch_size": 128,
            "learning_rate": 0.044,
            "model": {"cls_prompt": True},
            "corrupt": _ROBERTA_GENERATOR,
        },
        "sup": _preset(256, 0.055, 10, {"prefix_len": 12, "cls_prompt": True}, supervised=True),
        "sup-roberta-base": _preset(
            256, 0.024, 10, {"prefix_len": 12, "cls_prompt": True}, "roberta-base", True, corrupt=_ROBERTA_GENERATOR
        ),
        # The prompts at 0.1, not the paper's 0.021 (2 epochs of 1M sentences): in 40 steps Adam moves each prompt
        # entry about lr per step, and at 0.02 the N(0, 0.02) prompts, which cost the frozen MiniLM ~3 STS-B dev points
        # before any step, never got back to the backbone. At 0.1 the run beats it on STS-B dev, not yet on the STS
        # test average (docs/quickstart.md, "How the smoke preset was chosen").
        "smoke": {**_SMOKE, "learning_rate": 0.1, "model": {"prefix_len": 8}, "corrupt": _SMOKE_CORRUPT},
        # What `make main` runs: the smoke budget with prompts that start as copies of the backbone's own [SEP] key and
        # value (`prefix_init: sep`, Li & Liang's real-token init; not the paper's) and no position shift, at about the
        # paper's rate. The reference start costs MiniLM ~1.3-3 STS-B dev points that 40 steps do not win back on the
        # test sets; this start costs none, and training adds a little to it (docs/quickstart.md, "How the smoke preset
        # was chosen").
        "smoke-demo": {
            **_SMOKE,
            "learning_rate": 0.02,
            "model": {"prefix_len": 8, "shift_positions": False, "prefix_init": "sep"},
            "corrupt": _SMOKE_CORRUPT,
        },
    },
    # SimCSE README / paper appendix (princeton-nlp/SimCSE): τ 0.05, max length 32, full fine-tuning.
    "simcse": {
        "default": _simcse(64, 3e-5),
        "bert-large": _simcse(64, 1e-5, "bert-large-uncased"),
        "roberta-base": _simcse(512, 1e-5, "roberta-base"),
        "sup": _simcse(512, 5e-5, supervised=True),
        "sup-bert-large": _simcse(512, 1e-5, "bert-large-uncased", supervised=True),
        "sup-roberta-base": _simcse(512, 5e-5, "roberta-base", supervised=True),
        "roberta-large": _simcse(512, 3e-5, "roberta-large"),
        "sup-roberta-large": _simcse(512, 1e-5, "roberta-large", supervised=True),
        "smoke": {**_SMOKE, "learning_rate": 3e-5, "model": {"mlp_only_train": True}},
    },
    # DCPCSE paper appendix Tables 3/4 (Jiang & Wang, 2022); MLM auxiliary only for RoBERTa unsupervised.
    "dcpcse": {
        "default": _preset(256, 3e-2, 1, {"prefix_len": 16}),
        "bert-large": _preset(256, 3e-2, 1, {"prefix_len": 10}, "bert-large-uncased"),
        "roberta-base": _preset(64, 3e-2, 1, {"prefix_len": 14, "mlm": True}, "roberta-base"),
        "roberta-large": _preset(64, 1e-2, 1, {"prefix_len": 10, "mlm": True}, "roberta-large"),
        "sup": _dcpcse_sup(5e-3, 12),
        "sup-bert-large": _dcpcse_sup(5e-3, 12, "bert-large-uncased"),
        "sup-roberta-base": _dcpcse_sup(1e-2, 10, "roberta-base"),
        "sup-roberta-large": _dcpcse_sup(5e-3, 10, "roberta-large"),
        "smoke": {**_SMOKE, "learning_rate": 0.02, "model": {"prefix_len": 8}},
    },
    # DiffCSE (Chuang et al., 2022) Tables 12/13: STS settings; no BERT-large configuration exists. Each view of each
    # epoch reads its own corruption (the CorruptConfig/TrainConfig default), generator dropout on.
    "diffcse": {
        "default": _preset(64, 7e-6, 2, {"rtd_weight": 0.005}, corrupt={"mask_ratio": 0.3}),
        "roberta-base": _preset(
            64, 1e-5, 2, {"rtd_weight": 0.005}, "roberta-base", corrupt={"mask_ratio": 0.2, **_ROBERTA_GENERATOR}
        ),
        "single-corruption": _preset(
            64, 7e-6, 2, {"rtd_weight": 0.005}, corrupt={"mask_ratio": 0.3, **SINGLE_CORRUPTION}
        ),
        # DiffCSE's transfer models (DiffCSE paper Table 13, "transfer" columns), test-evaluated on the 7 SentEval
        # transfer tasks as well. Checkpoints are selected on STS-B dev as the paper's appendix A says for every run
        # (Table 13's hyperparameters were chosen on the transfer dev average); `overrides={"selection": "transfer"}`
        # selects on the transfer dev average instead (SimCSE's trainer `eval_transfer`).
        "transfer": _preset(64, 2e-6, 2, {"rtd_weight": 0.05}, corrupt={"mask_ratio": 0.15}, transfer_evaluation=True),
        "transfer-roberta-base": _preset(
            128,
            3e-6,
            2,
            {"rtd_weight": 0.05},
            "roberta-base",
            corrupt={"mask_ratio": 0.15, **_ROBERTA_GENERATOR},
            transfer_evaluation=True,
        ),
        # Supervised DiffCSE as the D2CSE paper built it (Table 8; contrastive with hard negatives + CRTD on all three
        # sentences): DiffCSE's CRTD settings per backbone with SimCSE's supervised optimisation ([inferred]).
        "sup": {**_DIFFCSE_SUP, "corrupt": {"mask_ratio": 0.3}},
        "sup-roberta-base": {
            **_DIFFCSE_SUP,
            "backbone": "roberta-base",
            "corrupt": {"mask_ratio": 0.2, **_ROBERTA_GENERATOR},
        },
        "smoke": {**_SMOKE, "learning_rate": 2e-5, "model": {"rtd_weight": 0.005}, "corrupt": _SMOKE_CORRUPT},
    },
    # DiffAug paper Table 5 and TianduoWang/DiffAug scripts. Sentences are cut to 32 tokens inside the template, so the
    # tokeniser keeps 34 ids ([CLS] + 32 + [SEP]). The reference's global batches are used (2 GPUs × 128 = 256 for
    # semi; the supervised script's gradient accumulation 4 is not reproduced: contrastive batch 128 either way).
    # The scripts evaluate STS-B dev every 50 steps (paper appendix A) and use seed 0 (SimCSE's default is 42).
    "diffaug": {
        "default": _DIFFAUG_SEMI,
        "semi": _DIFFAUG_SEMI,
        "semi-aux": {
            **_DIFFAUG_SEMI,
            "aux_nli_batch_size": 128,
            "model": {"aux_weight": 1e-3},
            "prefix_phase": {"steps": 1500, "learning_rate": 1e-3, "batch_size": 128},
        },
        "sup": {
            **_DIFFAUG,
            "supervised": True,
            "batch_size": 128,
            "learning_rate": 5e-5,
            "epochs": 3,
            "prefix_phase": {"steps": 1250, "learning_rate": 1e-3, "batch_size": 128},
        },
        "smoke": {
            **_SMOKE,
            **_DIFFAUG,
            "max_steps": 20,
            "learning_rate": 2e-5,
            "eval_steps": 10,
            "aux_nli_batch_size": 16,
            "model": {"aux_weight": 1e-3},
            "prefix_phase": {"steps": 10, "learning_rate": 1e-3, "batch_size": 32},
        },
    },
}


# Per method: preset → the one line its prefect.yaml deployment says it reproduces (`cse prefect-yaml` writes the
# deployments from PRESETS and these; a preset without a line gets one made of the method's title and summary).
PRESET_DESCRIPTIONS: dict[str, dict[str, str]] = {
    "d2cse": {
        "default": "D2CSE unsupervised BERT-base (paper Table 7).",
        "single-corruption": "D2CSE unsupervised BERT-base with one corruption per sentence shared by every view and epoch (cheaper, not the reference's).",
        "bert-large": "D2CSE unsupervised BERT-large (paper Table 7, lr 0.034).",
        "roberta-base": "D2CSE unsupervised RoBERTa-base with the [CLS] prompt (paper Table 7, batch 128, lr 0.044, distilroberta generator).",
        "sup": "D2CSE supervised BERT-base on NLI (paper Table 7).",
        "sup-roberta-base": "D2CSE supervised RoBERTa-base on NLI (paper Table 7, batch 256, lr 0.024, P 12, [CLS] prompt).",
        "smoke": "D2CSE smoke run, a pipeline check on a sample: the packaged MiniLM, 40 steps of 32 on the first 2,048 Wiki1M sentences on CPU, prompts at lr 0.1 (the paper's 0.021 is for 2 epochs of 1M sentences).",
        "smoke-demo": "D2CSE demo run (make main), a pipeline check on a sample: the smoke budget, prompts that start as copies of the backbone's [SEP] key/value (not the paper's start), no position shift, lr 0.02.",
    },
    "simcse": {
        "default": "SimCSE unsupervised BERT-base (batch 64, lr 3e-5, 1 epoch).",
        "bert-large": "SimCSE unsupervised BERT-large (batch 64, lr 1e-5, 1 epoch).",
        "roberta-base": "SimCSE unsupervised RoBERTa-base (batch 512, lr 1e-5, 1 epoch).",
        "sup": "SimCSE supervised BERT-base on NLI (batch 512, lr 5e-5, 3 epochs).",
        "sup-bert-large": "SimCSE supervised BERT-large on NLI (batch 512, lr 1e-5, 3 epochs).",
        "sup-roberta-base": "SimCSE supervised RoBERTa-base on NLI.",
        "roberta-large": "SimCSE unsupervised RoBERTa-large.",
        "sup-roberta-large": "SimCSE supervised RoBERTa-large on NLI.",
        "smoke": "SimCSE on the packaged MiniLM, a few dozen steps on CPU.",
    },
    "dcpcse": {
        "default": "DCPCSE unsupervised BERT-base (P 16, batch 256, lr 3e-2).",
        "bert-large": "DCPCSE unsupervised BERT-large.",
        "roberta-base": "DCPCSE unsupervised RoBERTa-base.",
        "roberta-large": "DCPCSE unsupervised RoBERTa-large.",
        "sup": "DCPCSE supervised BERT-base (P 12, batch 256, lr 5e-3, 10 epochs).",
        "sup-bert-large": "DCPCSE supervised BERT-large on NLI.",
        "sup-roberta-base": "DCPCSE supervised RoBERTa-base on NLI.",
        "sup-roberta-large": "DCPCSE supervised RoBERTa-large on NLI.",
        "smoke": "DCPCSE on the packaged MiniLM, a few dozen steps on CPU.",
    },
    "diffcse": {
        "default": "DiffCSE unsupervised BERT-base (lr 7e-6, masking 0.3, lambda 0.005, 2 epochs, a fresh corruption per view and epoch).",
        "roberta-base": "DiffCSE unsupervised RoBERTa-base (masking 0.2, distilroberta generator).",
        "single-corruption": "DiffCSE unsupervised BERT-base with one corruption per sentence shared by every view and epoch (cheaper, not the reference's).",
        "transfer": "DiffCSE BERT-base transfer model (paper Table 13 - lr 2e-6, masking 0.15, lambda 0.05, batch 64), test-evaluated on STS and the 7 SentEval transfer tasks.",
        "transfer-roberta-base": "DiffCSE RoBERTa-base transfer model (paper Table 13 - lr 3e-6, masking 0.15, lambda 0.05, batch 128, distilroberta-base generator).",
        "sup": "Supervised DiffCSE BERT-base on NLI as the D2CSE paper built it (SimCSE's supervised optimisation).",
        "sup-roberta-base": "DiffCSE supervised RoBERTa-base on NLI, as the D2CSE paper built it (hyperparameters inferred).",
        "smoke": "DiffCSE on the packaged MiniLM with a small random generator, a few dozen steps on CPU.",
    },
    "diffaug": {
        "default": "DiffAug semi-supervised BERT-base, the same as `semi` (the preset experiment children start from).",
        "semi": "DiffAug semi-supervised BERT-base (stage 1 NLI 2000 steps, stage 2 Wiki1M).",
        "semi-aux": "DiffAug semi-supervised with the auxiliary NLI loss (alpha 1e-3).",
        "sup": "DiffAug supervised BERT-base (stage 1 1250 steps, stage 2 NLI 3 epochs).",
        "smoke": "DiffAug on the packaged MiniLM, a few prefix steps, then a few joint steps with the auxiliary loss.",
    },
}


def smoke_line(method: str, preset: str = "smoke") -> str:
    """What a smoke run is, in one line (`make main` prints it after its demo job): a pipeline check on a sample,
    scored as the paper scores, whose own scores are not comparable with the paper's row.

    Args:
        method: a method of `PRESETS` (each has a `smoke` preset).
        preset: one of its MiniLM-sized smoke presets (`smoke`, D2CSE's `smoke-demo`).

    Returns:
        The line, with the preset's backbone, steps, batch size and training sentences, and, for prompts that do not
        start as the paper's, what that start already changes.

    Raises:
        KeyError: `method` has no such preset.
    """
    smoke = PRESETS[method][preset]
    start = (
        " Its prompts start as copies of the backbone's own [SEP] key/value, not the paper's random start; that start "
        "alone moves the backbone's scores, so the run beside its backbone shows the start and the training together "
        "(docs/quickstart.md)."
        if smoke.get("model", {}).get("prefix_init") == "sep"
        else ""
    )
    return (
        f"{method}/{preset} is a smoke run: a pipeline check on a sample ({smoke['backbone']}, {smoke['max_steps']} "
        f"steps of {smoke['batch_size']} on the first {smoke['max_train_sentences']:,} Wiki1M sentences), "
        "not the paper's training. The run and its backbone are scored as the paper scores (its seven STS test sets, "
        "Spearman x100), but only the run beside its backbone says what training did: the paper's row is BERT-base "
        f"trained on the full data.{start}"
    )


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge `overrides` into `base`; nested dicts are merged, any other value replaces.

    Args:
        base: the dict to start from (not modified).
        overrides: values that take precedence over `base`.

    Returns:
        A new dict with the merged values.
    """
    out = dict(base)
    for k, v in overrides.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
