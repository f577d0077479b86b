"""Does each method's defining mechanism work? Method vs a control that removes it, 3 seeds, STS-B dev curves.

    python -m benchmarks.evidence [--methods simcse,dcpcse,d2cse,diffcse,diffaug] [--seeds 0,1,2] [--arms ...]
        [--threads N] [--out benchmarks/results/evidence.json]
    python -m benchmarks.evidence --merge a.json b.json ... [--out benchmarks/results/evidence.json]
    python -m benchmarks.evidence --report [--out benchmarks/results/evidence.json]   # re-render .md and PNGs

No GPU and no BERT-base weights are reachable here, so the papers' tables cannot be rerun; this is the proxy that can
tell a working method from a broken one. The protocol below was fixed (and committed) before any of its runs and is
not tuned afterwards; a method that does not beat its control is reported as such.

Protocol (PROTOCOL and ARMS below are the whole of it; their hash is stored with every cell and checked on merge):
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
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.facts import MethodFacts, registry_facts
from benchmarks.machine import cpu_environment, set_offline_environment

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("CSE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data")).resolve()

set_offline_environment()

# ---------------------------------------------------------------------------------------------- the protocol
PROTOCOL: dict[str, Any] = {
    "backbone": "packaged:minilm",
    "max_length": 32,
    "batch_size": 32,
    "steps": 200,
    "eval_every": 50,
    "seeds": [0, 1, 2],
    "train_sentences": 6400,
    "heldout_sentences": 1024,
    "prefix_steps": 100,
    "nli_train_triplets": 5352,
    "nli_heldout_triplets": 512,
    "mask_ratio": 0.3,
    "corruption_variants": 2,
    "generator": "fit-generator default (MLM head on the frozen MiniLM, Wiki1M sample)",
    "precision": "fp32",
    "outcome": "STS-B dev at the last step minus at step 0",
    "head_lr_sensitivity": {"seed": 0, "steps": 50, "head_lrs": [2e-3, 2e-4]},
}


@dataclass(frozen=True)
class Arm:
    """One configuration of a method: the method itself or a control. `overrides` go over the protocol's."""

    name: str
    label: str
    overrides: dict[str, Any] = field(default_factory=dict)


METHOD = "method"
CONDITIONS = ("true_h", "shuffled_h", "no_h")  # protocol 1's mechanism check: the discriminator's h


def evidence_methods(arms_field: str) -> dict[str, MethodFacts]:
    """The registry's methods with arms in `arms_field` (benchmarks/facts.py), in `evidence_position` order."""
    found = {name: f for name, f in registry_facts().items() if getattr(f, arms_field)}
    return dict(sorted(found.items(), key=lambda item: item[1].evidence_position))


# Each method's arms, what the protocol sets over its preset, the arms with the held-out RTD mechanism check, and the
# method of the head-LR sensitivity rows: the benchmarks' facts of each method (benchmarks/facts.py).
_FACTS = evidence_methods("evidence_arms")
ARMS: dict[str, tuple[Arm, ...]] = {name: tuple(Arm(*a) for a in f.evidence_arms) for name, f in _FACTS.items()}
PROTOCOL_OVERRIDES: dict[str, dict[str, Any]] = {
    name: f.evidence_overrides(PROTOCOL) if f.evidence_overrides else {} for name, f in _FACTS.items()
}
MECHANISM_ARMS = {(name, arm) for name, f in _FACTS.items() for arm in f.evidence_mechanism_arms}
HEAD_LR_METHOD = next(name for name, f in _FACTS.items() if f.evidence_head_lr_sensitivity)


def protocol_hash() -> str:
    from cse.storage.hashing import stable_hash

    arms = {m: [dataclasses.asdict(a) for a in arms] for m, arms in ARMS.items()}
    return stable_hash({"protocol": PROTOCOL, "arms": arms, "overrides": PROTOCOL_OVERRIDES})[:16]


def _log(msg: str) -> None:
    print(f"[evidence {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------- shared by the protocols
def command_line(module: str, argv: list[str] | None) -> str:
    """The command a run records: `python -m <module>` and its arguments."""
    return f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])


