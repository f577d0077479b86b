"""Does each method's defining mechanism work? Method vs a control that removes it, 3 seeds, STS-B dev curves.

    python -m benchmarks.evidence [--methods simcse,dcpcse,d2cse,diffcse,diffaug] [--seeds 0,1,2] [--arms ...]
        [--threads N] [--out benchmarks/results/evidence.json]
    python -m benchmarks.evidence --merge a.json b.json ... [--out benchmarks/results/evidence.json]
    python -m benchmarks.evidence --report [--out benchmarks/results/evidence.json]   # re-render .md and PNGs

No GPU and no BERT-base weights are reachable here, so the papers' tables cannot be rerun; this is the proxy that can
tell a working method from a broken one. The protocol below was fixed (and committed) before any of its runs and is
not tuned afterwards; a method that does not beat its control is reported as such.

Protocol (PROTOCOL and ARMS, in benchmarks/evidence_base.py, are the whole of it; their hash is stored with every cell
and checked on merge):
- encoder: the packaged MiniLM (all-MiniLM-L6-v2, BERT architecture, 6 layers, hidden 384), CPU, fp32;
- data: the local Wiki1M sample (11,913 sentences; the NLI sample's triplets for DiffAug's stage 1), max length 32;
  the first 6,400 sentences train (200 steps x batch 32, one epoch, no sentence seen twice); the last 1,024 sentences
  are held out for the RTD mechanism check and never trained on; DiffAug's stage 1 trains on the first 5,352 NLI
  triplets and is checked on the last 512;
- schedule: 200 optimiser steps at batch 32 (DiffAug: 100 stage-1 steps, then 200 joint steps), each method's `smoke`
  preset learning rate (SimCSE 3e-5, DCPCSE 2e-2, D2CSE 2e-2, DiffCSE 2e-5, DiffAug 1e-3 then 2e-5), AdamW + linear
  decay as every job; STS-B dev (1,500 pairs, Spearman x 100) at step 0 and every 50 steps;
- seeds 0, 1, 2: the job seed (initial prompts/heads, data order, dropout) and, since the corruption follows the job
  seed, each seed's own corruption; a method and its controls share seed, data order and initial weights;
- generator of D2CSE/DiffCSE: the `fit-generator` stage's MLM head on the frozen MiniLM, fitted on the Wiki1M sample
  (its held-out top-1 accuracy is in the README), masking 0.3, argmax, generator dropout on, a fresh corruption per
  view (2 variants);
- controls (each removes the method's defining part, everything else equal):
  - SimCSE unsup: dropout 0 (the SimCSE paper's "no dropout" row);
  - DCPCSE: prompts frozen (only the training-time MLP learns);
  - D2CSE: lambda = 0 (no CRTD loss), and ablation (c) (the discriminator is not conditioned on h);
  - DiffCSE: lambda = 0 (SimCSE with DiffCSE's BN-MLP head);
  - DiffAug (MiniLM's [MASK] state cannot test its STS claim, see README): the paper's "same prefix for both views"
    ablation in stage 2, and stage 1's held-out NLI accuracy before and after the prefix-only stage;
- outcome: Delta = STS-B dev at step 200 minus at step 0 (the final model: no selection on the curve), mean +- sample
  std over the seeds; method - control paired by seed; the best point of each curve is reported too;
- mechanism checks (D2CSE and DiffCSE, every arm but lambda = 0, whose RTD head never trains): the trained
  discriminator's RTD loss and accuracy on the held-out sentences' corruption (variant 0), conditioned on the true h,
  on h shuffled across the batch (rolled by one), and on no h (the discriminator's own [CLS] input), mean +- std over
  the seeds; h = the BN-MLP output of the original sentence, in eval mode;
- D2CSE head-LR sensitivity (seed 0, 50 steps, not a change of the default): the BN-MLP + RTD head at the job's rate
  (the paper's single LR, the method arm's first 50 steps) vs 2e-3 and 2e-4 in a group of their own
  (`model.head_learning_rate`): the contrastive loss at step 1, its maximum over steps 1-10, and STS-B dev at step 50.

Each cell (method, arm, seed) is written to --out as soon as it ends, and cells already there under the same protocol
hash are skipped, so the benchmark resumes where it stopped and may be split over processes (disjoint --methods,
--arms or --seeds, separate --out) and joined with --merge. Data stages are cached in --home (default .cse/evidence).
Output: --out (JSON), the markdown table beside it (.md) and one PNG of STS-B dev curves per method
(benchmarks/results/evidence_<method>.png: mean line and min-max band over the seeds, method vs controls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.evidence_base import (
    ARMS,
    CONDITIONS,
    HEAD_LR_METHOD,
    MECHANISM_ARMS,
    PROTOCOL,
    REPO_ROOT,
    Arm,
    Bench,
    _cells,
    _log,
    _pm,
    add_commands,
    by_arm,
    cell_id,
    curve_fields,
    loss_logger,
    paired_text,
    parse_methods,
    parse_seeds,
    protocol_hash,
    protocol_trainer,
    stsb_dev,
    summary,
    use_home,
    write_json,
)
from benchmarks.evidence_v2 import write_readme
from benchmarks.machine import command_line, cpu_environment


# ---------------------------------------------------------------------------------------------- one cell
def heldout_rtd(bench: Bench, model, tokens, corruption, pad_id: int) -> dict[str, dict[str, float]]:
    """RTD loss / accuracy of the trained discriminator on the held-out sentences' corruption (variant 0), conditioned
    on the true h, on h rolled by one across each batch, and on no h."""
    import torch

    from cse.models.losses import rtd_accuracy, rtd_loss

    rows, heldout = bench.heldout(tokens, corruption, pad_id, PROTOCOL["heldout_sentences"])
    if heldout[0] < PROTOCOL["train_sentences"]:
        raise RuntimeError("held-out sentences overlap the training sentences")
    sums = {k: dict.fromkeys(("loss", "correct", "tokens", "replaced_correct", "replaced"), 0.0) for k in CONDITIONS}
    model.eval()
    with torch.no_grad():
        for start in range(0, len(heldout), 64):
            batch = rows.batch(heldout[start : start + 64], 0)
            ids, mask = batch.input_ids[:, 0], batch.attention_mask[:, 0]
            corrupted, labels = batch.corrupted_ids[:, 0], batch.rtd_labels[:, 0]
            h = model.projection(model.encode_cls(ids, mask))
            for name, cond in (("true_h", h), ("shuffled_h", h.roll(1, dims=0)), ("no_h", None)):
                logits = model.discriminate(corrupted, mask, cond)
                real = mask.sum().item()
                sums[name]["loss"] += float(rtd_loss(logits, labels, mask, mean_over_padding=False)) * real
                sums[name]["correct"] += float(rtd_accuracy(logits, labels, mask)) * real
                sums[name]["tokens"] += real
                replaced = labels.bool() & mask.bool()
                sums[name]["replaced_correct"] += float((logits.argmax(-1).bool() & replaced).sum())
                sums[name]["replaced"] += float(replaced.sum())
    return {
        k: {
            "loss": round(v["loss"] / v["tokens"], 5),
            "accuracy": round(v["correct"] / v["tokens"], 5),
            "replaced_recall": round(v["replaced_correct"] / max(v["replaced"], 1.0), 5),
            "replaced_share": round(v["replaced"] / v["tokens"], 5),
        }
        for k, v in sums.items()
    }


def heldout_nli(model, nli_rows) -> float:
    """DiffAug's stage-1 NLI accuracy (premise-entailment vs premise-contradiction) on held-out triplets, eval mode."""
    import numpy as np
    import torch

    model.eval()
    correct = total = 0.0
    n = len(nli_rows)
    heldout = np.arange(n - PROTOCOL["nli_heldout_triplets"], n)
    with torch.no_grad():
        for start in range(0, len(heldout), 64):
            batch = nli_rows.batch(heldout[start : start + 64], 0)
            out = model.prefix_stage_step(batch)
            rows = 2 * batch.input_ids.shape[0]
            correct += float(out.metrics["nli_accuracy"]) * rows
            total += rows
    return round(100.0 * correct / total, 2)


