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

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from cse.config.stages import GeneratorConfig
from cse.models.corruption import SpecialTokens
from cse.models.generator import (
    HeadFitter,
    MLMFineTuner,
    batches,
    init_bias_from_counts,
    mask_batch,
    masked_lm_predictions,
    token_counts,
    unigram_accuracies,
)
from cse.models.loading import check_same_vocabulary, load_masked_lm, load_tokenizer, pick_device, vocab_fingerprint
from cse.storage.catalog import refresh_catalog
from cse.storage.corruption import token_lists
from cse.storage.datasets import DatasetRef, read_dataset
from cse.storage.generators import GENERATOR_PREFIX, KIND, publish_model_folder
from cse.storage.hashing import stable_hash
from cse.storage.keys import SCHEMA_VERSIONS, generator_key
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest
from cse.storage.settings import get_settings
from cse.tasks.corrupt import generator_identity, load_tokens_tokenizer
from cse.tasks.log import stage_logger
from cse.tracking.lineage import CONTEXT_SOURCE, log_dataset_inputs
from cse.tracking.reporting import markdown_table, publish_artifacts
from cse.tracking.stage_runs import log_dataset_metrics, log_quarantine, log_run_results, stage_run

SCHEMA_VERSION = SCHEMA_VERSIONS["generator"]
PREDICTORS = {  # stats key → what the table calls it
    "fitted": "fitted generator",
    "unigram_argmax": "unigram: always the most frequent training token",
    "unigram_sample": "unigram: a token drawn from the training frequencies (expected)",
    "random_init": "random-init generator",
}