def parse_methods(parser: argparse.ArgumentParser, value: str, known) -> list[str]:
    """--methods as a list, every name one of `known` (else the parser's error)."""
    methods = [m.strip() for m in value.split(",") if m.strip()]
    if unknown := sorted(set(methods) - set(known)):
        parser.error(f"unknown --methods {unknown}; known: {list(known)}")
    return methods


def parse_seeds(value: str | None) -> list[int] | None:
    return [int(s) for s in value.split(",")] if value else None


def use_home(home: Path, threads: int | None = None) -> None:
    """Make `home` the CSE_HOME of the data stages (before cse.storage.settings is read) and set torch's threads."""
    os.environ["CSE_HOME"] = str(home.resolve())
    for k in ("CSE_DATA_ROOT", "MLFLOW_TRACKING_URI", "CSE_MLFLOW_ARTIFACTS"):
        os.environ.pop(k, None)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def write_json(obj: dict[str, Any], path: Path) -> None:
    """`obj` as JSON at `path`, replaced as a whole: the evidence files' layout (indent 1, keys in their order)."""
    from cse.storage.atomic import write_json as write_atomic

    write_atomic(obj, path, indent=1, sort_keys=False)


def curve_fields(curve: list[tuple[int, float]]) -> dict[str, Any]:
    """A record's STS-B dev fields from its `(step, score)` curve: the curve, its start, final, delta and best."""
    return {
        "dev_curve": curve,
        "start": curve[0][1],
        "final": curve[-1][1],
        "delta": round(curve[-1][1] - curve[0][1], 2),
        "best": max(s for _, s in curve),
    }


def mean_std(values: list[float]) -> dict[str, Any]:
    """Mean and sample standard deviation (0 for one value) of a list, with n."""
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


# ---------------------------------------------------------------------------------------------- data
class Bench:
    """The data root (cached data stages), the STS-B dev evaluator and the fitted generator, shared by every cell."""

    def __init__(self, generator: str | None):
        from cse.config.stages import local_mirror_ingest
        from cse.evaluation.evaluator import Evaluator
        from cse.storage.evaluations import load_sts_input
        from cse.storage.layout import DataRoot
        from cse.storage.settings import get_settings
        from cse.tasks.ingest import ingest_dataset

        self.ingest = local_mirror_ingest(SHARED_DATA)
        self.root = DataRoot(get_settings().data_root)
        self.sts = ingest_dataset.fn("sts", self.ingest)
        self.evaluator = Evaluator(load_sts_input(self.sts.key, self.root).table)
        self._generator = generator
        self._tokens: dict[tuple, Any] = {}
        self._corruption: dict[tuple, Any] = {}

    def tokens(self, dataset: str, cfg):
        from cse.tasks.ingest import ingest_dataset
        from cse.tasks.tokenize import tokenize_dataset

        tc = cfg.tokenize_config()
        key = (dataset, tc.model_dump_json())
        if key not in self._tokens:
            self._tokens[key] = tokenize_dataset.fn(ingest_dataset.fn(dataset, self.ingest), tc)
        return self._tokens[key]

    def generator(self) -> str:
        """The generator every corrupting cell uses: --generator, else the fit-generator stage on the Wiki1M sample
        (cached in the data root after its first fit)."""
        if self._generator is None:
            from cse.config.stages import GeneratorConfig

            _log("fitting (or reusing) the generator: fit-generator default on the Wiki1M sample")
            ref = self.fit_generator(GeneratorConfig())
            self._generator = f"generator:{ref.key}"  # by key: corruption keys do not depend on where --home is
            _log(f"generator {ref.key} at {ref.path}")
        return self._generator

    def fit_generator(self, config):
        """The fit-generator stage of `config` on the Wiki1M sample (cached in the data root)."""
        from cse.config.stages import TokenizeConfig
        from cse.tasks.fit_generator import fit_generator
        from cse.tasks.ingest import ingest_dataset
        from cse.tasks.tokenize import tokenize_dataset

        tokenize = TokenizeConfig(tokenizer=config.backbone, max_length=PROTOCOL["max_length"])
        return fit_generator.fn(tokenize_dataset.fn(ingest_dataset.fn("wiki1m", self.ingest), tokenize).key, config)

    def corruption(self, tokens, cfg):
        from cse.tasks.corrupt import corrupt_shard, plan_corruption, publish_corruption

        key = (tokens.key, cfg.corrupt.model_dump_json())
        if key not in self._corruption:
            plan = plan_corruption.fn(tokens.key, cfg.corrupt)
            shards = [] if plan.cached else [corrupt_shard.fn(plan, i) for i in range(plan.n_shards)]
            self._corruption[key] = publish_corruption.fn(plan, shards)
        return self._corruption[key]

    def heldout(self, tokens, corruption, pad_id: int, n_heldout: int):
        """Every sentence's rows with their corruption, and the indices of the last `n_heldout` sentences."""
        import numpy as np

        from cse.storage.training_data import load_corruption_rows, load_token_rows
        from cse.training.rows import TrainingRows

        token_rows = load_token_rows(self.root, tokens.key, ("text",))
        rows = TrainingRows(token_rows, load_corruption_rows(self.root, corruption.key, token_rows), False, pad_id)
        return rows, np.arange(len(rows) - n_heldout, len(rows))

    def config(self, method: str, arm: Arm, seed: int, steps: int | None = None):
        """The cell's TrainConfig: the method's smoke preset, the protocol's settings, the arm's overrides, the seed."""
        from cse.config.methods import get_method

        generator = self.generator() if get_method(method).uses_corruption else None
        base = job_settings(PROTOCOL, self.ingest, seed, steps or PROTOCOL["steps"], generator)
        return smoke_config(method, base, PROTOCOL_OVERRIDES[method], arm.overrides)


