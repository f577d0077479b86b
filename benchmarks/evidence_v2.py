"""Evidence, protocol 2: can the benchmark see a conditional discriminator's mechanism at all, and what does CRTD do
with a stronger generator, a power-checked discriminator/head rate and 1,000 steps?

    python -m benchmarks.evidence_v2 --part NAME [--methods M1,M2] [--stages power,sts] [--seeds 0,1,2] [--threads 1]
    python -m benchmarks.evidence_v2 --merge [--readme README.md] [--docs docs/evidence.md]

Protocol 1 (benchmarks/evidence.py, hash 0713ae7325e122a8) found that neither D2CSE's CRTD nor DiffCSE's RTD term
beats lambda = 0 on the MiniLM proxy and that their trained discriminators' held-out RTD loss is the same with the true
and a shuffled h. It could not say whether that is the methods or the benchmark: nothing in it showed that its arms
can learn to read h at all. Protocol 1's results stay as they were, under their hash. Protocol 2 (PROTOCOL_V2 and
each method's `evidence_v2_arms` / `evidence_power_knob` in benchmarks/facts.py; their hash is stored with every record) was fixed
and committed before any of its runs and is not tuned afterwards:

- encoder, data, precision: protocol 1's (the packaged MiniLM, CPU, fp32, max length 32, batch 32); the last 1,024
  sentences of the Wiki1M sample are held out, the 10,889 before them train;
- power check, before any STS comparison (seed 0, `power.steps` steps): the "swap" task, in which each sentence's
  corruption is, with probability 0.5, another training sentence of the same token length (else the sentence
  itself), so only h can tell which tokens differ. The arm trains on it with its exact settings (method, lambda,
  learning rates) and the held-out sentences' swap corruption is probed (`ConditionalRTDModel.rtd_h_probe`: RTD
  loss with the true h, with h rolled by one row, with no h). The arm has the power to show the mechanism when
  rolled - true >= `power.min_gap`; only then is its mechanism row read. The method's proxy knob
  (`evidence_power_knob`: DiffCSE's discriminator + RTD-head rate, D2CSE's BN-MLP + RTD-head rate) is tried in its
  listed order, the job's own rate first, and the first rate that passes is the one the STS runs use; when none
  passes, the last is used and the arm's rows say it has no power. The knob is chosen on the swap task only, never on
  STS; it is a proxy setting of this benchmark, not a change of any preset;
- generator: MiniLM fine-tuned as a masked LM, the backbone unfrozen (`GENERATOR`: the fit-generator stage with
  `backbone_lr`), on the Wiki1M sample minus the stage's own 1,000 held-out sentences; its held-out top-1 is reported
  beside protocol 1's head-only generator (0.1389); masking 0.3, argmax, generator dropout on, 2 variants (each view
  its own, cycled over the epochs), the corruption following the job seed as in protocol 1;
- STS runs: the method and lambda = 0, seeds 0, 1, 2, 1,000 optimiser steps (3 epochs' schedule over the 10,889
  training sentences, linear decay to step 1,000), each method's `smoke` learning rate for everything but the knob;
  STS-B dev at step 0 and every 250 steps; outcome Delta = dev at step 1,000 minus step 0, method - control paired
  by seed;
- mechanism on the real corruption (every arm with a trained RTD head): the held-out sentences' RTD loss with the true,
  rolled and no h, beside the constant guess's loss (the binary entropy of the held-out replaced share): how much
  the corrupted sentence alone already tells.

Records are written to `<home>/parts/<part>.json` as soon as each ends; records already in any part under this
protocol's hash are skipped, so several processes (disjoint --methods) run side by side and a rerun resumes; an STS
run killed midway resumes at its last evaluation (its loop state and curve so far are kept in `<home>/state`).
`--merge` joins the parts into benchmarks/results/evidence.json under `protocol_v2` (protocol 1's report there is
left as it is), writes benchmarks/results/evidence_v2.md and renders the README's and docs/evidence.md's blocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import evidence_base as ev
from benchmarks.evidence_base import (
    Arm,
    Bench,
    _cells,
    _pm,
    arm_summary,
    by_arm,
    control_rows,
    curve_fields,
    evidence_methods,
    job_settings,
    loss_logger,
    mean_std,
    method_minus_control,
    paired_text,
    protocol_trainer,
    smoke_config,
    stsb_dev,
    write_block,
    write_json,
)
from benchmarks.machine import command_line, cpu_environment, set_offline_environment

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results" / "evidence.json"

set_offline_environment()

# ---------------------------------------------------------------------------------------------- the protocol
GENERATOR: dict[str, Any] = {  # cse.config.stages.GeneratorConfig fields: full MLM fine-tuning of the MiniLM
    "backbone": "packaged:minilm",
    "backbone_lr": 1e-4,
    "lr": 2e-3,
    "epochs": 2,
    "reuse": 1,
    "batch_size": 64,
    "eval_every": 50,
}
# The setting protocols 2 and 3 share (each protocol's hash covers it: `stable_hash` ignores key order).
MINILM_SETTING: dict[str, Any] = {
    "backbone": "packaged:minilm",
    "max_length": 32,
    "batch_size": 32,
    "precision": "fp32",
    "train_sentences": 10889,
    "heldout_sentences": 1024,
}
PROTOCOL_V2: dict[str, Any] = {
    "version": 2,
    **MINILM_SETTING,
    "steps": 1000,
    "epochs": 3,
    "eval_every": 250,
    "seeds": [0, 1, 2],
    "mask_ratio": 0.3,
    "corruption_variants": 2,
    "generator": GENERATOR,
    "power": {"seed": 0, "steps": 200, "swap_probability": 0.5, "min_gap": 0.05, "variants": 2},
    "outcome": "STS-B dev at step 1000 minus at step 0",
}


ARMS: dict[str, tuple[Arm, ...]] = {
    name: tuple(Arm(*a) for a in f.evidence_v2_arms) for name, f in evidence_methods("evidence_v2_arms").items()
}
KNOBS: dict[str, tuple[str, tuple[float | None, ...]]] = {
    name: f.evidence_power_knob for name, f in evidence_methods("evidence_v2_arms").items()
}


def arms_and_knobs() -> dict[str, Any]:
    """The protocol's arms and knobs as its hash covers them (and its report states them)."""
    return {
        "arms": {m: [dataclasses.asdict(a) for a in arms] for m, arms in ARMS.items()},
        "knobs": {m: [k[0], list(k[1])] for m, k in KNOBS.items()},
    }


