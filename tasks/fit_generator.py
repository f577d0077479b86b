"""Fit a masked-LM generator on a frozen encoder from a tokens dataset, and publish it as dataset `generator/<key>`.

The head is BERT's MLM head on the frozen backbone (models/generator.py), fitted with BERT's 80/10/10 masking at
`mask_ratio`; with `backbone_lr` set, the whole masked LM is fine-tuned instead (the backbone unfrozen, at that
rate). A fixed held-out split of the corpus (a seeded permutation of the sentence ids, `split_seed`; the ids
are recorded in the folder's `heldout.json`) is masked once with a seed of its own, and on those same held-out
positions the stage scores top-1 accuracy of:
- `fitted`: the fitted generator;
- `unigram_argmax`: always the most frequent non-special token of the training split;
- `unigram_sample`: a token drawn from the training split's non-special frequencies (expected accuracy, exact), what
  `corrupt.mode: unigram` replaces with;
- `random_init`: `baseline_generator` (default the smoke presets' `random-init:distilbert-tiny`), in eval mode.
They go into the manifest stats, the stage's MLflow run (metrics and `generator_accuracy.md`) and a Prefect markdown
artifact. The key hashes the tokens' content, the tokenizer and backbone identities and the whole config, so a rerun
is a cache hit (verified first; a damaged folder is quarantined and refitted). The folder is written to a temporary
sibling and published by one rename: a killed fit leaves nothing that looks complete (the fit restarts from scratch).

`fit_generator.fn(tokens_key, config)` is the plain Python entry (no Prefect server needed); pass the result as
`CorruptConfig(generator=f"generator:{ref.key}")` or `generator=ref.path`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from transformers import PreTrainedModel

from cse.config.stages import GeneratorConfig
from cse.models.corruption import SpecialTokens
from cse.models.loading import check_same_vocabulary, load_masked_lm, load_tokenizer, pick_device, vocab_fingerprint
from cse.storage.catalog import refresh_catalog
from cse.storage.corruption import token_lists
from cse.storage.datasets import DatasetRef, read_dataset
from cse.storage.generators import GENERATOR_PREFIX, KIND, publish_model_folder
from cse.storage.keys import SCHEMA_VERSIONS, generator_key
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest
from cse.storage.settings import get_settings
from cse.tasks.corrupt import generator_identity, load_tokens_tokenizer
from cse.tasks.log import stage_logger
from cse.tracking.lineage import CONTEXT_SOURCE, log_dataset_inputs
from cse.tracking.reporting import markdown_table, publish_artifacts
from cse.tracking.stage_runs import log_dataset_metrics, log_quarantine, log_run_results, stage_run
from cse.training.generator import GeneratorFit, fit_masked_lm, stable_seed

SCHEMA_VERSION = SCHEMA_VERSIONS["generator"]
PREDICTORS = {  # stats key → what the table calls it
    "fitted": "fitted generator",
    "unigram_argmax": "unigram: always the most frequent training token",
    "unigram_sample": "unigram: a token drawn from the training frequencies (expected)",
    "random_init": "random-init generator",
}


def accuracy_markdown(accuracy: dict[str, float], positions: int, sentences: int) -> str:
    """A markdown table of held-out masked-token top-1 accuracy per predictor (`accuracy`: `PREDICTORS` key →
    accuracy) over `positions` masked positions of `sentences` held-out sentences."""
    rows = [{"predictor": PREDICTORS[k], "top-1 accuracy": f"{accuracy[k]:.4f}"} for k in PREDICTORS if k in accuracy]
    return markdown_table(
        rows,
        title=f"Held-out masked-token top-1 accuracy ({positions:,d} masked positions of "
        f"{sentences:,d} held-out sentences)",
    )


def _fit(root: DataRoot, tokens: Manifest, config: GeneratorConfig, key: str, run_id: str) -> Manifest:
    """Fit generator `key` of `config` on `tokens` (`cse.training.generator.fit_masked_lm`; the held-out scores
    logged on the stage's run `run_id`) and publish its folder with its held-out split, params and stats."""
    log = stage_logger()
    t_start = time.perf_counter()
    tokenizer_name, tokenizer = load_tokens_tokenizer(tokens)
    check_same_vocabulary(tokenizer, load_tokenizer(config.backbone), tokenizer_name, config.backbone)
    device = pick_device(config.device)
    table = read_dataset(root, "tokens", tokens.key, columns=["id", "input_ids"])
    flat, offsets = token_lists(table.column("input_ids"))

    def load_baseline() -> PreTrainedModel | None:
        if not config.baseline_generator:
            return None
        baseline = config.baseline_generator
        check_same_vocabulary(tokenizer, load_tokenizer(baseline), tokenizer_name, baseline)
        return load_masked_lm(baseline)

    fit = fit_masked_lm(
        torch.from_numpy(flat.astype(np.int64)),
        offsets,
        table.column("id").to_numpy(),
        SpecialTokens.from_tokenizer(tokenizer),
        config,
        device,
        load_baseline=load_baseline,
        log_metrics=lambda metrics, step: log_dataset_metrics(metrics, run_id=run_id, step=step),
        name=tokens.key,
        desc=f"fit generator {key[:12]}",
    )
    seconds = time.perf_counter() - t_start
    log.info(
        "generator %s: held-out top-1 %s in %d steps (%.0f s)",
        key,
        ", ".join(f"{k} {v:.4f}" for k, v in fit.accuracy.items()),
        fit.steps,
        seconds,
    )

    def write(folder: Path) -> None:
        fit.model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    manifest = publish_model_folder(
        root,
        key,
        write,
        heldout=_heldout_record(tokens, config, fit),
        params=_params(tokens, config, tokenizer_name, tokenizer, device),
        stats=_stats(fit, seconds),
        inputs={"tokens": tokens.content_hash},
        source={"tokens_key": tokens.key, "backbone": config.backbone},
    )
    refresh_catalog(root)
    return manifest


def _stats(fit: GeneratorFit, seconds: float) -> dict[str, Any]:
    """The generator dataset's stats: held-out accuracy per predictor, the split's sizes, the fit and its history."""
    return {
        "heldout_top1": fit.accuracy,
        "heldout_sentences": len(fit.heldout_ids),
        "heldout_positions": int(fit.heldout_positions),
        "train_rows": int(fit.train_rows),
        "heldout_rows": int(fit.heldout_rows),
        "steps": fit.steps,
        "epochs_started": fit.epochs,
        "final_train_loss": fit.history[-1].get("train_loss"),
        "seconds": seconds,
        "history": fit.history,
    }


def _params(
    tokens: Manifest, config: GeneratorConfig, tokenizer_name: str, tokenizer: Any, device: torch.device
) -> dict[str, Any]:
    """The generator dataset's params: backbone, tokenizer identities, the whole config, device, schema."""
    return {
        "backbone": config.backbone,
        "tokenizer": tokenizer_name,
        "tokenizer_fingerprint": tokens.params.get("tokenizer_fingerprint"),
        "vocab_fingerprint": vocab_fingerprint(tokenizer),
        "config": config.model_dump(),
        "device": str(device),
        "schema_version": SCHEMA_VERSION,
    }


def _heldout_record(tokens: Manifest, config: GeneratorConfig, fit: GeneratorFit) -> dict[str, Any]:
    """The folder's `heldout.json`: how the held-out split was drawn and masked, and its sentence ids."""
    return {
        "split_seed": config.split_seed,
        "heldout_fraction": config.heldout_fraction,
        "max_heldout": config.max_heldout,
        "mask_seed": stable_seed(config.split_seed, "heldout"),
        "mask_ratio": config.mask_ratio,
        "tokens_key": tokens.key,
        "ids": fit.heldout_ids,
    }


def _log_run(run_id: str, tokens: Manifest, manifest: Manifest, cached: bool) -> None:
    log_dataset_inputs(run_id, [(tokens, CONTEXT_SOURCE)])
    stats = manifest.stats
    accuracy = stats.get("heldout_top1", {})
    md = accuracy_markdown(accuracy, stats.get("heldout_positions", 0), stats.get("heldout_sentences", 0))
    log_run_results(
        run_id,
        metrics={
            "cache_hit": float(cached),
            **{f"heldout_top1_{k}": v for k, v in accuracy.items()},
            "seconds": float(stats.get("seconds", 0.0)),
            "steps": float(stats.get("steps", 0)),
        },
        tags={
            "key": manifest.key,
            "tokens_key": tokens.key,
            "content_hash": manifest.content_hash,
            "generator": f"{GENERATOR_PREFIX}{manifest.key}",
        },
        texts={"generator_accuracy.md": md},
    )
    publish_artifacts(markdown={"generator-accuracy": (md, f"generator {manifest.key}: held-out top-1 accuracy")})


@task(name="fit-generator", cache_policy=NO_CACHE)
def fit_generator(tokens_key: str, config: GeneratorConfig = GeneratorConfig(), verify: bool = False) -> DatasetRef:
    """Fit (or reuse) the generator of `config` on tokens dataset `tokens_key`; returns dataset `generator/<key>`.

    Args:
        tokens_key: a tokens dataset of the data root (the tokenize stage's output).
        config: the head, masking, split and schedule (config/stages.py `GeneratorConfig`).
        verify: a cache hit also checks the sha256 of every file it reuses.
    """
    root = DataRoot(get_settings().data_root)
    tokens = root.require("tokens", tokens_key)
    key = generator_key(
        tokens.content_hash,
        tokens.params.get("tokenizer_fingerprint"),
        generator_identity(config.backbone),
        config.model_dump(exclude={"device"}),
    )
    params = {"tokens_key": tokens_key, **config.model_dump()}
    with stage_run("data", "fit-generator", params=params) as run:
        run_id = run.info.run_id
        with root.building(KIND, key):
            manifest, quarantined = root.reuse(KIND, key, full=verify)
            if quarantined is not None:
                log_quarantine(quarantined, stage_logger(), run_id=run_id)
            cached = manifest is not None
            if manifest is None:
                manifest = _fit(root, tokens, config, key, run_id)
        _log_run(run_id, tokens, manifest, cached)
    ref = DatasetRef.of(root, manifest, cache_hit=cached)
    stage_logger().info("generator %s (%s): %s", ref.key, "cache hit" if cached else "written", ref.path)
    return ref