def job_settings(protocol: dict[str, Any], ingest, seed: int, steps: int, generator: str | None) -> dict[str, Any]:
    """What a protocol sets over a method's smoke preset: its data, schedule, CPU and fp32, and, with `generator`,
    its corruption."""
    base = {
        "backbone": protocol["backbone"],
        "max_length": protocol["max_length"],
        "batch_size": protocol["batch_size"],
        "max_steps": steps,
        "epochs": protocol.get("epochs", 1),
        "max_train_sentences": protocol["train_sentences"],
        "eval_steps": protocol["eval_every"],
        "log_steps": 1,
        "system_metrics": False,
        "device": "cpu",
        "precision": "fp32",
        "seed": seed,
        "test_evaluation": False,
        "ingest": ingest.model_dump(mode="json"),
    }
    if generator is not None:
        base["corrupt"] = {
            "generator": generator,
            "mask_ratio": protocol["mask_ratio"],
            "mode": "argmax",
            "generator_dropout": True,
            "variants": protocol["corruption_variants"],
        }
    return base


def smoke_config(method: str, *overrides: dict[str, Any]):
    """The method's smoke preset with `overrides` merged over it, one after the other."""
    from cse.config.presets import deep_merge
    from cse.config.training import resolve_train_config

    return resolve_train_config("smoke", functools.reduce(deep_merge, overrides, {}), method=method)


# ---------------------------------------------------------------------------------------------- one cell
def protocol_trainer(model, cfg, phases, device, state: Path, evaluate, log_metrics):
    """The protocols' Trainer: the job's loop at fp32, AdamW without fused kernels (as protocol 1 was measured)."""
    from cse.training.job import loop_config
    from cse.training.loop import Trainer

    loop = dataclasses.replace(loop_config(cfg, "fp32"), fused_adamw=False)
    return Trainer(model, phases, loop, device, state, lambda *a: None, evaluate, log_metrics)


def loss_logger(store: list, keys: tuple[str, ...], every: int = 1):
    """A Trainer metrics hook appending the losses and `keys` (rounded) of steps 1-10 and every `every`-th step."""

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        keep = {k: round(float(v), 5) for k, v in metrics.items() if k.startswith("loss") or k in keys}
        if keep and (step % every == 0 or step <= 10):
            store.append({"step": step, **keep})

    return log_metrics


