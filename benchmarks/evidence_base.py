"""Protocol 1 of the evidence benchmark (its PROTOCOL and ARMS: the whole of it, hashed into every cell) and what
both protocols share: the arms, the cached data stages (Bench), the protocol trainer, the report statistics and rows,
and the command-line and file helpers.

benchmarks/evidence.py runs protocol 1's cells and renders its report; benchmarks/evidence_v2.py (protocol 2) builds on
the same parts and renders the README's table of both protocols. evidence_v2 imports this module, not
benchmarks/evidence.py, which imports evidence_v2 for that table: the three modules form no import cycle.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.facts import MethodFacts, registry_facts
from benchmarks.machine import set_offline_environment

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


# ---------------------------------------------------------------------------------------------- the trainer
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


def write_block(path: Path, begin: str, end: str, body: str) -> None:
    """Replace what stands between the lines `begin` and `end` of `path` with `body`."""
    text = path.read_text(encoding="utf-8")
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no block between {begin!r} and {end!r} to render into")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{body}\n{end}{tail}", encoding="utf-8")


@dataclass(frozen=True)
class Parts:
    """A protocol's part files `<home>/parts/<name>.json` (`protocol`: its hash; a part of another is refused): each
    process writes its records into its own part as each ends, and a rerun finds them. `record_id(record)` says
    which records are the same run (a newer one replaces it)."""

    home: Path
    protocol: str
    record_id: Any

    def _checked(self, path: Path) -> dict[str, Any]:
        import json

        part = json.loads(path.read_text()) if path.is_file() else {"protocol": self.protocol, "records": []}
        if part.get("protocol") != self.protocol:
            raise SystemExit(f"{path} is of protocol {part.get('protocol')}, not {self.protocol}: use another --home")
        return part

    def load_all(self) -> list[dict[str, Any]]:
        return [self._checked(p) for p in sorted((self.home / "parts").glob("*.json"))]

    def records(self) -> list[dict[str, Any]]:
        return [r for part in self.load_all() for r in part.get("records", [])]

    def load(self, name: str) -> dict[str, Any]:
        """The part `name` (a new one when there is none)."""
        return self._checked(self.home / "parts" / f"{name}.json")

    def write(self, name: str, part: dict[str, Any], record: dict[str, Any] | None = None) -> None:
        """Write the part `name`, with `record` in place of any record of its id."""
        if record is not None:
            part["records"] = [r for r in part["records"] if self.record_id(r) != self.record_id(record)] + [record]
        write_json(part, self.home / "parts" / f"{name}.json")


def add_commands(report: dict[str, Any], *commands: str) -> None:
    """Append `commands` to the report's, each once."""
    report["commands"] = list(dict.fromkeys([*report.get("commands", []), *commands]))