def protocol_hash() -> str:
    from cse.storage.hashing import stable_hash

    return stable_hash({"protocol": PROTOCOL_V2, **arms_and_knobs()})[:16]


def log(msg: str) -> None:
    print(f"[evidence-v2 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def binary_entropy(p: float) -> float:
    """H(p) in nats: the loss of the best constant guess of a label that is 1 with probability p."""
    return 0.0 if p <= 0.0 or p >= 1.0 else -(p * math.log(p) + (1 - p) * math.log(1 - p))


def trains_rtd(arm: Arm) -> bool:
    """The arm's RTD side learns (lambda > 0): only such an arm has a mechanism to check."""
    return (arm.overrides.get("model") or {}).get("rtd_weight", 1.0) != 0.0


# ---------------------------------------------------------------------------------------------- data
def generator_record(key: str, config: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of the protocol's fitted generator (its manifest's stats)."""
    kept = ("heldout_top1", "heldout_positions", "heldout_sentences", "steps", "seconds", "history")
    return {"key": key, "config": config, **{k: stats.get(k) for k in kept}}


def generator_in_home(home: Path) -> dict[str, Any] | None:
    """The protocol's generator as fitted in `home`'s data root (the fit-generator stage's manifest whose config is
    `GENERATOR`), or None when it is not fitted there: a merge reports it even before any STS run read it."""
    for manifest in sorted((home / "data" / "datasets" / "generator").glob("*/manifest.json")):
        m = json.loads(manifest.read_text())
        config = m.get("params", {}).get("config", {})
        if all(config.get(k) == v for k, v in GENERATOR.items()):
            return generator_record(m["key"], {k: v for k, v in config.items() if k != "device"}, m.get("stats", {}))
    return None


def fit_v2_generator(bench: Bench) -> dict[str, Any]:
    """The protocol's generator (the fit-generator stage, cached in the data root) and its held-out accuracies."""
    from cse.config.stages import GeneratorConfig

    config = GeneratorConfig(**GENERATOR)
    log("fitting (or reusing) the protocol's generator: MiniLM fine-tuned as a masked LM")
    ref = bench.fit_generator(config)
    return generator_record(
        ref.key, config.model_dump(exclude={"device"}), bench.root.require("generator", ref.key).stats
    )


def swap_corruption(token_rows, n_train: int, probability: float, variants: int, seed: int):
    """In-memory `CorruptionRows` of the swap task: each row's corruption is, with `probability`, another row of the
    same split (the first `n_train` rows, or the rest) and the same token length, else the row itself; labels are
    `corrupted != original`. A row with no same-length partner in its split keeps itself."""
    import numpy as np

    from cse.storage.training_data import CorruptionRows, take_rows

    (column,) = token_rows.columns
    seqs = take_rows(token_rows.seqs[column], np.arange(len(token_rows)))
    lengths = np.array([len(s) for s in seqs])
    split = np.arange(len(seqs)) >= n_train
    rng = np.random.default_rng(seed)
    corrupted, labels = {}, {}
    groups = {}
    for i, key in enumerate(zip(split.tolist(), lengths.tolist())):
        groups.setdefault(key, []).append(i)
    for v in range(variants):
        cor, lab = [], []
        for i, s in enumerate(seqs):
            partners = groups[(bool(split[i]), int(lengths[i]))]
            j = i
            if len(partners) > 1 and rng.random() < probability:
                j = partners[int(rng.integers(len(partners) - 1))]
                j = j if j != i else partners[-1]
            c = np.asarray(seqs[j], dtype=np.int64)
            cor.append(c)
            lab.append((c != np.asarray(s)).astype(np.int64))
        corrupted[(column, v)], labels[(column, v)] = cor, lab
    return CorruptionRows(variants=variants, corrupted=corrupted, labels=labels)


def train_config(bench: Bench, method: str, arm: Arm, seed: int, knob: float | None, steps: int, generator: str | None):
    """The run's TrainConfig: the method's smoke preset, protocol 2's settings, the arm's overrides, the knob's rate."""
    base = job_settings(PROTOCOL_V2, bench.ingest, seed, steps, generator)
    return smoke_config(method, base, arm.overrides, {} if knob is None else {"model": {KNOBS[method][0]: knob}})


def probe_rows(model, rows, indices, batch: int = 64) -> dict[str, float]:
    """`rtd_h_probe` over `indices` of `rows` (view 0, variant 0), averaged over real tokens, with the replaced share
    and the constant guess's loss."""
    import numpy as np

    sums = {"true_h": 0.0, "rolled_h": 0.0, "no_h": 0.0}
    tokens = replaced = 0.0
    device = next(model.parameters()).device
    for start in range(0, len(indices), batch):
        b = rows.batch(np.asarray(indices[start : start + batch]), 0)
        ids, mask, cor, lab = b.input_ids[:, 0], b.attention_mask[:, 0], b.corrupted_ids[:, 0], b.rtd_labels[:, 0]
        out = model.rtd_h_probe(ids.to(device), mask.to(device), cor.to(device), lab.to(device))
        real = float(mask.sum())
        for k in sums:
            sums[k] += out[k] * real
        tokens += real
        replaced += float((lab.bool() & mask.bool()).sum())
    res = {k: round(v / tokens, 5) for k, v in sums.items()}
    res["gap"] = round(res["rolled_h"] - res["true_h"], 5)
    res["replaced_share"] = round(replaced / tokens, 5)
    res["constant_guess"] = round(binary_entropy(replaced / tokens), 5)
    return res


# ---------------------------------------------------------------------------------------------- records
def swap_task_rows(bench: Bench, cfg):
    """The power check's rows: the training sentences with the swap corruption, every sentence with it, and the
    indices of the held-out sentences (the sample's last ones)."""
    import numpy as np

    from cse.models.loading import load_tokenizer
    from cse.storage.training_data import load_token_rows
    from cse.training.rows import TrainingRows

    power = PROTOCOL_V2["power"]
    tokens = bench.tokens(cfg.dataset, cfg)
    pad = load_tokenizer(cfg.backbone).pad_token_id
    everything = load_token_rows(bench.root, tokens.key, ("text",))
    n, n_train = len(everything), PROTOCOL_V2["train_sentences"]
    if n - PROTOCOL_V2["heldout_sentences"] != n_train:
        raise RuntimeError(f"the sample has {n} sentences, not {n_train} + {PROTOCOL_V2['heldout_sentences']}")
    swap = swap_corruption(everything, n_train, power["swap_probability"], power["variants"], power["seed"])
    train_rows = TrainingRows(
        load_token_rows(bench.root, tokens.key, ("text",), limit=n_train),
        type(swap)(
            swap.variants,
            {k: v[:n_train] for k, v in swap.corrupted.items()},
            {k: v[:n_train] for k, v in swap.labels.items()},
        ),
        False,
        pad,
    )
    return train_rows, TrainingRows(everything, swap, False, pad), np.arange(n_train, n)


def train_on_swap(cfg, train_rows, device, freeze=None) -> tuple[Any, int, list, float]:
    """Train `cfg`'s model on the swap task's `train_rows` on `device` (no STS evaluation: the loop's one end-of-run
    selection call gets a constant), the parameters whose names `freeze(name)` is true for frozen first.

    Returns:
        The trained model, its steps, its losses (steps 1-10 and every 10th) and the training seconds.
    """
    from cse.training.job import build_model, training_phases
    from cse.training.loop import set_seed

    set_seed(cfg.seed)
    model = build_model(cfg, device)
    for name, p in model.named_parameters():
        if freeze is not None and freeze(name):
            p.requires_grad_(False)
    losses: list = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="evidence-swap-state-") as state:
        phases = training_phases(cfg, train_rows, None)
        log_losses = loss_logger(losses, ("rtd_accuracy",), every=10)
        result = protocol_trainer(model, cfg, phases, device, Path(state), lambda m: 0.0, log_losses).run()
    return model, result.steps, losses, time.perf_counter() - t0