def stsb_dev(evaluator, model) -> float:
    return round(float(evaluator.run(model, mode="dev", batch_size=128, precision="fp32").metrics()["stsb_dev"]), 2)


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

    from cse.models.loading import load_tokenizer
    from cse.storage.training_data import load_token_rows
    from cse.training.job import build_model, load_training_rows, training_phases
    from cse.training.loop import set_seed
    from cse.training.rows import TrainingRows

    cfg = bench.config(method, arm, seed, steps)
    t_data = time.perf_counter()
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

    t_eval = time.perf_counter()
    curve = [(0, stsb_dev(bench.evaluator, model))]
    nli_acc: dict[str, float] = {}
    if nli_heldout_rows is not None:
        nli_acc["start"] = heldout_nli(model, nli_heldout_rows)
    eval_s = time.perf_counter() - t_eval
    losses: list[dict[str, float]] = []
    trainer = None

    def evaluate_dev(m) -> float:
        nonlocal eval_s
        t0 = time.perf_counter()
        score = stsb_dev(bench.evaluator, m)
        curve.append((trainer.step, score))
        if nli_heldout_rows is not None and cfg.prefix_phase is not None and trainer.step == cfg.prefix_phase.steps:
            nli_acc["after_stage1"] = heldout_nli(m, nli_heldout_rows)
        eval_s += time.perf_counter() - t0
        return score

    start_eval_s = eval_s
    log_metrics = loss_logger(losses, ("rtd_accuracy", "nli_accuracy", "grad_norm"))
    with tempfile.TemporaryDirectory(prefix="evidence-state-") as state:
        trainer = protocol_trainer(model, cfg, phases, device, Path(state), evaluate_dev, log_metrics)
        result = trainer.run()
    train_s = result.seconds - (eval_s - start_eval_s)  # the loop's seconds without its dev evaluations
    if curve[-1][0] != result.steps:
        raise RuntimeError(f"the last dev point is step {curve[-1][0]}, not the last step {result.steps}")
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
        **curve_fields(curve),
        "best_step": max(curve, key=lambda p: p[1])[0],
        "losses": losses,
        "corruption": cfg.corrupt.model_dump() if cfg.uses_corruption else None,
        "corruption_key": corruption.key if corruption is not None else None,
        "seconds": {
            "data": round(data_s, 1),
            "train": round(train_s, 1),
            "eval": round(eval_s, 1),
            "train_and_eval": round(train_s + eval_s, 1),
        },
    }
    if nli_acc:
        out["nli_heldout_accuracy"] = nli_acc
    if (method, arm.name) in MECHANISM_ARMS:
        out["mechanism"] = heldout_rtd(bench, model, tokens, corruption, pad)
    _log(
        f"{method}/{arm.name}/seed {seed}: STS-B dev {out['start']:.2f} -> {out['final']:.2f} ({out['delta']:+.2f}); "
        f"{out['seconds']['train_and_eval']:.0f} s"
    )
    return out


def head_lr_cell(bench: Bench, head_lr: float) -> dict[str, Any]:
    """D2CSE seed 0 for 50 steps with the BN-MLP + RTD head at `head_lr` (the sensitivity row)."""
    sens = PROTOCOL["head_lr_sensitivity"]
    arm = Arm(f"head-lr-{head_lr:g}", f"head at {head_lr:g}", {"model": {"head_learning_rate": head_lr}})
    cell = run_cell(bench, HEAD_LR_METHOD, arm, sens["seed"], steps=sens["steps"])
    cell["head_learning_rate"] = head_lr
    return cell


# ---------------------------------------------------------------------------------------------- report
def _cells(report: dict[str, Any]) -> list[dict[str, Any]]:
    return report.get("cells", [])


def cell_id(c: dict[str, Any]) -> tuple:
    return (c["method"], c["arm"], c["seed"])


def first_losses(cell: dict[str, Any], upto: int = 10) -> list[float]:
    key = "loss_contrastive"
    return [r[key] for r in cell["losses"] if key in r and 1 <= r["step"] <= upto]


def by_arm(records: list[dict[str, Any]], arms: tuple[Arm, ...]):
    """Each arm of `arms` that has records, with its records sorted by seed."""
    for arm in arms:
        if ac := sorted((r for r in records if r["arm"] == arm.name), key=lambda r: r["seed"]):
            yield arm, ac


def arm_summary(arm: Arm, records: list[dict[str, Any]], fields: tuple[str, ...], seconds: str) -> dict[str, Any]:
    """An arm's label, seeds, the mean +- std of each of `fields` over its records and of their seconds (`seconds`)."""
    return {
        "label": arm.label,
        "seeds": [r["seed"] for r in records],
        **{k: mean_std([r[k] for r in records]) for k in fields},
        seconds: mean_std([r["seconds"]["train_and_eval"] for r in records]),
    }