def run_cell(bench: Bench, method: str, arm: Arm, seed: int, steps: int | None = None) -> dict[str, Any]:
    """Train one (method, arm, seed) with the real Trainer from its step 0, recording the dev curve and the losses."""
    import tempfile

    import torch

    from cse.training.job import build_model, training_phases
    from cse.training.loop import set_seed

    cfg = bench.config(method, arm, seed, steps)
    t_data = time.perf_counter()
    tokens, corruption, pad, rows, nli_rows, nli_heldout_rows = cell_data(bench, cfg)
    data_s = time.perf_counter() - t_data
    device = torch.device("cpu")
    set_seed(cfg.seed)  # as cse.training.job.fit: the initial prompts, MLPs and heads follow the job's seed
    model = build_model(cfg, device)
    phases = training_phases(cfg, rows, nli_rows)
    total = sum(p.total_steps for p in phases)
    _log(
        f"{method}/{arm.name}/seed {seed}: {total} steps, batch {cfg.batch_size}, lr {cfg.learning_rate:g}"
        + (f" (stage 1 {cfg.prefix_phase.learning_rate:g})" if cfg.prefix_phase else "")
    )
    dev = DevCurve(bench, cfg, nli_heldout_rows)
    dev.start(model)
    start_eval_s = dev.seconds
    losses: list[dict[str, float]] = []
    log_metrics = loss_logger(losses, ("rtd_accuracy", "nli_accuracy", "grad_norm"))
    with tempfile.TemporaryDirectory(prefix="evidence-state-") as state:
        dev.trainer = protocol_trainer(model, cfg, phases, device, Path(state), dev, log_metrics)
        result = dev.trainer.run()
    train_s = result.seconds - (dev.seconds - start_eval_s)  # the loop's seconds without its dev evaluations
    if dev.curve[-1][0] != result.steps:
        raise RuntimeError(f"the last dev point is step {dev.curve[-1][0]}, not the last step {result.steps}")
    out: dict[str, Any] = {
        "method": method,
        "arm": arm.name,
        "label": arm.label,
        "seed": seed,
        "protocol": protocol_hash(),
        "steps": result.steps,
        "learning_rate": cfg.learning_rate,
        "batch_size": cfg.batch_size,
        "overrides": arm.overrides,
        **curve_fields(dev.curve),
        "best_step": max(dev.curve, key=lambda p: p[1])[0],
        "losses": losses,
        "corruption": cfg.corrupt.model_dump() if cfg.uses_corruption else None,
        "corruption_key": corruption.key if corruption is not None else None,
        "seconds": cell_seconds(data_s, train_s, dev.seconds),
    }
    if dev.nli_acc:
        out["nli_heldout_accuracy"] = dev.nli_acc
    if (method, arm.name) in MECHANISM_ARMS:
        out["mechanism"] = heldout_rtd(bench, model, tokens, corruption, pad)
    _log(
        f"{method}/{arm.name}/seed {seed}: STS-B dev {out['start']:.2f} -> {out['final']:.2f} ({out['delta']:+.2f}); "
        f"{out['seconds']['train_and_eval']:.0f} s"
    )
    return out