def power_record(bench: Bench, method: str, arm: Arm, knob: float | None) -> dict[str, Any]:
    """Train the arm on the swap task for `power.steps` steps (seed 0) and probe the held-out sentences."""
    import torch

    power = PROTOCOL_V2["power"]
    cfg = train_config(bench, method, arm, power["seed"], knob, power["steps"], generator=None)
    train_rows, all_rows, heldout = swap_task_rows(bench, cfg)
    knob_name = KNOBS[method][0]
    log(
        f"power {method}/{arm.name}: {knob_name} = {knob if knob is not None else 'the job rate'}, {power['steps']} steps"
    )
    model, steps, losses, train_s = train_on_swap(cfg, train_rows, torch.device("cpu"))
    probe = probe_rows(model, all_rows, heldout)
    rec = {
        "kind": "power",
        "method": method,
        "arm": arm.name,
        "label": arm.label,
        "knob": knob_name,
        "knob_value": knob,
        "learning_rate": cfg.learning_rate,
        "steps": steps,
        "protocol": protocol_hash(),
        "probe": probe,
        "passes": probe["gap"] >= power["min_gap"],
        "losses": losses,
        "seconds": round(train_s, 1),
    }
    log(f"power {method}/{arm.name} {knob_name}={knob}: {probe} -> {'passes' if rec['passes'] else 'no power'}")
    return rec