def method_minus_control(records: list[dict[str, Any]], arms: tuple[Arm, ...]) -> dict[str, Any]:
    """Per control: the method's final STS-B dev minus the control's, paired by seed (mean +- std, and the number of
    seeds in which the method is better)."""
    by_seed = {r["seed"]: r for r in records if r["arm"] == METHOD}
    paired = {}
    for arm in arms[1:]:
        diffs = [
            by_seed[r["seed"]]["final"] - r["final"] for r in records if r["arm"] == arm.name and r["seed"] in by_seed
        ]
        if diffs:
            paired[arm.name] = {**mean_std(diffs), "method_better_in": sum(d > 0 for d in diffs)}
    return paired


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """Per method: each arm's Delta and final dev (mean +- std over seeds), method - control paired by seed, mechanism
    figures, the head-LR sensitivity and DiffAug's NLI accuracies."""
    cells = [c for c in _cells(report) if not c["arm"].startswith("head-lr-")]
    out: dict[str, Any] = {}
    for method, arms in ARMS.items():
        mcells = [c for c in cells if c["method"] == method]
        if not mcells:
            continue
        per_arm = {}
        for arm, ac in by_arm(mcells, arms):
            entry = per_arm[arm.name] = arm_summary(arm, ac, ("delta", "start", "final", "best"), "train_seconds")
            if mech := [c["mechanism"] for c in ac if "mechanism" in c]:
                entry["mechanism"] = {
                    cond: {k: mean_std([m[cond][k] for m in mech]) for k in ("loss", "accuracy", "replaced_recall")}
                    for cond in CONDITIONS
                }
            if any("nli_heldout_accuracy" in c for c in ac):
                entry["nli_heldout_accuracy"] = {
                    k: mean_std([c["nli_heldout_accuracy"][k] for c in ac if k in c.get("nli_heldout_accuracy", {})])
                    for k in ("start", "after_stage1")
                }
        out[method] = {"arms": per_arm, "method_minus_control": method_minus_control(mcells, arms)}
    sens = PROTOCOL["head_lr_sensitivity"]
    cells_lr = sorted(
        (c for c in _cells(report) if c["arm"].startswith("head-lr-")), key=lambda c: -c["head_learning_rate"]
    )
    base = next(
        (c for c in cells if c["method"] == HEAD_LR_METHOD and c["arm"] == METHOD and c["seed"] == sens["seed"]), None
    )

    def row(head_lr: str, cell: dict[str, Any], dev_at_50: float | None) -> dict[str, Any]:
        fl = first_losses(cell)
        return {
            "head_lr": head_lr,
            "loss_step1": fl[0] if fl else None,
            "max_loss_1_10": max(fl) if fl else None,
            "dev_at_50": dev_at_50,
        }

    rows = []
    if cells_lr and base is not None:
        rows.append(
            row(f"job's ({base['learning_rate']:g})", base, dict(map(tuple, base["dev_curve"])).get(sens["steps"]))
        )
    rows += [row(f"{c['head_learning_rate']:g}", c, c["final"]) for c in cells_lr]
    if rows:
        out["head_lr_sensitivity"] = rows
    return out


def _pm(ms: dict[str, Any] | None, digits: int = 2, signed: bool = False) -> str:
    """`mean ± std` of a `mean_std` dict (the spread left out for one value; `–` for none)."""
    if not ms or ms.get("mean") is None:
        return "–"
    fmt = f"{{:{'+' if signed else ''}.{digits}f}}"
    return fmt.format(ms["mean"]) + (f" ± {ms['std']:.{digits}f}" if ms["n"] > 1 else "")


def paired_text(pair: dict[str, Any] | None, better: str = "method better in") -> str:
    """A method - control pair as `mean ± std (<better> k/n)`, `–` for none."""
    return "–" if pair is None else f"{_pm(pair, signed=True)} ({better} {pair['method_better_in']}/{pair['n']})"