def cell_seconds(data_s: float, train_s: float, eval_s: float) -> dict[str, float]:
    """A cell's seconds: its data stages, its training loop without the dev evaluations, those, and the two together."""
    return {
        "data": round(data_s, 1),
        "train": round(train_s, 1),
        "eval": round(eval_s, 1),
        "train_and_eval": round(train_s + eval_s, 1),
    }


def cell_data(bench: Bench, cfg):
    """A cell's data: its tokens and corruption (cached stages), the pad id, its training rows and, for a method that
    needs NLI, the stage-1 triplets and all the triplets (the last ones held out)."""
    from cse.models.loading import load_tokenizer
    from cse.storage.training_data import load_token_rows
    from cse.training.job import load_training_rows
    from cse.training.rows import TrainingRows

    tokens = bench.tokens(cfg.dataset, cfg)
    corruption = bench.corruption(tokens, cfg) if cfg.uses_corruption else None
    pad = load_tokenizer(cfg.backbone).pad_token_id
    rows, _ = load_training_rows(cfg, bench.root, tokens, corruption, None, pad)
    nli_rows = nli_heldout_rows = None
    if cfg.needs_nli:
        nli = bench.tokens("nli", cfg)
        cols = ("sent0", "sent1", "hard_neg")
        nli_rows = TrainingRows(
            load_token_rows(bench.root, nli.key, cols, limit=PROTOCOL["nli_train_triplets"]), None, True, pad
        )
        nli_heldout_rows = TrainingRows(load_token_rows(bench.root, nli.key, cols), None, True, pad)
        if len(nli_heldout_rows) - PROTOCOL["nli_heldout_triplets"] < len(nli_rows):
            raise RuntimeError("held-out NLI triplets overlap the stage-1 triplets")
    return tokens, corruption, pad, rows, nli_rows, nli_heldout_rows