def sts_record(
    bench: Bench, method: str, arm: Arm, seed: int, knob: float | None, power_passed: bool | None, state_dir: Path
) -> dict[str, Any]:
    """Train one (method, arm, seed) for the protocol's steps on the real corruption, recording the dev curve and, for
    an arm whose RTD side learns, the held-out mechanism figures."""
    import torch

    from cse.models.loading import load_tokenizer
    from cse.training.job import load_training_rows

    cfg = train_config(bench, method, arm, seed, knob, PROTOCOL_V2["steps"], generator=bench.generator())
    t_data = time.perf_counter()
    tokens = bench.tokens(cfg.dataset, cfg)
    corruption = bench.corruption(tokens, cfg)
    pad = load_tokenizer(cfg.backbone).pad_token_id
    rows, _ = load_training_rows(cfg, bench.root, tokens, corruption, None, pad)
    heldout = bench.heldout(tokens, corruption, pad, PROTOCOL_V2["heldout_sentences"]) if trains_rtd(arm) else None
    data_s = time.perf_counter() - t_data
    rec = sts_fields(method, arm, seed, knob, power_passed, corruption.key)
    dev = functools.partial(stsb_dev, bench.evaluator)
    rec.update(train_sts(cfg, rows, heldout, dev, state_dir / run_name(rec), torch.device("cpu")))
    rec["seconds"]["data"] = round(data_s, 1)
    return rec


def run_name(rec: dict[str, Any]) -> str:
    """The run's folder under `<home>/state`: method, arm, seed and the protocol's hash."""
    return f"{rec['method']}-{rec['arm']}-{rec['seed']}-{protocol_hash()}"


def sts_fields(
    method: str, arm: Arm, seed: int, knob: float | None, power_passed: bool | None, corruption_key: str
) -> dict[str, Any]:
    """What an STS record says of its run before training: which arm, seed and knob, under which protocol."""
    return {
        "kind": "sts",
        "method": method,
        "arm": arm.name,
        "label": arm.label,
        "seed": seed,
        "protocol": protocol_hash(),
        "knob": KNOBS[method][0],
        "knob_value": knob,
        "power_passed": power_passed,
        "corruption_key": corruption_key,
    }


def train_sts(cfg, rows, heldout, dev, state: Path, device, finish=None) -> dict[str, Any]:
    """Train `cfg`'s model on `rows` on `device`, evaluating `dev(model)` (STS-B dev) at step 0 and at every
    evaluation, and, with `heldout = (rows, indices)`, probe the trained discriminator there; `finish(model)`, when
    given, adds its fields (protocol 3: the seven STS tasks) to the record. A killed run resumes at
    its last evaluation: the loop's resume state (saved every eval_every steps) and the dev curve and losses so far
    live in `state` and beside it until the record is written.

    Returns:
        The record's training fields: steps, learning rate, dev curve, start / final / delta / best, losses,
        resumed_from, seconds and, with `heldout`, `mechanism`.
    """
    from cse.storage.runs import ResumeState
    from cse.training.job import build_model, training_phases
    from cse.training.loop import set_seed

    set_seed(cfg.seed)
    model = build_model(cfg, device)
    log(f"sts {state.name}: {cfg.max_steps} steps, lr {cfg.learning_rate:g}, on {device}")
    progress = state.with_suffix(".json")
    saved = json.loads(progress.read_text()) if progress.is_file() and ResumeState(state).exists() else {}
    curve = [tuple(p) for p in saved.get("curve", [])] or [(0, dev(model))]
    losses: list = saved.get("losses", [])
    spent = saved.get("seconds", 0.0)
    trainer = None
    log_losses = loss_logger(losses, ("rtd_accuracy",), every=10)
    t0 = time.perf_counter()

    def evaluate(m) -> float:
        score = dev(m)
        curve.append((trainer.step, score))
        return score

    def checkpoint(metrics: dict[str, float], step: int) -> None:
        log_losses(metrics, step)
        if "stsb_dev" in metrics:  # after each evaluation (the loop saves its state right after)
            seconds = spent + time.perf_counter() - t0
            progress.write_text(json.dumps({"curve": curve, "losses": losses, "seconds": seconds}))

    state.parent.mkdir(parents=True, exist_ok=True)
    trainer = protocol_trainer(model, cfg, training_phases(cfg, rows, None), device, state, evaluate, checkpoint)
    result = trainer.run()
    rec: dict[str, Any] = {
        "steps": result.steps,
        "learning_rate": cfg.learning_rate,
        **curve_fields(curve),
        "losses": losses,
        "resumed_from": result.resumed_from,
        "seconds": {"train_and_eval": round(spent + time.perf_counter() - t0, 1)},
    }
    if heldout is not None:
        rec["mechanism"] = probe_rows(model, *heldout)
    if finish is not None:
        rec.update(finish(model))
    log(f"sts {state.name}: {rec['start']:.2f} -> {rec['final']:.2f} ({rec['delta']:+.2f})")
    return rec