def control_rows(protocol: str, method_label: str, arms: tuple[Arm, ...], m: dict[str, Any]) -> list[str]:
    """The README table's rows of one method's controls: seeds, Delta of method and control, the pair by seed."""
    own = m["arms"].get(METHOD)
    rows = []
    for arm in arms[1:]:
        ctl, pair = m["arms"].get(arm.name), m["method_minus_control"].get(arm.name)
        rows.append(
            f"| {protocol} | {method_label} | {arm.label.removeprefix('control: ')} | "
            f"{len(own['seeds']) if own else 0} / {len(ctl['seeds']) if ctl else 0} | "
            f"{_pm(own and own['delta'], signed=True)} | {_pm(ctl and ctl['delta'], signed=True)} | "
            f"{paired_text(pair, 'better in')} |"
        )
    return rows


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
    if "head_lr_sensitivity" in report["summary"]:
        lines += [
            "",
            "## D2CSE head learning rate (seed 0, 50 steps; the default is the job's single rate)",
            "",
            "| BN-MLP + RTD head LR | contrastive loss at step 1 | max over steps 1–10 | STS-B dev at step 50 |",
            "|---|---|---|---|",
        ]
        for r in report["summary"]["head_lr_sensitivity"]:
            f = lambda v: "–" if v is None else f"{v:.3f}"
            lines.append(
                f"| {r['head_lr']} | {f(r['loss_step1'])} | {f(r['max_loss_1_10'])} | "
                f"{'–' if r['dev_at_50'] is None else format(r['dev_at_50'], '.2f')} |"
            )
    lines += ["", "Commands:", ""] + [f"- `{c}`" for c in report.get("commands", [])]
    return "\n".join(lines) + "\n"


README_BEGIN = "<!-- evidence-table: `python -m benchmarks.evidence --report --readme README.md` renders it -->"
README_END = "<!-- end evidence-table -->"


def readme_table(report: dict[str, Any]) -> str:
    """The README's summary: one row per method and control (Delta of each, method - control paired by seed) of this
    protocol (protocol 1) and, when the report holds them, of protocol 2 (benchmarks/evidence_v2.py), each row
    labelled by its protocol, with the count of measured cells, rendered from the report so that the README states
    exactly what was measured."""
    s = report.get("summary") or summary(report)
    n, missing = len(_cells(report)), len(report.get("missing", []))
    lines = [
        f"Protocol 1 ({PROTOCOL['steps']} steps): measured {n} of its {n + missing} cells"
        + (
            "."
            if not missing
            else f" ({missing} still to run, so a row with fewer than {len(PROTOCOL['seeds'])} seeds is not a verdict)."
        ),
    ]
    v2 = report.get("protocol_v2")
    if v2:
        from benchmarks import evidence_v2

        lines.append(evidence_v2.status_line(v2))
    lines += [
        "",
        "| protocol | method | control (what it removes) | seeds, method / control | Δ method | Δ control "
        "| method − control, paired by seed |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, arms in ARMS.items():  # every method of the protocol, measured or not
        lines += control_rows("1", arms[0].label, arms, s.get(method, {"arms": {}, "method_minus_control": {}}))
    if v2:
        lines += evidence_v2.readme_rows(v2)
    return "\n".join(lines)


def write_readme(report: dict[str, Any], readme: Path) -> None:
    """Replace the block between README_BEGIN and README_END of `readme` with `readme_table(report)`."""
    write_block(readme, README_BEGIN, README_END, readme_table(report))


def write_block(path: Path, begin: str, end: str, body: str) -> None:
    """Replace what stands between the lines `begin` and `end` of `path` with `body`."""
    text = path.read_text(encoding="utf-8")
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no block between {begin!r} and {end!r} to render into")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{body}\n{end}{tail}", encoding="utf-8")


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


def add_commands(report: dict[str, Any], *commands: str) -> None:
    """Append `commands` to the report's, each once."""
    report["commands"] = list(dict.fromkeys([*report.get("commands", []), *commands]))


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
    arms = [a.strip() for a in args.arms.split(",")] if args.arms else None
    known_arms = {a.name for v in ARMS.values() for a in v} | {"head-lr"}
    if arms and (bad := sorted(set(arms) - known_arms)):
        p.error(f"unknown --arms {bad}; known: {sorted(known_arms)}")
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