class DevCurve:
    """A cell's STS-B dev curve, as the Trainer's evaluate hook: the score at each evaluation step (and, for DiffAug,
    the held-out NLI accuracy at the start and after stage 1), with the seconds its evaluations took."""

    def __init__(self, bench: Bench, cfg, nli_heldout_rows):
        self.bench, self.cfg, self.nli_heldout_rows = bench, cfg, nli_heldout_rows
        self.curve: list[tuple[int, float]] = []
        self.nli_acc: dict[str, float] = {}
        self.seconds = 0.0
        self.trainer = None  # set once the Trainer exists: the steps of the curve are its

    def start(self, model) -> None:
        """The step-0 point (and the NLI accuracy at the start)."""
        t0 = time.perf_counter()
        self.curve.append((0, stsb_dev(self.bench.evaluator, model)))
        if self.nli_heldout_rows is not None:
            self.nli_acc["start"] = heldout_nli(model, self.nli_heldout_rows)
        self.seconds += time.perf_counter() - t0

    def __call__(self, m) -> float:
        t0 = time.perf_counter()
        score = stsb_dev(self.bench.evaluator, m)
        step = self.trainer.step
        self.curve.append((step, score))
        prefix = self.cfg.prefix_phase
        if self.nli_heldout_rows is not None and prefix is not None and step == prefix.steps:
            self.nli_acc["after_stage1"] = heldout_nli(m, self.nli_heldout_rows)
        self.seconds += time.perf_counter() - t0
        return score


def head_lr_cell(bench: Bench, head_lr: float) -> dict[str, Any]:
    """D2CSE seed 0 for 50 steps with the BN-MLP + RTD head at `head_lr` (the sensitivity row)."""
    sens = PROTOCOL["head_lr_sensitivity"]
    arm = Arm(f"head-lr-{head_lr:g}", f"head at {head_lr:g}", {"model": {"head_learning_rate": head_lr}})
    cell = run_cell(bench, HEAD_LR_METHOD, arm, sens["seed"], steps=sens["steps"])
    cell["head_learning_rate"] = head_lr
    return cell