# ---------------------------------------------------------------------------------------------- parts and plan
def parts(home: Path) -> ev.Parts:
    """This protocol's parts in `home` (`evidence_base.Parts`; a part of another protocol is refused)."""
    return ev.Parts(home, protocol_hash(), record_id)


def device_set(r: dict[str, Any]) -> str:
    """`cpu` for a record of the protocol's own device (records without `device`), `gpu` for one run on a GPU
    (benchmarks/evidence_device.py): the two sets are summarised apart, never paired across."""
    return "gpu" if str(r.get("device", "cpu")).startswith("cuda") else "cpu"


def record_id(r: dict[str, Any]) -> tuple:
    return (r["kind"], r["method"], r["arm"], r.get("seed"), r.get("knob_value"), device_set(r))


def chosen_knob(records: list[dict[str, Any]], method: str) -> tuple[float | None, bool] | None:
    """The knob's rate the STS runs use: the first listed rate whose power check passes (passed: True), or the last
    when every listed rate was checked and none passes (False); None while a check is still to run."""
    _, candidates = KNOBS[method]
    arm = ARMS[method][0].name
    by_value = {
        r["knob_value"]: r for r in records if r["kind"] == "power" and r["method"] == method and r["arm"] == arm
    }
    for value in candidates:
        if value not in by_value:
            return None
        if by_value[value]["passes"]:
            return value, True
    return candidates[-1], False


def done_sts(records: list[dict[str, Any]], devices: str) -> set[tuple[str, str, int]]:
    """(method, arm, seed) of the STS records of one device set."""
    return {(r["method"], r["arm"], r["seed"]) for r in records if r["kind"] == "sts" and device_set(r) == devices}


def expected_sts(methods=None, seeds=None) -> list[tuple[str, str, int]]:
    return [
        (m, a.name, s)
        for m, arms in ARMS.items()
        if not methods or m in methods
        for s in seeds or PROTOCOL_V2["seeds"]
        for a in arms
    ]


# ---------------------------------------------------------------------------------------------- report
def summary(report: dict[str, Any], devices: str = "cpu") -> dict[str, Any]:
    """Per method: the power checks, the knob chosen, each arm's Delta / final (mean +- std over seeds), method -
    control paired by seed, and the mechanism figures on the real corruption, over the STS records of one device set
    (`device_set`; the power checks, run on the CPU, choose the knob of both)."""
    records = report.get("records", [])
    out: dict[str, Any] = {}
    for method, arms in ARMS.items():
        power = [r for r in records if r["kind"] == "power" and r["method"] == method]
        choice = chosen_knob(records, method)
        sts = [r for r in records if r["kind"] == "sts" and r["method"] == method and device_set(r) == devices]
        per_arm = {}
        for arm, ac in by_arm(sts, arms):
            entry = per_arm[arm.name] = arm_summary(arm, ac, ("delta", "start", "final"), "seconds")
            if mech := [r["mechanism"] for r in ac if "mechanism" in r]:
                entry["mechanism"] = {
                    k: mean_std([m[k] for m in mech]) for k in ("true_h", "rolled_h", "no_h", "gap", "constant_guess")
                }
        out[method] = {
            "power": sorted(power, key=lambda r: KNOBS[method][1].index(r["knob_value"])),
            "knob": None if choice is None else {"name": KNOBS[method][0], "value": choice[0], "passed": choice[1]},
            "arms": per_arm,
            "method_minus_control": method_minus_control(sts, arms),
        }
    return out


def rate_text(value: float | None, job_rate: float | None = None) -> str:
    if value is not None:
        return f"{value:g}"
    return "the job's" if job_rate is None else f"the job's ({job_rate:g})"


# A swap-task probe's five figures: their column titles and their cells (protocols 2 and 3).
PROBE_HEAD = "loss, true h | loss, rolled h | loss, no h | rolled − true | constant guess"


def probe_cells(p: dict[str, float]) -> str:
    return f"{p['true_h']:.4f} | {p['rolled_h']:.4f} | {p['no_h']:.4f} | {p['gap']:+.4f} | {p['constant_guess']:.4f}"


