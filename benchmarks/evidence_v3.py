"""Evidence, protocol 3: power before verdicts. A positive control, a fair rate rule and a dose-response in λ for
D2CSE's CRTD and DiffCSE's RTD term, with every cell reported beside its power.

    python -m benchmarks.evidence_v3 export --home H --dest DIR [--methods M1,M2] [--seeds 0,1]       # CPU, here
    python -m benchmarks.evidence_v3 run --src DIR --home H2 [--device cuda] [--workers 12] [--steps N]  # the device
    python -m benchmarks.evidence_v3 merge --home H2 [--docs docs/evidence.md]

Protocol 2 (benchmarks/evidence_v2.py) ran its STS comparisons at each method's last listed rate when no rate passed
its power check, rates at which the discriminator's loss with the true h was at or above the constant guess; and it
had no arm showing that the discriminator reads h on real text when it must. Protocol 3 (`PROTOCOL_V3`; its hash is
stored with every record and pinned by tests/benchmarks/test_evidence_v3.py) was fixed and committed before any of its
runs. Encoder, data and precision are protocol 2's (the packaged MiniLM, fp32, max length 32, batch 32; the last 1,024
sentences of the Wiki1M sample held out, the 10,889 before them train), and so is the generator (protocol 2's MiniLM
fine-tuned as a masked LM). In order, per method:

1. Positive control (`control`): the method with λ = 1 and the encoder that makes h frozen (DiffCSE's BERT
   encoder; D2CSE's PLM is frozen by construction, its prompts learn), trained on protocol 2's swap task (seed 0,
   200 steps) at each rate of its knob, probed on the held-out swap corruption (the gate) and on the held-out real
   corruption (reported). The control passes when some rate gives rolled − true ≥ 0.05 on the swap corruption; when
   none does, the conditioning does not read h even where h is the only signal: the report says so and the method
   stops there.
2. Rate rule (`rate`): the method at its own λ on the swap task at each listed rate (seed 0, 200 steps); the chosen
   rate is `RATE_RULE` (`choose_rate`): never a rate whose true-h loss is above the constant guess's.
3. Dose-response (`dose`): λ ∈ {0, 0.005, 0.05, 0.5} at the chosen rate, each λ > 0 with the reference corruption and
   with the hard one (`corrupt.hard`: the generator's best token other than the original), λ = 0 once (the
   corruption is then never read), 6 paired seeds, each seed its own corruption; STS-B dev at step 0 and every
   `eval_every` steps, the seven STS tasks (test) at the end, the held-out RTD probe on the real corruption.
   Reported per cell: mean ± std, the difference to λ = 0 paired by seed and its power (`min_detectable`); per method
   and corruption, the trend across λ (`trend`).

`export` (here: the data stages, the corruption of each seed and corruption arm, the swap rows, the STS table and the
packaged MiniLM rounded to fp16, as benchmarks/evidence_device.py carries protocol 2) writes DIR; `run` trains what is
not yet in a part of `--home`, the stages in order, up to `--workers` runs at a time in processes of their own, each
record written as it ends (a rerun resumes); `--steps N` rehearses every stage in N steps whatever its gates say, and
`merge` refuses such records.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from benchmarks import evidence_device as ed
from benchmarks import evidence_v2 as v2
from benchmarks.evidence_base import Parts, _pm, job_settings, mean_std, smoke_config, stsb_dev, use_home, write_json
from benchmarks.machine import command_line

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results" / "evidence.json"
SEVEN = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")

# ---------------------------------------------------------------------------------------------- the protocol
RATE_RULE = (
    "among the knob's listed rates whose held-out swap-task RTD loss with the true h is at most the constant guess's "
    "(the binary entropy of the held-out replaced share), the rate with the largest rolled − true gap; gaps within "
    "`tie` of the largest are tied, and of those the rate with the lowest true-h loss is chosen; when no rate is "
    "admissible the method stops (no dose-response runs)"
)
PROTOCOL_V3: dict[str, Any] = {
    "version": 3,
    **v2.MINILM_SETTING,
    "generator": v2.GENERATOR,
    "mask_ratio": 0.3,
    "corruption_variants": 2,
    "swap": {"probability": 0.5, "variants": 2, "seed": 0},
    "knobs": {m: [k[0], list(k[1])] for m, k in v2.KNOBS.items()},
    "control": {
        "seed": 0,
        "steps": 200,
        "rtd_weight": 1.0,
        "frozen": "the encoder group (cse.models.methods.crtd.grad_group): DiffCSE's encoder; D2CSE has none trainable",
        "min_gap": 0.05,
        "rule": "passes when some listed rate gives rolled − true >= min_gap on the held-out swap corruption; "
        "otherwise the method stops here",
    },
    "rate": {"seed": 0, "steps": 200, "tie": 1e-4, "rule": RATE_RULE},
    "dose": {
        "rtd_weights": [0.0, 0.005, 0.05, 0.5],
        "corruptions": ["reference", "hard"],
        "seeds": [0, 1, 2, 3, 4, 5],
        "steps": 400,
        "epochs": 2,
        "eval_every": 200,
        "outcomes": ["STS-B dev at the last step (the final model, no selection)", "seven STS tasks' Avg. (test)"],
    },
    "power": {
        "alpha": 0.05,
        "power": 0.8,
        "rule": "per lambda > 0 cell, paired by seed against lambda = 0: the minimum detectable difference "
        "(t(1 - alpha/2, n-1) + t(power, n-1)) * sd / sqrt(n); a difference below it is not a verdict",
    },
    "trend": "per seed, the least-squares slope of the outcome on lambda's rank (0, 1, 2, 3; lambda = 0 shared by "
    "both corruptions); the mean slope over seeds, its exact two-sided sign-flip p over the 2^n sign assignments",
    "device_budget_s": 540,
}
CONTROL, DOSE = PROTOCOL_V3["control"], PROTOCOL_V3["dose"]
METHODS = tuple(v2.KNOBS)


def protocol_hash() -> str:
    from cse.storage.hashing import stable_hash

    return stable_hash({"protocol": PROTOCOL_V3})[:16]


def log(msg: str) -> None:
    print(f"[evidence-v3 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def record_id(r: dict[str, Any]) -> tuple:
    keys = ("kind", "method", "knob_value", "rtd_weight", "corruption", "seed")
    return (*(r.get(k) for k in keys), v2.device_set(r))


def parts(home: Path) -> Parts:
    return Parts(home, protocol_hash(), record_id)


def dose_cells() -> list[tuple[float, str]]:
    """(λ, corruption) of the dose-response, λ = 0 once (its corruption is never read: `reference`)."""
    weights, corruptions = DOSE["rtd_weights"], DOSE["corruptions"]
    return [(0.0, corruptions[0])] + [(w, c) for w in weights if w > 0 for c in corruptions]


# ---------------------------------------------------------------------------------------------- the rules
def choose_rate(checks: list[dict[str, Any]], tie: float = PROTOCOL_V3["rate"]["tie"]) -> dict[str, Any] | None:
    """`RATE_RULE` over the rate stage's records of one method (each with `knob_value` and its swap `probe`).

    Returns:
        The chosen record, or None when no rate is admissible (its true-h loss above the constant guess's).
    """
    fair = [c for c in checks if c["probe"]["true_h"] <= c["probe"]["constant_guess"]]
    if not fair:
        return None
    best = max(c["probe"]["gap"] for c in fair)
    return min((c for c in fair if c["probe"]["gap"] >= best - tie), key=lambda c: c["probe"]["true_h"])


def control_passes(checks: list[dict[str, Any]]) -> bool:
    """The positive control's gate: some rate's swap-task gap reaches `control.min_gap`."""
    return any(c["probe"]["gap"] >= CONTROL["min_gap"] for c in checks)


def _t(q: float, df: int) -> float:
    from scipy.stats import t

    return float(t.ppf(q, df))


def min_detectable(diffs: list[float]) -> float | None:
    """The paired minimum detectable difference (`PROTOCOL_V3["power"]`), None below 2 seeds."""
    n = len(diffs)
    if n < 2:
        return None
    power = PROTOCOL_V3["power"]
    factor = _t(1 - power["alpha"] / 2, n - 1) + _t(power["power"], n - 1)
    return factor * statistics.stdev(diffs) / math.sqrt(n)


def trend(per_seed: dict[int, list[float]]) -> dict[str, Any]:
    """The trend across λ: per seed the least-squares slope of its outcomes (in λ order) on their rank, the mean slope
    and its exact two-sided sign-flip p (`PROTOCOL_V3["trend"]`)."""
    slopes = []
    for values in per_seed.values():
        xs = range(len(values))
        mx, my = statistics.fmean(xs), statistics.fmean(values)
        slopes.append(sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sum((x - mx) ** 2 for x in xs))
    if not slopes:
        return {"n": 0, "mean_slope": None, "p": None}
    observed = abs(statistics.fmean(slopes))
    flips = [
        abs(statistics.fmean(s * f for s, f in zip(slopes, signs)))
        for signs in itertools.product((1, -1), repeat=len(slopes))
    ]
    p = sum(f >= observed - 1e-12 for f in flips) / len(flips)
    return {"n": len(slopes), "slopes": slopes, "mean_slope": statistics.fmean(slopes), "p": p}


# ---------------------------------------------------------------------------------------------- export (CPU, here)
def _job_settings(ingest, seed: int, steps: int, generator: str | None) -> dict[str, Any]:
    flat = {**PROTOCOL_V3, "epochs": DOSE["epochs"], "eval_every": DOSE["eval_every"]}
    return job_settings(flat, ingest, seed, steps, generator)


def export(home: Path, dest: Path, methods: list[str], seeds: list[int] | None, command: str = "") -> dict[str, Any]:
    """Write DIR/runs.json, the rows of every seed and corruption arm (`rows-<corruption key>.pkl.xz`), the swap task's
    rows beside the seed-0 real corruption's held-out rows (`swap-<tokens key>.pkl.xz`), DIR/sts.pkl.xz (the STS
    table: dev and test) and DIR/backbone (the packaged MiniLM in fp16)."""
    from benchmarks.evidence_base import Bench
    from cse.models.loading import load_tokenizer, resolve_model_path
    from cse.storage.evaluations import load_sts_input
    from cse.training.job import load_training_rows

    generator = v2.fit_v2_generator(Bench(None))
    bench = Bench(f"generator:{generator['key']}")
    dest.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"protocol": protocol_hash(), "generator": generator, "command": command, "methods": {}}
    for method in methods:
        entry: dict[str, Any] = {"configs": {}}
        for seed, corruption in itertools.product(seeds or DOSE["seeds"], DOSE["corruptions"]):
            hard = {"corrupt": {"hard": corruption == "hard"}}
            cfg = smoke_config(method, _job_settings(bench.ingest, seed, DOSE["steps"], bench.generator()), hard)
            tokens = bench.tokens(cfg.dataset, cfg)
            cor = bench.corruption(tokens, cfg)
            pad = load_tokenizer(cfg.backbone).pad_token_id
            rows_file = f"rows-{cor.key}.pkl.xz"
            if not (dest / rows_file).is_file():
                rows, _ = load_training_rows(cfg, bench.root, tokens, cor, None, pad)
                all_rows, heldout = bench.heldout(tokens, cor, pad, PROTOCOL_V3["heldout_sentences"])
                ed.write_pickle(dest / rows_file, {"rows": rows, "heldout_rows": all_rows, "heldout": heldout})
            entry["configs"][f"{seed}-{corruption}"] = {"config": cfg.model_dump(mode="json"), "rows": rows_file}
            if seed == CONTROL["seed"] and corruption == DOSE["corruptions"][0]:
                entry["swap"] = f"swap-{tokens.key}.pkl.xz"
                if not (dest / entry["swap"]).is_file():
                    train_rows, swap_rows, swap_heldout = v2.swap_task_rows(bench, cfg)
                    real_rows, real_heldout = bench.heldout(tokens, cor, pad, PROTOCOL_V3["heldout_sentences"])
                    swap = {"train_rows": train_rows, "all_rows": swap_rows, "heldout": swap_heldout}
                    ed.write_pickle(
                        dest / entry["swap"], {**swap, "real_rows": real_rows, "real_heldout": real_heldout}
                    )
            log(f"exported {method} seed {seed} {corruption} (corruption {cor.key})")
        index["methods"][method] = entry
    ed.write_pickle(dest / "sts.pkl.xz", load_sts_input(bench.sts.key, bench.root).table)
    ed.export_backbone(Path(resolve_model_path(PROTOCOL_V3["backbone"])), dest / "backbone")
    (dest / "runs.json").write_text(json.dumps(index, indent=1) + "\n")
    return index


# ---------------------------------------------------------------------------------------------- one run (any device)
def run_config(entry: dict[str, Any], spec: dict[str, Any], backbone: Path):
    """The run's TrainConfig: its seed's and corruption's exported config, the device, the backbone, its steps, λ and
    the knob's rate."""
    from cse.config.presets import deep_merge
    from cse.config.training import TrainConfig

    seed = spec["seed"] if spec["kind"] == "dose" else CONTROL["seed"]
    corruption = spec["corruption"] if spec["kind"] == "dose" else DOSE["corruptions"][0]
    model: dict[str, Any] = {"rtd_weight": spec["rtd_weight"]}
    if spec["knob_value"] is not None:
        model[PROTOCOL_V3["knobs"][spec["method"]][0]] = spec["knob_value"]
    steps = spec["steps"]
    overrides = {"backbone": str(backbone), "device": spec["device_type"], "max_steps": steps, "model": model}
    if spec["rehearsal"]:
        overrides["eval_steps"] = max(1, steps // 2)
    cfg = entry["configs"][f"{seed}-{corruption}"]["config"]
    return TrainConfig.model_validate(deep_merge(cfg, overrides))


def run_spec(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Train one run of `spec` (a control, rate or dose run) from the export in `spec["src"]` and return its record;
    None when the device budget's deadline has passed before it starts."""
    if time.time() > spec["deadline"]:
        return None
    import torch

    from cse.evaluation.evaluator import Evaluator
    from cse.models.methods.crtd import grad_group

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    src, device = Path(spec["src"]), torch.device(spec["device_type"])
    entry = json.loads((src / "runs.json").read_text())["methods"][spec["method"]]
    cfg = run_config(entry, spec, ed.restore_backbone(src / "backbone"))
    keys = ("kind", "method", "knob_value", "rtd_weight", "corruption", "seed", "device")
    rec: dict[str, Any] = {k: spec[k] for k in keys} | {"protocol": protocol_hash()}
    rec["knob"] = PROTOCOL_V3["knobs"][spec["method"]][0]
    rec["learning_rate"] = cfg.learning_rate
    t0 = time.perf_counter()
    if spec["kind"] != "dose":
        data = ed.read_pickle(src / entry["swap"])
        freeze = (lambda name: grad_group(name) == "encoder") if spec["kind"] == "control" else None
        model, rec["steps"], rec["losses"], _ = v2.train_on_swap(cfg, data["train_rows"], device, freeze)
        rec["probe"] = v2.probe_rows(model, data["all_rows"], data["heldout"])
        if spec["kind"] == "control":
            rec["real"] = v2.probe_rows(model, data["real_rows"], data["real_heldout"])
        rec["seconds"] = {"train_and_eval": round(time.perf_counter() - t0, 1)}
    else:
        data = ed.read_pickle(src / entry["configs"][f"{spec['seed']}-{spec['corruption']}"]["rows"])
        evaluator = Evaluator(ed.read_pickle(src / "sts.pkl.xz"))
        heldout = (data["heldout_rows"], data["heldout"]) if spec["rtd_weight"] > 0 else None
        state = Path(spec["state"]) / "-".join([*(str(rec[k]) for k in keys[1:6]), protocol_hash()])

        def seven(model) -> dict[str, Any]:
            scores = evaluator.run(model, mode="test", batch_size=128, precision="fp32").metrics()
            return {"sts": {k: round(float(scores[k]), 2) for k in (*SEVEN, "sts_avg")}}

        dev = functools.partial(stsb_dev, evaluator)
        rec.update(v2.train_sts(cfg, data["rows"], heldout, dev, state, device, finish=seven))
    rec["seconds"]["total"] = round(time.perf_counter() - t0, 1)
    return rec


# ---------------------------------------------------------------------------------------------- the stages
def _spec(kind: str, method: str, knob_value, rtd_weight: float, corruption: str | None, seed: int | None, **common):
    return dict(
        common, kind=kind, method=method, knob_value=knob_value, rtd_weight=rtd_weight, corruption=corruption, seed=seed
    )


def stage_specs(records: list[dict[str, Any]], methods, seeds, rehearsal: bool, common: dict[str, Any]):
    """The runs of the next stage not yet recorded: the control and rate runs, then (their gates passed; in a
    rehearsal whatever they say) the dose-response at the chosen rate. Returns (specs, lines saying why a method
    stopped)."""
    done = {record_id(r) for r in records}
    specs, stops = [], []
    swap = [
        _spec(
            k,
            m,
            v,
            CONTROL["rtd_weight"] if k == "control" else None,
            None,
            None,
            steps=PROTOCOL_V3[k]["steps"],
            **common,
        )
        for m in methods
        for k in ("control", "rate")
        for v in PROTOCOL_V3["knobs"][m][1]
    ]
    for s in swap:
        if s["rtd_weight"] is None:  # the rate stage: the method's own λ (its preset's)
            s["rtd_weight"] = smoke_config(s["method"]).model.rtd_weight
    specs = [s for s in swap if record_id(s) not in done]
    if specs:
        return specs, stops
    for m in methods:
        control = [r for r in records if r["kind"] == "control" and r["method"] == m]
        chosen = choose_rate([r for r in records if r["kind"] == "rate" and r["method"] == m])
        if not control_passes(control):
            stops.append(
                f"{m}: the positive control does not read h (no rate gives rolled − true ≥ "
                f"{CONTROL['min_gap']} on the swap task): the conditioning does not work on this setting"
            )
            if not rehearsal:
                continue
        if chosen is None:
            stops.append(f"{m}: no admissible rate (every rate's true-h loss is above the constant guess's)")
            if not rehearsal:
                continue
        rate = chosen["knob_value"] if chosen else PROTOCOL_V3["knobs"][m][1][0]
        for seed in seeds or DOSE["seeds"]:
            for w, c in dose_cells():
                s = _spec("dose", m, rate, w, c, seed, steps=DOSE["steps"], **common)
                if record_id(s) not in done:
                    specs.append(s)
    return specs, stops


def run(
    src: Path,
    home: Path,
    part: str,
    device_name: str,
    methods,
    seeds,
    steps: int | None,
    workers: int,
    threads: int | None = None,
    command: str = "",
    state: Path | None = None,
) -> int:
    """Train the protocol's runs from the export `src` on `device_name`, stage by stage (see the module's text)."""
    import multiprocessing

    import torch

    index = json.loads((src / "runs.json").read_text())
    if index["protocol"] != protocol_hash():
        raise SystemExit(f"{src} was exported under protocol {index['protocol']}, not {protocol_hash()}")
    device = torch.device(device_name)
    label = ed.device_label(device)
    store = parts(home)
    saved = store.load(part)
    saved["generator"] = index["generator"]
    saved["commands"] = list(
        dict.fromkeys([*([index["command"]] if index.get("command") else []), *saved.get("commands", []), command])
    )
    saved["environment"] = {"device": label, "torch": torch.__version__}
    deadline = time.time() + PROTOCOL_V3["device_budget_s"]
    common = {
        "src": str(src),
        "state": str(state or home / "state"),
        "device": label,
        "device_type": device.type,
        "threads": threads,
        "rehearsal": steps is not None,
        "deadline": deadline,
    }
    methods = [m for m in methods if m in index["methods"]]
    while True:
        specs, stops = stage_specs(store.records(), methods, seeds, steps is not None, common)
        for line in stops:
            log(line)
        if not specs:
            break
        if steps is not None:
            specs = [dict(s, steps=steps) for s in specs]
        log(f"{len(specs)} runs ({', '.join(sorted({s['kind'] for s in specs}))}) on {label}, {workers} at a time")
        if workers <= 1:
            results = (run_spec(s) for s in specs)
        else:
            pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
            results = (f.result() for f in as_completed([pool.submit(run_spec, s) for s in specs]))
        finished = 0
        for rec in results:
            if rec is not None:
                store.write(part, saved, rec)
                finished += 1
        if workers > 1:
            pool.shutdown()
        if finished < len(specs):
            log(f"the device budget ({PROTOCOL_V3['device_budget_s']} s) is spent: rerun to resume")
            break
    log("done")
    return 0


# ---------------------------------------------------------------------------------------------- report
def expected_steps(r: dict[str, Any]) -> int:
    return DOSE["steps"] if r["kind"] == "dose" else PROTOCOL_V3[r["kind"]]["steps"]


def _knob_order(method: str, r: dict[str, Any]) -> int:
    return PROTOCOL_V3["knobs"][method][1].index(r["knob_value"])


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: the control and rate records (knob order), the gate, the chosen rate, each dose cell's figures
    (final STS-B dev, seven-task Avg., held-out gap; the pair with λ = 0 and its power) and the trends."""
    out: dict[str, Any] = {}
    for method in METHODS:
        own = [r for r in records if r["method"] == method]
        control = sorted((r for r in own if r["kind"] == "control"), key=lambda r: _knob_order(method, r))
        rate = sorted((r for r in own if r["kind"] == "rate"), key=lambda r: _knob_order(method, r))
        chosen = choose_rate(rate) if len(rate) == len(PROTOCOL_V3["knobs"][method][1]) else None
        dose = [r for r in own if r["kind"] == "dose"]
        base = {r["seed"]: r for r in dose if r["rtd_weight"] == 0.0}
        cells = []
        for w, c in dose_cells():
            rs = sorted((r for r in dose if r["rtd_weight"] == w and r["corruption"] == c), key=lambda r: r["seed"])
            cell: dict[str, Any] = {"rtd_weight": w, "corruption": c, "seeds": [r["seed"] for r in rs]}
            for name, get in (("final", lambda r: r["final"]), ("sts_avg", lambda r: r["sts"]["sts_avg"])):
                cell[name] = mean_std([get(r) for r in rs])
                if w > 0:
                    diffs = [get(r) - get(base[r["seed"]]) for r in rs if r["seed"] in base]
                    cell[f"{name}_vs_0"] = {**mean_std(diffs), "min_detectable": min_detectable(diffs)}
            if mech := [r["mechanism"]["gap"] for r in rs if "mechanism" in r]:
                cell["gap"] = mean_std(mech)
            cells.append(cell)
        trends = {}
        for c in DOSE["corruptions"]:
            for name in ("final", "sts_avg"):
                per_seed = {}
                for seed, b in base.items():
                    row = [b] + [
                        next(
                            (r for r in dose if r["seed"] == seed and r["rtd_weight"] == w and r["corruption"] == c),
                            None,
                        )
                        for w in DOSE["rtd_weights"][1:]
                    ]
                    if all(row):
                        per_seed[seed] = [r["final"] if name == "final" else r["sts"]["sts_avg"] for r in row]
                trends[f"{c}/{name}"] = trend(per_seed)
        out[method] = {
            "control": control,
            "control_passes": control_passes(control) if control else None,
            "rate": rate,
            "chosen_rate": None if chosen is None else chosen["knob_value"],
            "cells": cells,
            "trends": trends,
        }
    return out


def report_lines(s: dict[str, Any]) -> list[str]:
    """The control, rate, dose-response and trend tables of a summary."""
    if not any(m["control"] or m["rate"] or any(c["seeds"] for c in m["cells"]) for m in s.values()):
        return ["(none measured yet: the runs need a GPU; `run` above is the prepared command)"]
    lines = [
        f"Positive control (λ = {CONTROL['rtd_weight']}, encoder frozen; swap task, seed 0):",
        "",
        f"| method | rate | {v2.PROBE_HEAD} | real corruption: rolled − true | reads h (≥ {CONTROL['min_gap']}) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, m in s.items():
        for r in m["control"]:
            real = r.get("real", {}).get("gap")
            lines.append(
                f"| {method} | {v2.rate_text(r['knob_value'], r.get('learning_rate'))} | {v2.probe_cells(r['probe'])}"
                f" | {'–' if real is None else f'{real:+.4f}'} | "
                f"{'yes' if r['probe']['gap'] >= CONTROL['min_gap'] else 'no'} |"
            )
    lines += [
        "",
        "Rate rule (the method's λ; swap task, seed 0):",
        "",
        f"| method | rate | {v2.PROBE_HEAD} | admissible | chosen |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, m in s.items():
        for r in m["rate"]:
            p = r["probe"]
            lines.append(
                f"| {method} | {v2.rate_text(r['knob_value'], r.get('learning_rate'))} | {v2.probe_cells(p)} | "
                f"{'yes' if p['true_h'] <= p['constant_guess'] else 'no'} | "
                f"{'**yes**' if r['knob_value'] == m['chosen_rate'] and m['chosen_rate'] is not None else ''} |"
            )
    lines += [
        "",
        "Dose-response (final STS-B dev and seven-task Avg., × 100; against λ = 0 paired by seed, with the "
        "minimum detectable difference at 80 % power):",
        "",
        "| method | λ | corruption | seeds | STS-B dev | − λ 0 (detectable) | Avg. | − λ 0 (detectable) "
        "| held-out rolled − true |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def pair(d):
        if d is None or d["mean"] is None:
            return "–"
        mde = d.get("min_detectable")
        return f"{_pm(d, signed=True)} ({'–' if mde is None else f'{mde:.2f}'})"

    for method, m in s.items():
        for c in m["cells"]:
            if c["seeds"]:
                lines.append(
                    f"| {method} | {c['rtd_weight']:g} | {c['corruption']} | {len(c['seeds'])} | "
                    f"{_pm(c['final'])} | {pair(c.get('final_vs_0'))} | {_pm(c['sts_avg'])} | "
                    f"{pair(c.get('sts_avg_vs_0'))} | {_pm(c.get('gap'), 4, signed=True)} |"
                )
    lines += [
        "",
        "Trend across λ (mean per-seed slope per λ step; exact sign-flip p):",
        "",
        "| method | corruption / outcome | seeds | mean slope | p |",
        "|---|---|---|---|---|",
    ]
    for method, m in s.items():
        for name, t in m["trends"].items():
            if t["n"]:
                lines.append(f"| {method} | {name} | {t['n']} | {t['mean_slope']:+.3f} | {t['p']:.3f} |")
    return lines


DOCS_BEGIN = "<!-- evidence-v3: `python -m benchmarks.evidence_v3 merge --docs docs/evidence.md` renders it -->"
DOCS_END = "<!-- end evidence-v3 -->"


def merge(home: Path, out: Path, command: str, docs: Path | None) -> dict[str, Any]:
    """Join the parts into `out`'s `protocol_v3` (protocols 1 and 2 there untouched), refusing records of runs
    shorter than the protocol's (a rehearsal's), and render benchmarks/results/evidence_v3.md and `docs`' block."""
    from benchmarks.evidence_base import add_commands, write_block

    full = json.loads(out.read_text()) if out.is_file() else {}
    previous = full.get("protocol_v3") or {}
    if previous and previous.get("protocol") != protocol_hash():
        raise SystemExit(f"{out}: its protocol_v3 is of hash {previous.get('protocol')}, not {protocol_hash()}")
    records = {record_id(r): r for r in previous.get("records", [])}
    loaded = parts(home).load_all()
    records.update({record_id(r): r for part in loaded for r in part.get("records", [])})
    if short := [r for r in records.values() if r["steps"] != expected_steps(r)]:
        raise SystemExit(
            "records of runs shorter than the protocol's steps (a rehearsal's?): "
            + ", ".join(f"{r['kind']} {r['method']} ({r['steps']} steps)" for r in short)
        )
    report = {
        "benchmark": "evidence",
        "protocol": protocol_hash(),
        "protocol_text": PROTOCOL_V3,
        "records": sorted(records.values(), key=lambda r: json.dumps(record_id(r), default=str)),
        "commands": previous.get("commands", []),
    }
    add_commands(report, *[c for p in loaded for c in p.get("commands", [])], command)
    report["summary"] = summary(report["records"])
    full["protocol_v3"] = report
    write_json(full, out)
    lines = [
        f"# Evidence benchmark, protocol 3 ({protocol_hash()})",
        "",
        *report_lines(report["summary"]),
        "",
        "Commands:",
        "",
        *[f"- `{c}`" for c in report["commands"]],
    ]
    out.with_name("evidence_v3.md").write_text("\n".join(lines) + "\n")
    if docs is not None:
        write_block(docs, DOCS_BEGIN, DOCS_END, "\n".join(report_lines(report["summary"])))
    return report


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    e = sub.add_parser("export", help="write what the runs need into --dest (the data stages, here)")
    e.add_argument("--dest", type=Path, required=True)
    r = sub.add_parser("run", help="train the protocol's runs from an export, stage by stage")
    r.add_argument("--src", type=Path, required=True, help="an export's folder")
    r.add_argument("--part", default="main")
    r.add_argument("--device", default="cuda")
    r.add_argument("--workers", type=int, default=1, help="runs at a time, each in a process of its own")
    r.add_argument("--threads", type=int, default=None, help="torch intra-op threads per run")
    r.add_argument("--steps", type=int, default=None, help="a rehearsal of N steps per run (refused by merge)")
    r.add_argument("--state", type=Path, default=None, help="the runs' resume states (default: <home>/state)")
    g = sub.add_parser("merge", help="join the parts into --out and render")
    g.add_argument("--out", type=Path, default=RESULTS)
    g.add_argument("--docs", type=Path, default=None, help="render docs/evidence.md's protocol-3 block")
    for q in (e, r, g):
        q.add_argument("--home", type=Path, default=REPO_ROOT / ".cse" / "evidence-v3", help="data (export), parts")
    for q in (e, r):
        q.add_argument("--methods", default=",".join(METHODS))
        q.add_argument("--seeds", default=None)
    args = p.parse_args(argv)
    home = args.home.resolve()
    command = command_line("benchmarks.evidence_v3", argv).strip()
    if args.verb == "merge":
        merge(home, args.out, command, args.docs)
        return 0
    from benchmarks.evidence_base import parse_methods, parse_seeds

    methods, seeds = parse_methods(p, args.methods, METHODS), parse_seeds(args.seeds)
    if args.verb == "export":
        use_home(home)
        index = export(home, args.dest.resolve(), methods, seeds, command)
        log(f"{args.dest}: {len(index['methods'])} methods exported")
        return 0
    return run(
        args.src.resolve(),
        home,
        args.part,
        args.device,
        methods,
        seeds,
        args.steps,
        args.workers,
        args.threads,
        command,
        args.state,
    )


if __name__ == "__main__":
    sys.exit(main())