def markdown(report: dict[str, Any]) -> str:
    s = {method: m for method, m in report["summary"].items() if method != "head_lr_sensitivity"}
    env = report.get("environment", {})
    lines = [
        f"# Evidence benchmark (CPU, MiniLM; protocol {report['protocol']})",
        "",
        f"Cells: {len(_cells(report))}. Missing: {', '.join('/'.join(map(str, m)) for m in report.get('missing', [])) or 'none'}.",
        f"Torch threads per process: {env.get('torch_threads')}; cpu: {env.get('cpu')}.",
        "",
        "## STS-B dev, step 0 → last step (Spearman × 100; mean ± std over seeds)",
        "",
        "| method | arm | seeds | start | final | Δ | best point | method − this control (paired) | s / run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, m in s.items():
        for name, a in m["arms"].items():
            lines.append(
                f"| {method} | {a['label']} | {len(a['seeds'])} | {_pm(a['start'])} | {_pm(a['final'])} | "
                f"{_pm(a['delta'], signed=True)} | {_pm(a['best'])} | "
                f"{paired_text(m['method_minus_control'].get(name))} | {a['train_seconds']['mean']:.0f} |"
            )
    lines += mechanism_section(s) + nli_section(s) + head_lr_section(report["summary"])
    lines += ["", "Commands:", ""] + [f"- `{c}`" for c in report.get("commands", [])]
    return "\n".join(lines) + "\n"


def mechanism_section(s: dict[str, Any]) -> list[str]:
    """The report's table of held-out RTD figures (loss, accuracy, replaced recall under each h), when measured."""
    lines: list[str] = []
    if mech_rows := [(method, a) for method, m in s.items() for a in m["arms"].values() if "mechanism" in a]:
        lines += [
            "",
            "## Mechanism: held-out RTD of the trained discriminator (1,024 unseen sentences, variant 0)",
            "",
            "| method | arm | loss, true h | loss, shuffled h | loss, no h | acc. true h | acc. shuffled h | acc. no h | "
            "replaced recall, true / shuffled / no h |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for method, a in mech_rows:
            me = a["mechanism"]
            figures = [_pm(me[cond][k], 4) for k in ("loss", "accuracy") for cond in CONDITIONS]
            recall = " / ".join(f"{me[cond]['replaced_recall']['mean']:.3f}" for cond in CONDITIONS)
            lines.append(f"| {method} | {a['label']} | {' | '.join(figures)} | {recall} |")
    return lines


def nli_section(s: dict[str, Any]) -> list[str]:
    """The report's table of DiffAug's held-out NLI accuracy before and after stage 1, when measured."""
    lines: list[str] = []
    if nli_rows := [a for m in s.values() for a in m["arms"].values() if "nli_heldout_accuracy" in a]:
        lines += [
            "",
            "## DiffAug stage 1: held-out NLI accuracy (512 unseen triplets, 1,024 pairs; %)",
            "",
            "| arm | before stage 1 | after stage 1 (prefix + classifier only) |",
            "|---|---|---|",
        ]
        for a in nli_rows:
            acc = a["nli_heldout_accuracy"]
            lines.append(f"| {a['label']} | {_pm(acc['start'])} | {_pm(acc['after_stage1'])} |")
    return lines


def head_lr_section(summary: dict[str, Any]) -> list[str]:
    """The report's table of the D2CSE head-LR sensitivity rows, when measured."""
    lines: list[str] = []
    if "head_lr_sensitivity" in summary:
        lines += [
            "",
            "## D2CSE head learning rate (seed 0, 50 steps; the default is the job's single rate)",
            "",
            "| BN-MLP + RTD head LR | contrastive loss at step 1 | max over steps 1–10 | STS-B dev at step 50 |",
            "|---|---|---|---|",
        ]
        for r in summary["head_lr_sensitivity"]:
            f = lambda v: "–" if v is None else f"{v:.3f}"
            lines.append(
                f"| {r['head_lr']} | {f(r['loss_step1'])} | {f(r['max_loss_1_10'])} | "
                f"{'–' if r['dev_at_50'] is None else format(r['dev_at_50'], '.2f')} |"
            )
    return lines


def plot_curves(report: dict[str, Any], out_dir: Path) -> None:
    """One PNG per method: STS-B dev vs step, mean line and min-max band over the seeds, method vs controls."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in _cells(report) if not c["arm"].startswith("head-lr-")]
    for method, arms in ARMS.items():
        mcells = [c for c in cells if c["method"] == method]
        if not mcells:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for arm, ac in by_arm(mcells, arms):
            steps = sorted({s for c in ac for s, _ in c["dev_curve"]})
            per_step = {s: [v for c in ac for st, v in c["dev_curve"] if st == s] for s in steps}
            mean = [statistics.fmean(per_step[s]) for s in steps]
            (line,) = ax.plot(steps, mean, marker="o", label=f"{arm.label} (n={len(ac)})")
            ax.fill_between(
                steps,
                [min(per_step[s]) for s in steps],
                [max(per_step[s]) for s in steps],
                alpha=0.2,
                color=line.get_color(),
            )
        ax.set_xlabel("step")
        ax.set_ylabel("STS-B dev Spearman × 100")
        ax.set_title(f"{method}: method vs control (MiniLM, batch {PROTOCOL['batch_size']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / f"evidence_{method}.png", dpi=110)
        plt.close(fig)


def expected_cells(methods=None, seeds=None, arms=None) -> list[tuple]:
    sens, out = PROTOCOL["head_lr_sensitivity"], []
    for method, marms in ARMS.items():
        if methods and method not in methods:
            continue
        out += [(method, a.name, s) for a in marms if not arms or a.name in arms for s in seeds or PROTOCOL["seeds"]]
        if method == HEAD_LR_METHOD and (not arms or "head-lr" in arms):
            out += [(method, f"head-lr-{lr:g}", sens["seed"]) for lr in sens["head_lrs"]]
    return out


def write(report: dict[str, Any], out: Path) -> None:
    order = {c: i for i, c in enumerate(expected_cells())}
    report["cells"] = sorted(_cells(report), key=lambda c: order.get(cell_id(c), len(order)))
    report["missing"] = [list(c) for c in expected_cells() if c not in {cell_id(x) for x in report["cells"]}]
    report["complete"] = not report["missing"]
    report["summary"] = summary(report)
    write_json(report, out)
    out.with_suffix(".md").write_text(markdown(report))
    plot_curves(report, out.parent)


def render(report: dict[str, Any], out: Path, readme: Path | None) -> None:
    """Write the report, its markdown and PNGs (and `readme`'s block), and print the markdown."""
    write(report, out)
    if readme is not None:
        write_readme(report, readme)
    print(out.with_suffix(".md").read_text())


def load(out: Path) -> dict[str, Any]:
    if out.is_file():
        report = json.loads(out.read_text())
        if report.get("protocol") != protocol_hash():
            raise SystemExit(
                f"{out} was made under protocol {report.get('protocol')}, not {protocol_hash()}: the protocol "
                "is fixed; write to another --out"
            )
        return report
    return {
        "benchmark": "evidence",
        "protocol": protocol_hash(),
        "protocol_text": PROTOCOL,
        "cells": [],
        "commands": [],
    }


def merge(paths: list[Path], out: Path, command: str, readme: Path | None = None) -> int:
    report = load(out)
    have = {cell_id(c): c for c in _cells(report)}
    threads = set()
    for p in paths:
        part = json.loads(Path(p).read_text())
        if part.get("protocol") != protocol_hash():
            raise SystemExit(f"{p}: protocol {part.get('protocol')} != {protocol_hash()}")
        for c in _cells(part):
            if cell_id(c) in have and have[cell_id(c)] != c and Path(p).resolve() != out.resolve():
                raise SystemExit(f"cell {cell_id(c)} differs between {p} and the merged report")
            have[cell_id(c)] = c
        add_commands(report, *part.get("commands", []))
        report.setdefault("environment", part.get("environment"))
        threads.add(str((part.get("environment") or {}).get("torch_threads")))
    if report.get("environment") and len(threads) > 1:
        # parts run with different thread counts: the report names them all
        report["environment"] = {**report["environment"], "torch_threads": ", ".join(sorted(threads))}
    report["cells"] = list(have.values())
    report["commands"].append(command)
    render(report, out, readme)
    return 0 if report["complete"] else 1


def parse_arms(parser: argparse.ArgumentParser, value: str | None) -> list[str] | None:
    """--arms as a list (None: every arm), each one of the protocol's arms or `head-lr` (else the parser's error)."""
    arms = [a.strip() for a in value.split(",")] if value else None
    known_arms = {a.name for v in ARMS.values() for a in v} | {"head-lr"}
    if arms and (bad := sorted(set(arms) - known_arms)):
        parser.error(f"unknown --arms {bad}; known: {sorted(known_arms)}")
    return arms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--arms", default=None, help="comma-separated arm names (method, no-dropout, lambda0, ..., head-lr)")
    p.add_argument("--seeds", default=None, help="comma-separated subset of the protocol's seeds")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "evidence.json")
    p.add_argument(
        "--home",
        type=Path,
        default=REPO_ROOT / ".cse" / "evidence",
        help="CSE_HOME of the data stages and the fitted generator (kept between runs)",
    )
    p.add_argument(
        "--generator", default=None, help="generator folder or HF id instead of fitting one (not the protocol)"
    )
    p.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON")
    p.add_argument("--report", action="store_true", help="re-render the markdown and the PNGs of --out, then exit")
    p.add_argument(
        "--readme", type=Path, default=None, help="with --report or --merge: also render the summary into this README"
    )
    args = p.parse_args(argv)
    command = command_line("benchmarks.evidence", argv).strip()
    if args.merge:
        return merge(args.merge, args.out, command, args.readme)
    if args.report:
        render(load(args.out), args.out, args.readme)
        return 0
    methods = parse_methods(p, args.methods, ARMS)
    seeds = parse_seeds(args.seeds)
    if seeds and (bad := sorted(set(seeds) - set(PROTOCOL["seeds"]))):
        p.error(f"--seeds {bad} are not the protocol's {PROTOCOL['seeds']}")
    arms = parse_arms(p, args.arms)
    use_home(args.home, args.threads)

    def stamped(report: dict[str, Any]) -> dict[str, Any]:
        report["environment"] = cpu_environment()
        add_commands(report, command)
        return report

    report = stamped(load(args.out))
    done = {cell_id(c) for c in _cells(report)}
    todo = [c for c in expected_cells(methods, seeds, arms) if c not in done]
    _log(
        f"protocol {protocol_hash()}; {len(todo)} cells to run ({len(done)} already in {args.out}); "
        f"torch threads {report['environment']['torch_threads']}"
    )
    bench = Bench(args.generator)
    for method, arm_name, seed in todo:
        if arm_name.startswith("head-lr-"):
            cell = head_lr_cell(bench, float(arm_name.removeprefix("head-lr-")))
        else:
            cell = run_cell(bench, method, next(a for a in ARMS[method] if a.name == arm_name), seed)
        report = stamped(load(args.out))  # re-read: another process may have written to --out meanwhile
        report["cells"] = [c for c in _cells(report) if cell_id(c) != cell_id(cell)] + [cell]
        write(report, args.out)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