def power_table(report: dict[str, Any]) -> list[str]:
    s = report["summary"]
    lines = [
        f"| method | arm | knob | rate | {PROBE_HEAD} | power (≥ {PROTOCOL_V2['power']['min_gap']}) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, m in s.items():
        for r in m["power"]:
            lines.append(
                f"| {method} | {r['label']} | `{r['knob']}` | {rate_text(r['knob_value'], r.get('learning_rate'))} | "
                f"{probe_cells(r['probe'])} | {'yes' if r['passes'] else 'no'} |"
            )
    return lines


def sts_table(s: dict[str, Any]) -> list[str]:
    if not any(m["arms"] for m in s.values()):
        return ["(none measured yet)"]
    lines = [
        "| method | arm | knob used | seeds | start | final | Δ | method − this control (paired) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, m in s.items():
        ktxt = "–" if m["knob"] is None else _knob_text(m["knob"], f"`{m['knob']['name']}`")
        for name, a in m["arms"].items():
            lines.append(
                f"| {method} | {a['label']} | {ktxt} | {len(a['seeds'])} | {_pm(a['start'])} | {_pm(a['final'])} | "
                f"{_pm(a['delta'], signed=True)} | {paired_text(m['method_minus_control'].get(name))} |"
            )
    return lines


def _knob_text(knob: dict[str, Any], name: str) -> str:
    """The knob the STS runs used: `name` and its rate, marked when none of its power checks passed."""
    return f"{name} {rate_text(knob['value'])}" + (
        "" if knob["passed"] else " (no power: a rate its power check rejected)"
    )


def mechanism_table(s: dict[str, Any]) -> list[str]:
    if not any("mechanism" in a for m in s.values() for a in m["arms"].values()):
        return ["(none measured yet: it is measured at the end of each STS run whose RTD side learns)"]
    lines = [
        "| method | arm | seeds | loss, true h | loss, rolled h | loss, no h | rolled − true | constant guess |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, a in [(method, a) for method, m in s.items() for a in m["arms"].values() if "mechanism" in a]:
        me = a["mechanism"]
        lines.append(
            f"| {method} | {a['label']} | {len(a['seeds'])} | {_pm(me['true_h'], 4)} | {_pm(me['rolled_h'], 4)} | "
            f"{_pm(me['no_h'], 4)} | {_pm(me['gap'], 4, signed=True)} | {_pm(me['constant_guess'], 4)} |"
        )
    return lines


DEVICE_SETS = {"cpu": "on the CPU", "gpu": "on one GPU"}


def gpu_name(report: dict[str, Any]) -> str:
    """The GPU of the report's GPU records (`device` is `cuda: <name>`), or `a GPU` when it has none."""
    names = sorted(
        {str(r["device"]).removeprefix("cuda:").strip() for r in report.get("records", []) if device_set(r) == "gpu"}
    )
    return ", ".join(names) or "a GPU"


def status_line(report: dict[str, Any]) -> str:
    records = report.get("records", [])
    planned = expected_sts()
    power = [r for r in records if r["kind"] == "power"]
    sets = []
    for devices, where in DEVICE_SETS.items():
        done = done_sts(records, devices)
        if devices == "gpu" and not done:
            continue
        missing = [c for c in planned if c not in done]
        sets.append(
            f"{len(planned) - len(missing)} of its {len(planned)} STS runs measured {where}"
            + (
                ""
                if not missing
                else f" (partial: {len(missing)} still to run, so no STS row of that set is a verdict)"
            )
        )
    return f"Protocol 2 ({PROTOCOL_V2['steps']:,} steps): {len(power)} power checks; " + "; ".join(sets) + "."


GPU_SETTINGS = (
    "the same protocol, seeds and knobs (the CPU's power checks chose them), fp32, the packaged MiniLM's weights "
    "rounded to fp16 to travel (benchmarks/evidence_device.py)"
)


def generator_line(report: dict[str, Any]) -> str:
    g = report.get("generator")
    if not g or not g.get("heldout_top1"):
        return "Generator: not fitted yet."
    acc = g["heldout_top1"]
    return (
        f"Generator: MiniLM fine-tuned as a masked LM (backbone at {g['config']['backbone_lr']:g}, head at "
        f"{g['config']['lr']:g}, {g['steps']} steps, {g['seconds'] / 60:.0f} min): held-out masked-token top-1 "
        f"**{acc['fitted']:.4f}** on {g['heldout_positions']:,} positions of {g['heldout_sentences']:,} held-out "
        f"sentences (protocol 1's head on the frozen MiniLM: 0.1389; always the most frequent token "
        f"{acc.get('unigram_argmax', float('nan')):.4f})."
    )


def sections(report: dict[str, Any], captions: tuple[str, str, str]) -> list[str]:
    """The status and generator lines, then the power checks', STS runs' and mechanism's tables under `captions`."""
    tables = (power_table(report), sts_table(report["summary"]), mechanism_table(report["summary"]))
    lines = [status_line(report), "", generator_line(report)]
    for caption, table in zip(captions, tables):
        lines += ["", caption, "", *table]
    return lines


def markdown(report: dict[str, Any]) -> str:
    captions = (
        "## Power check: the swap task at the arm's exact settings (seed 0, held-out 1,024 sentences)",
        f"## STS-B dev, step 0 → step {PROTOCOL_V2['steps']} (Spearman × 100; mean ± std over seeds)",
        "## Mechanism on the real corruption (held-out 1,024 sentences, variant 0)",
    )
    lines = [
        f"# Evidence benchmark, protocol 2 ({report['protocol']}; CPU, MiniLM)",
        "",
        *sections(report, captions),
        "",
        *gpu_section(report, "## "),
        "Commands:",
        "",
        *[f"- `{c}`" for c in report.get("commands", [])],
    ]
    return "\n".join(lines) + "\n"


DOCS_BEGIN = "<!-- evidence-v2: `python -m benchmarks.evidence_v2 --merge --docs docs/evidence.md` renders it -->"
DOCS_END = "<!-- end evidence-v2 -->"


def docs_block(report: dict[str, Any]) -> str:
    """docs/evidence.md's protocol-2 block: status, generator, power checks, STS runs and mechanism rows."""
    captions = (
        "Power checks (swap task, seed 0, the arm's exact settings; held-out RTD loss):",
        f"STS-B dev, step 0 → {PROTOCOL_V2['steps']}, with the generator above and the knob the power check chose:",
        "Mechanism on the real corruption (held-out sentences):",
    )
    gpu = [""] if report.get("summary_gpu") else []
    return "\n".join([*sections(report, captions), *gpu, *gpu_section(report, "")]).rstrip("\n")


def gpu_section(report: dict[str, Any], heading: str) -> list[str]:
    """The STS runs of the GPU set, when there are any: its STS and mechanism tables under `heading` lines."""
    s = report.get("summary_gpu")
    if not s or not any(m["arms"] for m in s.values()):
        return []
    return [
        f"{heading}The same STS runs on one GPU ({gpu_name(report)}): {GPU_SETTINGS}",
        "",
        *sts_table(s),
        "",
        f"{heading}Mechanism, GPU runs" if heading else "Mechanism, GPU runs:",
        "",
        *mechanism_table(s),
        "",
    ]


def readme_rows(report: dict[str, Any]) -> list[str]:
    """The README table's protocol-2 rows (same columns as protocol 1's rows, labelled by protocol, and by device for
    the GPU set)."""
    rows = []
    for label, key in (("2", "summary"), ("2, GPU", "summary_gpu")):
        s = report.get(key)
        if s is None or (key == "summary_gpu" and not any(m["arms"] for m in s.values())):
            continue
        for method, arms in ARMS.items():
            m = s.get(method, {"arms": {}, "method_minus_control": {}, "knob": None})
            knob = m.get("knob")
            ktxt = "" if knob is None else ", " + _knob_text(knob, knob["name"].replace("_", " "))
            rows += control_rows(label, f"{arms[0].label}{ktxt}", arms, m)
    return rows


README_BEGIN = "<!-- evidence-table: `python -m benchmarks.evidence --report --readme README.md` renders it -->"
README_END = "<!-- end evidence-table -->"


def readme_table(report: dict[str, Any]) -> str:
    """The README's summary: one row per method and control (Delta of each, method - control paired by seed) of
    protocol 1 (benchmarks/evidence.py) and, when the report holds them, of protocol 2 (this module), each row
    labelled by its protocol, with the count of measured cells, rendered from the report so that the README states
    exactly what was measured."""
    s = report.get("summary") or ev.summary(report)
    n, missing = len(_cells(report)), len(report.get("missing", []))
    lines = [
        f"Protocol 1 ({ev.PROTOCOL['steps']} steps): measured {n} of its {n + missing} cells"
        + (
            "."
            if not missing
            else f" ({missing} still to run, so a row with fewer than {len(ev.PROTOCOL['seeds'])} seeds is not a verdict)."
        ),
    ]
    v2 = report.get("protocol_v2")
    if v2:
        lines.append(status_line(v2))
    lines += [
        "",
        "| protocol | method | control (what it removes) | seeds, method / control | Δ method | Δ control "
        "| method − control, paired by seed |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, arms in ev.ARMS.items():  # every method of the protocol, measured or not
        lines += control_rows("1", arms[0].label, arms, s.get(method, {"arms": {}, "method_minus_control": {}}))
    if v2:
        lines += readme_rows(v2)
    return "\n".join(lines)


def write_readme(report: dict[str, Any], readme: Path) -> None:
    """Replace the block between README_BEGIN and README_END of `readme` with `readme_table(report)`."""
    write_block(readme, README_BEGIN, README_END, readme_table(report))


def merge(home: Path, out: Path, command: str, readme: Path | None, docs: Path | None) -> int:
    """Join the parts into `out`'s `protocol_v2` (protocol 1's report there untouched) and render."""
    full = json.loads(out.read_text()) if out.is_file() else {}
    if full.get("protocol") not in (None, ev.protocol_hash()):
        raise SystemExit(f"{out}: protocol 1 report of hash {full.get('protocol')}, not {ev.protocol_hash()}")
    previous = full.get("protocol_v2") or {}
    if previous and previous.get("protocol") != protocol_hash():
        raise SystemExit(f"{out}: its protocol_v2 is of hash {previous.get('protocol')}, not {protocol_hash()}")
    loaded = parts(home).load_all()
    records = {record_id(r): r for r in previous.get("records", [])}
    records.update({record_id(r): r for part in loaded for r in part.get("records", [])})
    generator = previous.get("generator") or generator_in_home(home)
    for part in loaded:
        generator = part.get("generator") or generator
    report = {
        "benchmark": "evidence",
        "protocol": protocol_hash(),
        "protocol_text": PROTOCOL_V2,
        **arms_and_knobs(),
        "generator": generator,
        "records": sorted(
            records.values(), key=lambda r: (r["kind"] != "power", r["method"], r["arm"], r.get("seed") or 0)
        ),
        "environment": previous.get("environment") or cpu_environment(),
        "commands": previous.get("commands", []),
    }
    ev.add_commands(report, *[c for part in loaded for c in part.get("commands", [])], command)
    short = [r for r in report["records"] if r["kind"] == "sts" and r["steps"] != PROTOCOL_V2["steps"]]
    if short:
        raise SystemExit(
            "records of runs shorter than the protocol's steps (a rehearsal's?): "
            + ", ".join(f"{r['method']}/{r['arm']}/seed {r['seed']} ({r['steps']} steps)" for r in short)
        )
    report["summary"] = summary(report, "cpu")
    if any(device_set(r) == "gpu" for r in report["records"]):
        report["summary_gpu"] = summary(report, "gpu")
    report["complete"] = {d: set(expected_sts()) <= done_sts(report["records"], d) for d in DEVICE_SETS}
    full["protocol_v2"] = report
    write_json(full, out)
    out.with_name("evidence_v2.md").write_text(markdown(report))
    if readme is not None:
        write_readme(full, readme)
    if docs is not None:
        write_block(docs, DOCS_BEGIN, DOCS_END, docs_block(report))
    print(markdown(report))
    return 0


# ---------------------------------------------------------------------------------------------- main
def run_power(bench: Bench, methods: list[str], home: Path, save) -> None:
    """Each method's power checks in its knob's order, up to the first that passes (records already in a part are
    reused)."""
    for method in methods:
        arm = ARMS[method][0]
        for value in KNOBS[method][1]:
            done = {record_id(r): r for r in parts(home).records()}
            rid = ("power", method, arm.name, None, value, "cpu")
            rec = done.get(rid) or power_record(bench, method, arm, value)
            if rid not in done:
                save(rec)
            if rec["passes"]:
                break


def run_sts(bench: Bench, methods: list[str], seeds: list[int] | None, home: Path, save) -> None:
    """The STS runs not yet in a part, method and control of one seed after the other, at the chosen knob."""
    for method, arm_name, seed in expected_sts(methods, seeds):
        records = parts(home).records()
        if (method, arm_name, seed) in done_sts(records, "cpu"):
            continue
        choice = chosen_knob(records, method)
        if choice is None:
            log(f"{method}: its power checks are not all done; run --stages power first")
            return
        arm = next(a for a in ARMS[method] if a.name == arm_name)
        # every arm of the method at the chosen rate: the control differs from the method in lambda only
        save(sts_record(bench, method, arm, seed, choice[0], choice[1], home / "state"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--stages", default="power,sts", help="power, sts or both (in that order)")
    p.add_argument("--seeds", default=None, help="comma-separated subset of the protocol's seeds")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    p.add_argument("--part", default="main", help="this process's part file, <home>/parts/<part>.json")
    p.add_argument("--home", type=Path, default=REPO_ROOT / ".cse" / "evidence-v2", help="CSE_HOME: data, parts")
    p.add_argument("--merge", action="store_true", help="join the parts into --out and render, then exit")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--readme", type=Path, default=None, help="with --merge: render the README's evidence block")
    p.add_argument("--docs", type=Path, default=None, help="with --merge: render docs/evidence.md's protocol-2 block")
    args = p.parse_args(argv)
    command = command_line("benchmarks.evidence_v2", argv).strip()
    home = args.home.resolve()
    if args.merge:
        return merge(home, args.out, command, args.readme, args.docs)
    methods = ev.parse_methods(p, args.methods, ARMS)
    seeds = ev.parse_seeds(args.seeds)
    stages = [s.strip() for s in args.stages.split(",")]
    ev.use_home(home, args.threads)
    part = parts(home).load(args.part)
    ev.add_commands(part, command)
    part["environment"] = cpu_environment()
    log(f"protocol {protocol_hash()}; part {home / 'parts' / f'{args.part}.json'}; methods {methods}; stages {stages}")
    save = functools.partial(parts(home).write, args.part, part)
    bench = Bench(None)
    if "power" in stages:
        run_power(bench, methods, home, save)
    if "sts" in stages:
        part["generator"] = fit_v2_generator(bench)
        save()
        run_sts(Bench(f"generator:{part['generator']['key']}"), methods, seeds, home, save)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
