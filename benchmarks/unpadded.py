"""Unpadded passes on real Wiki1M rows: the real-token fill, and the FLOPs and time a step saves (CPU rehearsal).

    python -m benchmarks.unpadded [--wiki ../shared/data/wiki1m_head.txt] [--max-length 32] [--batch 64]
        [--methods simcse,d2cse] [--layers 2] [--step-batch 16] [--steps 3] [--out DIR] [--batches-only N]

Part 1, the fill: the shared Wiki1M sample tokenised as the tokenisation stage does (bert-base-uncased's vocabulary,
truncation at `--max-length`, [CLS] … [SEP]): real tokens per row, the share of the padded positions they fill, the
share of sentences truncated, and the fill of every full batch of `--batch` rows over two epochs' orders
(`cse.training.rows.epoch_order`): its largest value is the least `speed.unpadded_fill` that never overflows on
this sample (the whole Wiki1M has more batches, so its largest batch fill can be higher: leave a margin).

Part 2, one step (CPU; labelled so in the report): each method's default preset on a random BERT of BERT-base width
(768, 12 heads) and `--layers` layers, `--step-batch` real Wiki1M rows per batch (CRTD methods: 30 % random
replacements as corruption; which tokens are replaced changes neither FLOPs nor time), forward + backward
(`time_packed_step`): FLOPs (FlopCounterMode: matmuls and attention) and median wall ms, padded to max_length and
unpadded at the sample's largest batch fill. A D2CSE/DiffCSE discriminator pass stays padded under the default RTD
mean over padding, so their saving is the encoder pass's.

`--batches-only N`: batch building alone (`batch_build_ms`): the former row-by-row padding against
`TrainingRows.batch`'s one gather per record batch, on the sample replicated to N memory-layout rows.

`time_packed_step` is the entry point a GPU measurement calls to time the packed step beside the padded one
(`make gpu-speed`); `wiki_training_rows` gives it real rows as a job batches them. GPU figures are not measured here.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.machine import SHARED_DATA, command_line, cpu_environment, set_offline_environment, sync
from cse.config.methods import REGISTRY
from cse.storage.training_data import CorruptionRows, TokenRows
from cse.training.rows import TrainingRows, epoch_order

DEFAULT_WIKI = SHARED_DATA / "wiki1m_head.txt"


def wiki_sequences(path: Path, tokenizer: Any, max_length: int | None) -> list[np.ndarray]:
    """The sample's lines as the tokenisation stage encodes them (an empty line as one space, SimCSE's rule;
    `max_length` None: not truncated)."""
    texts = [t if t.strip() else " " for t in path.read_text(encoding="utf-8").splitlines()]
    kwargs: dict[str, Any] = {"truncation": True, "max_length": max_length} if max_length else {"truncation": False}
    ids = tokenizer(texts, add_special_tokens=True, **kwargs)["input_ids"]
    return [np.asarray(s, dtype=np.int64) for s in ids]


def fill_figures(lengths: np.ndarray, full_lengths: np.ndarray, max_length: int, batch: int, seed: int = 42) -> dict:
    """Real tokens per row, the padded positions' fill, the truncated share and the fill of every full batch of
    `batch` rows over two epochs' orders (a pass over a batch's views fills as its rows do).

    Args:
        lengths: tokens per row after truncation at `max_length`.
        full_lengths: tokens per row untruncated.
        max_length: the padded length.
        batch: rows per batch.
        seed: the epoch orders' seed.
    """
    fills = []
    for epoch in range(2):
        order = epoch_order(len(lengths), seed, epoch)
        for start in range(0, len(order) - batch + 1, batch):
            fills.append(float(lengths[order[start : start + batch]].sum()) / (batch * max_length))
    top = max(fills)
    return {
        "rows": len(lengths),
        "max_length": max_length,
        "mean_real_tokens": round(float(lengths.mean()), 2),
        "fill": round(float(lengths.mean()) / max_length, 4),
        "truncated_share": round(float((full_lengths > max_length).mean()), 4),
        "batch_size": batch,
        "batches": len(fills),
        "batch_fill_median": round(statistics.median(fills), 4),
        "batch_fill_max": round(top, 4),
        "least_safe_fill": math.ceil(top * 100) / 100,
    }


def wiki_training_rows(method: str, cfg: Any, seqs: list[np.ndarray], seed: int = 0) -> TrainingRows:
    """Training rows of real Wiki1M sequences as a job batches them (padded to `cfg.max_length`); a method that reads
    corruption gets 30 % random replacements (bert-base-uncased ids ≥ 1000; [CLS]/[SEP] kept), one variant per view.

    Args:
        method: the registered method name.
        cfg: its training config (`max_length`, `supervised`).
        seqs: the tokenised rows (`wiki_sequences`).
        seed: the corruption's seed.
    """
    from cse.config.methods import model_class

    tokens = TokenRows(ids=np.arange(len(seqs)), seqs={"text": seqs})
    corruption = None
    if model_class(method).uses_corruption:
        rng = np.random.default_rng(seed)
        cor, lab = {}, {}
        for v in range(2):
            new = []
            for s in seqs:
                pick = rng.random(len(s)) < 0.3
                pick[0] = pick[-1] = False
                new.append(np.where(pick, rng.integers(1000, 30522, len(s)), s))
            cor[("text", v)] = new
            lab[("text", v)] = [(a != b).astype(np.int8) for a, b in zip(new, seqs)]
        corruption = CorruptionRows(variants=2, corrupted=cor, labels=lab)
    return TrainingRows(tokens, corruption, False, pad_id=0, pad_to=cfg.max_length)


def row_by_row_batch(rows: TrainingRows, order: np.ndarray, epoch: int) -> dict[str, torch.Tensor]:
    """A batch as `TrainingRows.batch` built it before its one-gather form: every row of every view padded in Python
    (`pad_sequences`), then stacked (the reference of tests/training/test_rows.py and of `batch_build_ms`).

    Args:
        rows: the training rows.
        order: the batch's row indices.
        epoch: the epoch (which corruption variant each view reads).
    """
    from cse.models.batching import pad_sequences
    from cse.storage.training_data import take_rows

    views = [take_rows(rows.tokens.seqs[c], order) for c in rows.view_columns]
    length = rows.pad_to or max(len(s) for view in views for s in view)
    ids, mask = zip(*(pad_sequences(view, rows.pad_id, length) for view in views))
    out = {"input_ids": torch.stack(ids, 1), "attention_mask": torch.stack(mask, 1)}
    if rows.corruption is not None:
        cor, lab = [], []
        for v, c in enumerate(rows.view_columns):
            var = rows.variant(epoch, v)
            cor.append(pad_sequences(take_rows(rows.corruption.corrupted[(c, var)], order), rows.pad_id, length)[0])
            lab.append(pad_sequences(take_rows(rows.corruption.labels[(c, var)], order), 0, length)[0])
        out.update(corrupted_ids=torch.stack(cor, 1), rtd_labels=torch.stack(lab, 1))
    return out


def batch_build_ms(seqs: list[np.ndarray], n: int, batches: int = 300, max_length: int = 32) -> dict:
    """Milliseconds per batch of 64 rows (2 views; ids, 2 corruption variants' ids and labels), row by row
    (`row_by_row_batch`) and by `TrainingRows.batch`, on `ArrowLists` of `seqs` replicated to `n` rows in
    16,384-row record batches (the Arrow copies' layout), in the first epoch's order."""
    import pyarrow as pa

    from cse.storage.training_data import ArrowLists

    def mapped(data: list[np.ndarray]) -> ArrowLists:
        chunks = [pa.array([r.tolist() for r in data[k : k + 16384]], pa.list_(pa.int32())) for k in range(0, n, 16384)]
        return ArrowLists(pa.chunked_array(chunks), np.arange(len(data)))

    rng = np.random.default_rng(0)
    rows = [seqs[i % len(seqs)] for i in range(n)]
    cor = {("text", v): mapped([np.where(rng.random(len(r)) < 0.3, 2000, r) for r in rows]) for v in range(2)}
    lab = {("text", v): mapped([(rng.random(len(r)) < 0.3).astype(np.int8) for r in rows]) for v in range(2)}
    tokens = TokenRows(np.arange(n), {"text": mapped(rows)})
    training = TrainingRows(tokens, CorruptionRows(2, cor, lab), False, 0, max_length)
    order = epoch_order(n, 42, 0)
    parts = [order[k : k + 64] for k in range(0, 64 * batches, 64)]
    out: dict[str, Any] = {"rows": n, "record_batch_rows": 16384, "batches": batches, "batch_size": 64}
    for name, build in (("row_by_row_ms", row_by_row_batch), ("one_gather_ms", TrainingRows.batch)):
        build(training, parts[0], 0)
        start = time.perf_counter()
        for part in parts:
            build(training, part, 0)
        out[name] = round((time.perf_counter() - start) / batches * 1e3, 2)
    return out


def _one_step(model: Any, batch: Any, phase: str) -> None:
    model.zero_grad(set_to_none=True)
    model.training_step(batch, 0, phase).loss.backward()


def time_packed_step(
    model: Any, batch: Any, phase: str, fill: float, steps: int = 3, warmup: int = 1, flops: bool = True
) -> dict:
    """Forward + backward of `model`'s training step on `batch` (on the model's device), padded and unpadded at
    `fill` (`CSEModel.use_unpadded`): median wall ms over `steps` after `warmup`, and FLOPs (FlopCounterMode) of one
    step. The model is left padded.

    Args:
        model: a method's model in train mode, on its device.
        batch: a `TrainBatch` on that device.
        phase: the training phase.
        fill: the unpadded budget's share of the padded positions.
        steps: timed steps per mode.
        warmup: untimed steps first.
        flops: count FLOPs too (one more step per mode).

    Returns:
        `{"padded": {...}, "unpadded": {...}, "fill", "real_tokens", "padded_positions", "flop_ratio", "time_ratio"}`.
    """
    from torch.utils.flop_counter import FlopCounterMode

    device = next(model.parameters()).device
    out: dict[str, Any] = {
        "fill": fill,
        "real_tokens": int(batch.attention_mask.sum()),
        "padded_positions": int(batch.attention_mask.numel()),
    }
    try:
        for mode, setting in (("padded", None), ("unpadded", fill)):
            model.use_unpadded(setting)
            for _ in range(warmup):
                _one_step(model, batch, phase)
            times = []
            for _ in range(steps):
                sync(device)
                start = time.perf_counter()
                _one_step(model, batch, phase)
                sync(device)
                times.append((time.perf_counter() - start) * 1e3)
            row: dict[str, Any] = {"ms_median": round(statistics.median(times), 1), "ms": [round(t, 1) for t in times]}
            if flops:
                counter = FlopCounterMode(display=False)
                with counter:
                    _one_step(model, batch, phase)
                row["flops"] = int(counter.get_total_flops())
                row["gflop"] = round(row["flops"] / 1e9, 2)
            out[mode] = row
    finally:
        model.use_unpadded(None)
    if flops:
        out["flop_ratio"] = round(out["unpadded"]["flops"] / out["padded"]["flops"], 4)
    out["time_ratio"] = round(out["unpadded"]["ms_median"] / out["padded"]["ms_median"], 4)
    return out


def step_rows(method: str, seqs: list[np.ndarray], fill: float, args: argparse.Namespace) -> dict:
    """`time_packed_step` of one method on real rows (see the module docstring, part 2)."""
    from benchmarks.gpu_check import build_model, preset, synthetic_tokenizer

    cfg = preset(method, "base", args.step_batch, args.max_length)
    model = build_model(method, cfg, "base", synthetic_tokenizer(), seed=0, layers=args.layers).train()
    rows = wiki_training_rows(method, cfg, seqs)
    batch = rows.batch(epoch_order(len(rows), 42, 0)[: args.step_batch], 0)
    result = time_packed_step(model, batch, "main", fill, steps=args.steps)
    return {"method": method, "batch": args.step_batch, "views": batch.n_views, "layers": args.layers, **result}


def main(argv: list[str] | None = None) -> int:
    set_offline_environment()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wiki", type=Path, default=DEFAULT_WIKI)
    p.add_argument("--max-length", type=int, default=32)
    p.add_argument("--batch", type=int, default=64, help="rows per batch for the batch fills (SimCSE's 64)")
    p.add_argument("--methods", default=",".join(REGISTRY), help="comma-separated methods (default: every one)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--step-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--batches-only",
        type=int,
        default=0,
        metavar="N",
        help="time batch building only, on the sample replicated to N rows (unpadded-batches-cpu.json)",
    )
    args = p.parse_args(argv)
    if not args.wiki.is_file():
        raise SystemExit(f"{args.wiki}: the shared Wiki1M sample is missing (../shared/data/wiki1m_head.txt)")
    from cse.models.loading import PACKAGED_MINILM, load_tokenizer

    tokenizer = load_tokenizer(PACKAGED_MINILM)  # bert-base-uncased's vocabulary
    seqs = wiki_sequences(args.wiki, tokenizer, args.max_length)
    full = np.array([len(s) for s in wiki_sequences(args.wiki, tokenizer, None)])
    if args.batches_only:
        record = {
            "command": command_line("benchmarks.unpadded", argv),
            "device": "cpu",
            "environment": cpu_environment(),
            "batch_build": batch_build_ms(seqs, args.batches_only, max_length=args.max_length),
        }
        print(json.dumps(record["batch_build"]), flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "unpadded-batches-cpu.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        return 0
    fill = fill_figures(np.array([len(s) for s in seqs]), full, args.max_length, args.batch)
    print(json.dumps(fill), flush=True)
    steps = []
    for method in [m for m in args.methods.split(",") if m]:
        steps.append(step_rows(method, seqs, fill["least_safe_fill"], args))
        print(json.dumps(steps[-1]), flush=True)
    record = {
        "command": command_line("benchmarks.unpadded", argv),
        "device": "cpu (a CPU rehearsal: no GPU figure)",
        "environment": cpu_environment(),
        "fill": fill,
        "steps": steps,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "unpadded-cpu.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