def split_rows(ids: np.ndarray, config: GeneratorConfig) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(train rows, held-out rows, held-out sentence ids): whole sentence ids are held out (every column of an NLI
    row together), `min(max_heldout, round(heldout_fraction × ids))` of them, by a permutation seeded `split_seed`."""
    unique = np.unique(ids)
    n_held = min(config.max_heldout, round(config.heldout_fraction * len(unique)))
    if n_held < 1 or n_held >= len(unique):
        raise ValueError(
            f"the tokens dataset has {len(unique)} sentence ids: too few to hold out "
            f"{config.heldout_fraction:.0%} (at most {config.max_heldout}) and train on the rest"
        )
    held_ids = np.sort(np.random.default_rng(config.split_seed).permutation(unique)[:n_held])
    is_held = np.isin(ids, held_ids)
    return np.flatnonzero(~is_held), np.flatnonzero(is_held), held_ids.tolist()


def _subset(flat: torch.Tensor, offsets: np.ndarray, rows: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    lengths = offsets[rows + 1] - offsets[rows]
    index = (
        np.concatenate([np.arange(offsets[r], offsets[r + 1]) for r in rows]) if len(rows) else np.zeros(0, np.int64)
    )
    return flat[torch.from_numpy(index)], np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _accuracy(predicted: torch.Tensor, targets: torch.Tensor) -> float:
    return float((predicted == targets).float().mean()) if len(targets) else 0.0


def accuracy_markdown(accuracy: dict[str, float], positions: int, sentences: int) -> str:
    """A markdown table of held-out masked-token top-1 accuracy per predictor (`accuracy`: `PREDICTORS` key →
    accuracy) over `positions` masked positions of `sentences` held-out sentences."""
    rows = [{"predictor": PREDICTORS[k], "top-1 accuracy": f"{accuracy[k]:.4f}"} for k in PREDICTORS if k in accuracy]
    return markdown_table(
        rows,
        title=f"Held-out masked-token top-1 accuracy ({positions:,d} masked positions of "
        f"{sentences:,d} held-out sentences)",
    )


def _fit(root: DataRoot, tokens: Manifest, config: GeneratorConfig, key: str, run_id: str) -> Manifest:  # noqa: C901 (the stage's steps in order; each check fails with its reason)
    log = stage_logger()
    t_start = time.perf_counter()
    tokenizer_name, tokenizer = load_tokens_tokenizer(tokens)
    check_same_vocabulary(tokenizer, load_tokenizer(config.backbone), tokenizer_name, config.backbone)
    special = SpecialTokens.from_tokenizer(tokenizer)
    device = pick_device(config.device)

    table = read_dataset(root, "tokens", tokens.key, columns=["id", "input_ids"])
    flat, offsets = token_lists(table.column("input_ids"))
    flat = torch.from_numpy(flat.astype(np.int64))
    train_rows, held_rows, held_ids = split_rows(table.column("id").to_numpy(), config)
    train_flat, train_offsets = _subset(flat, offsets, train_rows)
    held_flat, held_offsets = _subset(flat, offsets, held_rows)
    counts = token_counts(train_flat.numpy(), special.vocab_size, special.special)

    with torch.random.fork_rng():
        torch.manual_seed(config.seed)  # the head's random init
        model = load_masked_lm(config.backbone)
    if config.bias_init == "unigram":
        init_bias_from_counts(model, counts)
    steps_per_epoch = math.ceil(len(train_rows) / config.batch_size)
    planned = steps_per_epoch * config.epochs * config.reuse
    total = min(config.max_steps or planned, planned)
    warmup = round(config.warmup_ratio * total)
    if config.backbone_lr is None:  # the MLM head on the frozen backbone
        fitter = HeadFitter(model, special.vocab_size, config.lr, config.weight_decay, total, warmup, device)
    else:  # full MLM fine-tuning
        fitter = MLMFineTuner(
            model, special.vocab_size, config.lr, config.backbone_lr, config.weight_decay, total, warmup, device
        )

    # The held-out positions: masked once (seeded by split_seed); a frozen backbone's features computed once.
    held_gen = torch.Generator().manual_seed(stable_seed(config.split_seed, "heldout"))
    held_batches = [
        mask_batch(held_flat, held_offsets, rows, special, config.mask_ratio, held_gen)
        for rows in batches(len(held_rows), config.batch_size, None)
    ]
    targets = torch.cat([b.targets for b in held_batches])
    if isinstance(fitter, HeadFitter):
        held_features = torch.cat([fitter.features(b) for b in held_batches])
        predict = lambda: fitter.predict(held_features)
    else:
        predict = lambda: fitter.predict(held_batches)
    accuracy: dict[str, float] = unigram_accuracies(counts, targets.numpy())
    if config.baseline_generator:
        check_same_vocabulary(
            tokenizer, load_tokenizer(config.baseline_generator), tokenizer_name, config.baseline_generator
        )
        baseline = load_masked_lm(config.baseline_generator)
        accuracy["random_init"] = _accuracy(
            torch.cat([masked_lm_predictions(baseline, b, special.vocab_size, device) for b in held_batches]), targets
        )
        del baseline

    def evaluate(step: int, loss: float | None) -> dict[str, float]:
        acc = _accuracy(predict(), targets)
        entry = {"step": step, "heldout_top1": acc, **({"train_loss": loss} if loss is not None else {})}
        log_dataset_metrics({k: v for k, v in entry.items() if k != "step"}, run_id=run_id, step=step)
        return entry

    history = [evaluate(0, None)]
    train_gen = torch.Generator().manual_seed(config.seed)
    bar = tqdm(total=total, unit="step", desc=f"fit generator {key[:12]}")
    losses: list[float] = []
    epoch = 0
    while fitter.steps < total:  # an epoch: fresh masks over the shuffled training split, chunk by chunk
        steps_before = fitter.steps
        epoch_batches = list(batches(len(train_rows), config.batch_size, train_gen))
        for start in range(0, len(epoch_batches), config.chunk_batches):
            chunk = [
                mask_batch(train_flat, train_offsets, rows, special, config.mask_ratio, train_gen)
                for rows in epoch_batches[start : start + config.chunk_batches]
            ]
            if isinstance(fitter, HeadFitter):
                cached = [(fitter.features(b), b.targets) for b in chunk if len(b.targets)]
            else:  # (reuse is 1: each batch runs through the unfrozen backbone once)
                cached = [(b,) for b in chunk if len(b.targets)]
            for _ in range(config.reuse):
                for i in torch.randperm(len(cached), generator=train_gen).tolist():
                    losses.append(fitter.step(*cached[i]))
                    bar.update(1)
                    if fitter.steps % config.eval_every == 0 or fitter.steps == total:
                        history.append(evaluate(fitter.steps, float(np.mean(losses[-config.eval_every :]))))
                        bar.set_postfix(
                            loss=f"{history[-1]['train_loss']:.3f}", heldout_top1=f"{history[-1]['heldout_top1']:.4f}"
                        )
                    if fitter.steps >= total:
                        break
                if fitter.steps >= total:
                    break
            if fitter.steps >= total:
                break
        epoch += 1
        if fitter.steps == steps_before:
            raise ValueError(
                f"tokens dataset {tokens.key}: no token was masked in a whole epoch (mask_ratio "
                f"{config.mask_ratio}, {len(train_rows)} training rows): nothing to fit"
            )
    bar.close()
    accuracy["fitted"] = history[-1]["heldout_top1"]
    seconds = time.perf_counter() - t_start
    stats: dict[str, Any] = {
        "heldout_top1": accuracy,
        "heldout_sentences": len(held_ids),
        "heldout_positions": int(len(targets)),
        "train_rows": int(len(train_rows)),
        "heldout_rows": int(len(held_rows)),
        "steps": fitter.steps,
        "epochs_started": epoch,
        "final_train_loss": history[-1].get("train_loss"),
        "seconds": seconds,
        "history": history,
    }
    log.info(
        "generator %s: held-out top-1 %s in %d steps (%.0f s)",
        key,
        ", ".join(f"{k} {v:.4f}" for k, v in accuracy.items()),
        fitter.steps,
        seconds,
    )
    params = {
        "backbone": config.backbone,
        "tokenizer": tokenizer_name,
        "tokenizer_fingerprint": tokens.params.get("tokenizer_fingerprint"),
        "vocab_fingerprint": vocab_fingerprint(tokenizer),
        "config": config.model_dump(),
        "device": str(device),
        "schema_version": SCHEMA_VERSION,
    }
    heldout = {
        "split_seed": config.split_seed,
        "heldout_fraction": config.heldout_fraction,
        "max_heldout": config.max_heldout,
        "mask_seed": stable_seed(config.split_seed, "heldout"),
        "mask_ratio": config.mask_ratio,
        "tokens_key": tokens.key,
        "ids": held_ids,
    }
    model.cpu()
    for p in model.parameters():
        p.requires_grad_(True)  # saved as a plain masked LM

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    manifest = publish_model_folder(
        root,
        key,
        write,
        heldout=heldout,
        params=params,
        stats=stats,
        inputs={"tokens": tokens.content_hash},
        source={"tokens_key": tokens.key, "backbone": config.backbone},
    )
    refresh_catalog(root)
    return manifest


def stable_seed(seed: int, what: str) -> int:
    """A deterministic 63-bit seed derived from `seed` and what it is for (other purposes: independent seeds)."""
    return int(stable_hash({"seed": seed, "what": what}), 16) & (2**63 - 1)


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
            if not cached:
                manifest = _fit(root, tokens, config, key, run_id)
        _log_run(run_id, tokens, manifest, cached)
    ref = DatasetRef.of(root, manifest, cache_hit=cached)
    stage_logger().info("generator %s (%s): %s", ref.key, "cache hit" if cached else "written", ref.path)
    return ref
