"""Throughput of the stage's corruption function vs the bare generator forward pass (full logits).

Both run on the same sentences, the same length-sorted batches and the same device; prints one
JSON object with sentences/s of each and their ratio (target >= 0.9).

    python -m benchmarks.corruption_throughput [--generator distilbert-base-uncased] [--sentences 2048]
        [--batch-size 256] [--device auto] [--mask-ratio 0.3] [--mode argmax] [--repeats 1]

The generator runs in train mode (dropout on) as the stage's reference default does
(`--no-generator-dropout` for the cheaper setting; `--positions all` for the reference's argmax at every
position). `projected_minutes` turns the stage's rate into the cost of the faithful default corruption of each
paper preset (a fresh corruption for every view of every epoch: rows × columns × variants sentences) on the
device measured, beside the single-corruption option.

The default generator is `distilbert-base-uncased` from the local HF cache; without it a random
DistilBERT of the same size with the bert-base-uncased vocabulary (`random-init:distilbert-base-uncased`)
stands in, which runs at the same speed. A local model folder works too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from benchmarks.machine import SHARED_DATA, timed
from cse.models.corruption import Corruptor, SpecialTokens, corrupt_sequences, pad_batch
from cse.models.loading import is_random_init, load_masked_lm, load_tokenizer, pick_device, resolve_model_path

FALLBACK = "random-init:distilbert-base-uncased"
TARGET = 0.9
WIKI1M, NLI = 1_000_000, 275_601


def workloads() -> dict[str, int]:
    """Sentences the corruption stage generates for each paper preset of every method that reads corrupted ids
    (`cse.config.methods.REGISTRY`; the smoke presets left out): rows × columns × variants (the preset's
    `corrupt.variants`, else `cse.config.training.required_variants`); presets with the same workload share a line."""
    from cse.config.methods import REGISTRY
    from cse.config.training import required_variants, resolve_train_config

    groups: dict[tuple[str, int, int], list[str]] = {}
    for method, spec in REGISTRY.items():
        if not spec.uses_corruption:
            continue
        for preset in spec.presets:
            if preset.startswith("smoke"):
                continue
            cfg = resolve_train_config(preset, method=method)
            variants = cfg.corrupt.variants or required_variants(cfg.epochs, cfg.supervised)
            data, rows, columns = ("NLI", NLI, 3) if cfg.supervised else ("Wiki1M", WIKI1M, 1)
            groups.setdefault((data, rows, columns, variants), []).append(f"{method}/{preset}")
    return {
        f"{', '.join(names)} ({data}, {columns} column(s) x {variants} variant(s))": rows * columns * variants
        for (data, rows, columns, variants), names in groups.items()
    }


def load_generator(name: str) -> tuple[torch.nn.Module, object, str]:
    """(model, tokenizer, name used): a hub id is read from the local cache only, else the random stand-in."""
    if is_random_init(name) or Path(resolve_model_path(name)).is_dir():
        return load_masked_lm(name), load_tokenizer(name), name
    try:
        model = load_masked_lm(name, local_files_only=True)
    except OSError:
        return load_masked_lm(FALLBACK), load_tokenizer(FALLBACK), f"{FALLBACK} ({name} not in the local HF cache)"
    from transformers import AutoTokenizer

    return model, AutoTokenizer.from_pretrained(name, local_files_only=True), name


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generator", default="distilbert-base-uncased")
    p.add_argument("--sentences", type=int, default=2048)
    p.add_argument("--data", default=str(SHARED_DATA / "wiki1m_head.txt"))
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--mask-ratio", type=float, default=0.3)
    p.add_argument("--mode", default="argmax", choices=["argmax", "sample"])
    p.add_argument("--no-bf16", action="store_true", help="no bf16 autocast on GPU")
    p.add_argument("--repeats", type=int, default=1, help="timed passes of each (alternating); the best counts")
    p.add_argument("--no-generator-dropout", action="store_true", help="generator in eval mode (not the reference)")
    p.add_argument("--positions", default="masked", choices=["masked", "all"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = pick_device(args.device)
    model, tokenizer, used = load_generator(args.generator)
    lines = Path(args.data).read_text(encoding="utf-8").splitlines()[: args.sentences]
    seqs = tokenizer(lines, truncation=True, max_length=32)["input_ids"]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    flat = np.concatenate(seqs).astype(np.int64)

    bf16 = not args.no_bf16
    corruptor = Corruptor(
        model,
        SpecialTokens.from_tokenizer(tokenizer),
        args.mask_ratio,
        args.mode,
        device=device,
        bf16=bf16,
        dropout=not args.no_generator_dropout,
        all_positions=args.positions == "all",
    )
    flat_t = torch.from_numpy(flat)
    order = np.argsort(-np.diff(offsets), kind="stable")  # the same batches corrupt_sequences builds
    batches = [
        pad_batch(flat_t, offsets, order[i : i + args.batch_size], tokenizer.pad_token_id)[:2]
        for i in range(0, len(seqs), args.batch_size)
    ]

    @torch.inference_mode()
    def bare() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=corruptor.autocast):
            for ids, attention in batches:
                _ = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits

    def stage() -> None:
        corrupt_sequences(corruptor, flat, offsets, torch.Generator().manual_seed(0), args.batch_size)

    warm = slice(0, int(offsets[min(len(seqs), 32)]))  # warm-up on the first 32 sentences
    corrupt_sequences(corruptor, flat[warm], offsets[:33] if len(seqs) > 32 else offsets, torch.Generator(), 32)
    bare_times, stage_times = [], []
    for _ in range(args.repeats):
        bare_times.append(timed(bare, device))
        stage_times.append(timed(stage, device))
    result = report(args, used, device, corruptor, len(seqs), int(len(flat)), bare_times, stage_times)
    print(json.dumps(result, indent=2))
    return result


def report(args, used: str, device, corruptor, n: int, tokens: int, bare_times, stage_times) -> dict:
    """The result: the best pass's sentences per second of the bare forward and of the stage, their ratio against the
    target, and the projected minutes of each workload."""
    result = {
        "generator": used,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "autocast_bf16": corruptor.autocast,
        "sentences": n,
        "tokens": tokens,
        "batch_size": args.batch_size,
        "mask_ratio": args.mask_ratio,
        "mode": args.mode,
        "repeats": args.repeats,
        "bare_forward_sentences_per_s": round(n / min(bare_times), 1),
        "corruption_sentences_per_s": round(n / min(stage_times), 1),
        "generator_dropout": not args.no_generator_dropout,
        "positions": args.positions,
    }
    rate = result["corruption_sentences_per_s"]
    result["ratio"] = round(rate / result["bare_forward_sentences_per_s"], 3)
    result["projected_minutes"] = {name: round(n_sent / rate / 60, 1) for name, n_sent in workloads().items()}
    result |= {"target": TARGET, "meets_target": result["ratio"] >= TARGET}
    return result


if __name__ == "__main__":
    main()
