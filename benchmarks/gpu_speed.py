"""How fast a training step is on the GPU, switch by switch, and what a whole run costs: `make gpu-speed`.

    python benchmarks/gpu_speed.py [--device auto|cuda|cpu] [--out DIR] [--methods d2cse,simcse,...]
        [--modes reference,eager,compiled] [--steps 30] [--warmup 5] [--profile-steps 3] [--compile-backend B]
        [--budget-s 420] [--skip-peer]

Every method's `default` preset at its real batch and length on a random-initialised BERT-base, bf16, through the real
`cse.training.loop.Trainer.run` (its log cadence, `log_steps` of the preset, included), in three modes:

- `reference`: the step as it was first measured (2026-11-24): AdamW without fused kernels, the frozen weights cast
  at every use, the loss read on the host at every step, eager;
- `eager`: today's defaults without compilation: fused AdamW, the frozen weights cast once (training/precision.py),
  nothing read on the host between log steps (the non-finite guard on the device);
- `compiled`: the same plus `torch.compile` of the whole step as one graph, replayed as CUDA graphs
  (`mode="reduce-overhead"`; on CPU the rehearsal traces it with the `aot_eager` backend).

Per row: ms/step (wall time of `--steps` steps after `--warmup`, synchronised only at the window's ends), tokens/s,
MFU (FLOPs of one step counted by `torch.utils.flop_counter.FlopCounterMode` on the eager step ÷ step time ÷ the
GPU's dense bf16 peak), peak memory, the warm-up's wall time (it holds the compilation), and from `torch.profiler`
over `--profile-steps` more steps: device kernels per step, host launch calls per step (kernel and graph launches,
copies) and the GPU-busy share (summed device time ÷ wall time).

Per method, on the compiled model: one resume-state write (the training thread's share: the snapshot copied to host
memory; the background thread's: serialising, hashing, writing) and one dev evaluation (3,000 sentences of 8–40
tokens, STS-B dev's size, fp32 as the selection evaluates, with the batches kept on the device after the first
evaluation), and the projected whole run: the preset's steps on the real data × ms/step + its evaluations
(every `eval_steps`) + its state writes (every `checkpoint_steps`), with their share of it.

Peer: sentence-transformers' own `SentenceTransformerTrainer` with `MultipleNegativesRankingLoss` in the SimCSE-unsup
setting (the same sentence twice, batch 64, 32 tokens, random BERT-base with CLS pooling, bf16) beside our SimCSE step
in the same process.

The rows are written to `<out>/gpu_speed-<device>.json` and `.md` after every measurement; `--budget-s` skips what
would start after that many seconds (the lent GPU's minutes are few), saying so in the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np
import torch

from benchmarks.gpu_check import (
    METHODS,
    benchmark_trainer,
    count_step_flops,
    device_peak,
    device_slug,
    last_phase_batch,
    projected_steps,
    report_header,
    synthetic_tokenizer,
)
from benchmarks.machine import command_line, subject_method, sync, timed
from benchmarks.step_profile import device_events
from cse.config.training import resolve_train_config
from cse.training.loop import TrainerHooks

MODES = {
    "reference": {"fused_adamw": False, "cast_frozen_weights": False, "compile": False},
    "eager": {"fused_adamw": True, "cast_frozen_weights": True, "compile": False},
    "compiled": {"fused_adamw": True, "cast_frozen_weights": True, "compile": True},
    # (CUDA only, `--extra-modes`: the whole step as CUDA graphs without inductor's code generation: dynamo's
    # "cudagraphs" backend, AOTAutograd's graphs run by aten ops; compiles in seconds)
    "cudagraphs": {"fused_adamw": True, "cast_frozen_weights": True, "compile": True, "compile_backend": "cudagraphs"},
}
DEV_SENTENCES = 3000  # STS-B dev: 1,500 pairs
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


class _Windows(TrainerHooks):
    """Marks the timed window (synchronised at both ends) and runs the profiler over the steps after it."""

    def __init__(self, device: torch.device, start: int, stop: int, profile_stop: int, profile: bool):
        self.device, self.start, self.stop, self.profile_stop = device, start, stop, profile_stop
        self.profile = profile
        self.prof = None
        self.t_begin = self.t0 = self.t1 = None
        self.wait0 = self.wait1 = 0.0

    def on_step_start(self, trainer, batch):
        if self.t_begin is None:
            self.t_begin = time.perf_counter()

    def on_step_end(self, trainer, batch, metrics):
        if trainer.step == self.start:
            sync(self.device)
            self.t0, self.wait0 = time.perf_counter(), trainer.host_wait_s
        if trainer.step == self.stop:
            sync(self.device)
            self.t1, self.wait1 = time.perf_counter(), trainer.host_wait_s
            if self.profile:
                from torch.profiler import ProfilerActivity, profile

                cuda = self.device.type == "cuda"
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                self.prof = profile(activities=activities)
                self.prof.start()
                self.prof_t0 = time.perf_counter()
        if self.prof is not None and trainer.step == self.profile_stop:
            sync(self.device)
            self.prof_wall = time.perf_counter() - self.prof_t0
            self.prof.stop()


def _profile_summary(win: _Windows, steps: int, cuda: bool) -> dict:
    if win.prof is None:
        return {}
    device = device_events(win.prof)
    launches = [e for e in win.prof.events() if e.name in LAUNCH_CALLS or e.name.startswith("cudaMemcpy")]
    busy = sum(e.device_time for e in device) / 1e6  # microseconds → s
    return {
        "profiled_steps": steps,
        "kernels_per_step": round(len(device) / steps, 1) if cuda else None,
        "launch_calls_per_step": round(len(launches) / steps, 1) if cuda else None,
        "graph_launches_per_step": round(sum(e.name == "cudaGraphLaunch" for e in launches) / steps, 1)
        if cuda
        else None,
        "gpu_busy_share": round(busy / win.prof_wall, 3) if cuda else None,
    }


def state_overhead(trainer) -> dict:
    """One resume-state write of `trainer`: the training thread's part (snapshot) and the background write."""
    trainer.cfg = dataclasses.replace(trainer.cfg, save_state=True)
    with tempfile.TemporaryDirectory(prefix="gpu-speed-state-") as folder:
        from cse.storage.runs import ResumeState
        from cse.training.state_writer import StateWriter

        trainer.state = ResumeState(Path(folder) / "state")
        trainer.writer = StateWriter(trainer.state, background=True)
        blocked = []
        for _ in range(2):
            t0 = time.perf_counter()
            trainer.save_state(force=True)
            blocked.append(time.perf_counter() - t0)
            trainer.writer.wait()
        size = sum(p.stat().st_size for p in trainer.state.folder.iterdir())
        trainer.writer.close()
    return {
        "state_mib": round(size / 2**20, 1),
        "snapshot_s": round(min(blocked), 3),
        "write_s": round(trainer.writer.write_s / max(trainer.writer.writes, 1), 3),
    }


def eval_overhead(model, tokenizer, device) -> dict:
    """One dev evaluation's embedding pass: 3,000 sentences of 8–40 tokens, batch 128, fp32 (the selection's)."""
    from cse.evaluation.encode import DeviceBatches, embed_token_ids

    rng = np.random.default_rng(0)
    n = DEV_SENTENCES if device.type == "cuda" else 64
    words = [f"w{i}" for i in range(1000, 20000)]  # (single tokens of the synthetic vocabulary)
    sentences = [" ".join(rng.choice(words, size=int(rng.integers(6, 39)))) for _ in range(n)]
    ids = model.token_ids(sentences)  # the method's own input (DiffAug: its prompt template)
    embed = lambda cache: embed_token_ids(model, ids, batch_size=128, precision="fp32", device_cache=cache)
    cache = DeviceBatches()  # (the first run of each: warm-up / filling the cache)
    times = [timed(lambda c=c: embed(c), device) for c in (None, None, cache, cache)]
    return {"dev_sentences": n, "eval_s": round(times[1], 3), "eval_s_device_batches": round(times[3], 3)}


def whole_run(method: str, trainer, result: dict, tokenizer, device: torch.device) -> dict:
    """State and evaluation overhead on `trainer`'s model, and the projected run at its mode's step time."""
    state, ev = state_overhead(trainer), eval_overhead(trainer.model, tokenizer, device)
    last = next(r for r in reversed(result["rows"]) if r.get("method") == method and "ms_per_step" in r)
    return {"mode": last["mode"], "state": state, "evaluation": ev, "projected": projected_run(method, last, state, ev)}


def projected_run(method: str, row: dict, state: dict, ev: dict) -> dict:
    """The preset's whole run on the real data at this row's step time, with its evaluations (every `eval_steps`) and
    its resume states at the trainer's default cadence on CUDA: at a checkpoint step once `STATE_COST_FACTOR` × a
    state's cost (snapshot + background write) has passed since the last (training/loop.py), each blocking training
    for its snapshot, plus the last step's."""
    from cse.training.loop import STATE_COST_FACTOR

    cfg = resolve_train_config("default", method=method)
    steps = projected_steps(cfg)
    evals = steps // cfg.eval_steps
    step_s = row["ms_per_step"] / 1e3
    train_s = steps * step_s
    every = max(1, cfg.checkpoint_steps or cfg.eval_steps)
    interval_steps = every * max(
        1, math.ceil(STATE_COST_FACTOR * (state["snapshot_s"] + state["write_s"]) / (every * step_s))
    )
    writes = steps // interval_steps + 1  # (+ the last step's)
    eval_s = evals * ev["eval_s_device_batches"]
    state_s = writes * state["snapshot_s"]
    total = train_s + eval_s + state_s
    return {
        "steps": steps,
        "evaluations": evals,
        "state_writes": writes,
        "state_every_steps": interval_steps,
        "train_min": round(train_s / 60, 2),
        "eval_min": round(eval_s / 60, 2),
        "state_min": round(state_s / 60, 2),
        "total_min": round(total / 60, 2),
        "overhead_share": round((eval_s + state_s) / total, 4),
    }


def render(path: Path) -> None:
    """Recompute the projected runs of a saved result from its measured rows (today's cadence) and rewrite its `.md`."""
    result = json.loads(path.read_text())
    for method, run in result["runs"].items():
        if "error" not in run:
            row = next(r for r in result["rows"] if r.get("method") == method and r.get("mode") == run["mode"])
            run["projected"] = projected_run(method, row, run["state"], run["evaluation"])
    path.write_text(json.dumps(result, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown(result))


def random_sentences(n: int, length: int) -> list[str]:
    """`n` sentences of `length` random words (`w1000` … `w2999`, seeded): the peer's training data."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(1000, 3000)]
    return [" ".join(rng.choice(words, size=length)) for _ in range(n)]


def peer_arguments(folder: str, batch: int, max_steps: int, cuda: bool):
    """The peer trainer's arguments: `max_steps` at `batch`, lr 3e-5, bf16 on CUDA, nothing saved or reported."""
    from sentence_transformers import SentenceTransformerTrainingArguments

    return SentenceTransformerTrainingArguments(
        output_dir=folder,
        per_device_train_batch_size=batch,
        max_steps=max_steps,
        learning_rate=3e-5,
        bf16=cuda,
        use_cpu=not cuda,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        dataloader_drop_last=True,
        disable_tqdm=True,
    )


def peer_row(device: torch.device, size: str, steps: int, warmup: int, tokenizer) -> dict:
    """sentence-transformers' trainer, SimCSE-unsup setting (see the module docstring)."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers import losses as st_losses
    from sentence_transformers.models import Pooling, Transformer
    from transformers import TrainerCallback

    from benchmarks.gpu_check import backbone

    cuda = device.type == "cuda"
    batch, length = (64, 32) if size == "base" else (4, 16)
    with tempfile.TemporaryDirectory(prefix="gpu-speed-peer-") as folder:
        backbone(size).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        encoder = Transformer(folder, max_seq_length=length)
        model = SentenceTransformer(
            modules=[encoder, Pooling(encoder.get_word_embedding_dimension(), "cls")], device=str(device)
        )
        sentences = random_sentences(batch * (warmup + steps + 1), length)
        data = Dataset.from_dict({"anchor": sentences, "positive": sentences})
        marks: dict[str, float] = {}

        class Timer(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step in (warmup, warmup + steps):
                    sync(device)
                    marks[state.global_step] = time.perf_counter()

        trainer = SentenceTransformerTrainer(
            model=model,
            args=peer_arguments(folder, batch, warmup + steps, cuda),
            train_dataset=data,
            loss=st_losses.MultipleNegativesRankingLoss(model, scale=20.0),
            callbacks=[Timer()],
        )
        trainer.train()
    step_s = (marks[warmup + steps] - marks[warmup]) / steps
    import sentence_transformers

    return {
        "peer": f"sentence-transformers {sentence_transformers.__version__} SentenceTransformerTrainer + "
        "MultipleNegativesRankingLoss (scale 20 = 1/0.05), CLS pooling",
        "batch_size": batch,
        "max_length": length,
        "steps": steps,
        "ms_per_step": round(1e3 * step_s, 2),
    }


def markdown(result: dict) -> str:
    lines = [
        report_header("GPU speed", result),
        "",
        "| method | mode | batch × length | ms/step | tokens/s | MFU | kernels/step | launch calls/step | GPU busy | "
        "peak GiB | warm-up s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v, f="{}": "–" if v is None else f.format(v)
    for r in result["rows"]:
        if "error" in r or "skipped" in r:
            lines.append(
                f"| {r.get('method', '?')} | {r.get('mode', '?')} | {r.get('error') or r['skipped']} | | | | | | | | |"
            )
            continue
        mfu = fmt(None if r["mfu"] is None else 100 * r["mfu"], "{:.1f} %")
        busy = fmt(None if r.get("gpu_busy_share") is None else 100 * r["gpu_busy_share"], "{:.0f} %")
        lines.append(
            f"| {r['method']} | {r['mode']} | {r['batch_size']} × {r['max_length']} | {r['ms_per_step']:.2f} | "
            f"{r['tokens_per_s']:,.0f} | {mfu} | {fmt(r.get('kernels_per_step'))} | "
            f"{fmt(r.get('launch_calls_per_step'))} | {busy} | {fmt(r['peak_memory_gib'])} | {r['warmup_s']} |"
        )
    if result["runs"]:
        lines += [
            "",
            "| method (mode) | state MiB | snapshot s | write s (background) | dev eval s (device batches) | "
            "projected run: steps | states (every n steps) | train min | eval min | state min | total min | overhead |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m, x in result["runs"].items():
            if "error" in x:
                lines.append(f"| {m} | failed: {x['error']} | | | | | | | | | |")
                continue
            s, e, p = x["state"], x["evaluation"], x["projected"]
            lines.append(
                f"| {m} ({x['mode']}) | {s['state_mib']} | {s['snapshot_s']} | {s['write_s']} | {e['eval_s']} "
                f"({e['eval_s_device_batches']}) | {p['steps']:,} | {p['state_writes']} ({p['state_every_steps']}) | "
                f"{p['train_min']} | {p['eval_min']} | "
                f"{p['state_min']} | {p['total_min']} | {100 * p['overhead_share']:.1f} % |"
            )
    peer = result.get("peer") or {}
    if "ms_per_step" in peer:
        subject = subject_method("gpu_speed_peer").name
        ours = {
            r["mode"]: r["ms_per_step"] for r in result["rows"] if r.get("method") == subject and "ms_per_step" in r
        }
        lines += [
            "",
            f"Peer ({peer['peer']}, {peer['batch_size']} × {peer['max_length']}): {peer['ms_per_step']} ms/step",
        ]
        for mode, ms in ours.items():
            lines.append(f"- our {subject} ({mode}): {ms} ms/step, {peer['ms_per_step'] / ms:.2f}× the peer's speed")
    elif peer:
        lines += ["", f"Peer: {peer.get('error') or peer.get('skipped')}"]
    return "\n".join(lines) + "\n"


class SpeedRun:
    """One run of the benchmark: its settings, the result so far, and the file it is saved to after every row."""

    def __init__(self, args, argv: list[str] | None):
        from cse.models.loading import pick_device

        self.args, self.t_start = args, time.monotonic()
        self.device = pick_device(args.device)
        self.cuda = cuda = self.device.type == "cuda"
        self.steps = args.steps or (30 if cuda else 2)
        self.warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
        self.profile_steps = args.profile_steps if args.profile_steps is not None else (3 if cuda else 0)
        self.backend = args.compile_backend or ("inductor" if cuda else "aot_eager")
        self.size, self.precision = ("base", "bf16") if cuda else ("tiny", "fp32")
        name, self.peak = device_peak(self.device, args.peak_tflops)
        self.result: dict = {
            "benchmark": "gpu_speed",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": command_line("benchmarks.gpu_speed", argv),
            "environment": {
                "device_name": name,
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "python": platform.python_version(),
                "peak_bf16_tflops": self.peak,
                "compile_backend": self.backend,
            },
            "rows": [],
            "runs": {},
            "peer": {},
        }
        args.out.mkdir(parents=True, exist_ok=True)
        self.stem = args.out / f"gpu_speed-{device_slug(self.device)}"
        self.failed = False
        self.tokenizer = synthetic_tokenizer()

    def save(self) -> None:
        self.result["seconds"] = round(time.monotonic() - self.t_start, 1)
        self.stem.with_suffix(".json").write_text(json.dumps(self.result, indent=2) + "\n")
        self.stem.with_suffix(".md").write_text(markdown(self.result))

    def over_budget(self) -> bool:
        return self.args.budget_s is not None and time.monotonic() - self.t_start > self.args.budget_s

    def record(self, key: str, fn, **labels) -> None:
        """Run one measurement and save it; its failure is reported (with `labels`) and the others still run."""
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - one measurement's failure is reported; the others still run
            traceback.print_exc()
            value, self.failed = {**labels, "error": f"{type(e).__name__}: {e}"[:300]}, True
        if key == "rows":
            self.result["rows"].append(value)
        elif key == "peer":
            self.result["peer"] = value
        else:
            self.result["runs"][key] = value
        print(json.dumps({key: value}), flush=True)
        self.save()

    def measure(self, method: str, mode: str, flops: int | None):
        """One (method, mode) row and its trainer (for the per-method extras)."""
        device, cuda, steps, warmup, profile_steps = self.device, self.cuda, self.steps, self.warmup, self.profile_steps
        switches = dict(MODES[mode])
        if switches["compile"] and "compile_backend" not in switches:
            switches["compile_backend"] = self.backend
        n_steps = warmup + steps + profile_steps
        state = tempfile.TemporaryDirectory(prefix="gpu-speed-")
        cfg, trainer = benchmark_trainer(
            method, device, self.size, self.precision, n_steps, self.tokenizer, switches, state.name, []
        )
        trainer.cfg = dataclasses.replace(trainer.cfg, log_steps=cfg.log_steps)  # the preset's log cadence
        offset = trainer.offsets[-1]  # time the last phase (DiffAug: joint tuning)
        win = _Windows(device, offset + warmup, offset + warmup + steps, offset + n_steps, profile_steps > 0)
        trainer.hooks.append(win)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with state:
            trainer.run()
            step_s = (win.t1 - win.t0) / steps
            probe = last_phase_batch(trainer)
            if flops is None and not switches["compile"]:
                flops = count_step_flops(trainer, probe.to(device))
        tokens = probe.tokens
        tflops = None if flops is None else flops / step_s / 1e12
        row = {
            "method": method,
            "mode": mode,
            "switches": switches,
            "batch_size": cfg.batch_size,
            "max_length": cfg.max_length,
            "steps": steps,
            "ms_per_step": round(1e3 * step_s, 2),
            "tokens_per_s": round(tokens / step_s, 1),
            "flops_per_step": flops,
            "achieved_tflops": None if tflops is None else round(tflops, 2),
            "mfu": None if (tflops is None or not self.peak) else round(tflops / self.peak, 4),
            "peak_memory_gib": round(trainer.peak_memory_gb, 2) if cuda else None,
            "warmup_s": round(win.t0 - win.t_begin, 1),
            "host_wait_share": round((win.wait1 - win.wait0) / max(win.t1 - win.t0, 1e-9), 4),
            **_profile_summary(win, profile_steps, cuda),
        }
        return row, trainer

    def method(self, method: str, modes: list[str]) -> None:
        """The rows of `method` in `modes`, then its whole-run figures on the last mode's trainer."""
        measured: dict = {"flops": None, "trainer": None}

        def one(mode: str) -> dict:
            if self.over_budget():
                return {"method": method, "mode": mode, "skipped": "time budget spent"}
            if MODES[mode].get("compile_backend") == "cudagraphs" and not self.cuda:
                return {"method": method, "mode": mode, "skipped": "CUDA only"}
            row, measured["trainer"] = self.measure(method, mode, measured["flops"])
            measured["flops"] = row["flops_per_step"]
            return row

        for mode in modes:
            self.record("rows", lambda mode=mode: one(mode), method=method, mode=mode)
            if self.cuda:
                torch.cuda.empty_cache()
        trainer = measured.pop("trainer")
        if trainer is not None and not self.over_budget():
            self.record(method, lambda t=trainer: whole_run(method, t, self.result, self.tokenizer, self.device))
        del trainer
        torch.compiler.reset()  # (the compiled graphs and their CUDA-graph memory go with the method)
        if self.cuda:
            torch.cuda.empty_cache()

    def peer(self) -> None:
        def row() -> dict:
            if self.over_budget():
                return {"skipped": "time budget spent"}
            return peer_row(self.device, self.size, self.steps, self.warmup, self.tokenizer)

        self.record("peer", row)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--methods", default=",".join(METHODS), help="default: every registered method, in registry order")
    p.add_argument("--modes", default="reference,eager,compiled")
    p.add_argument("--extra-modes", default="", help="modes measured for the first method only (e.g. cudagraphs)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 30 CUDA, 2 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 5 CUDA, 1 CPU)")
    p.add_argument("--profile-steps", type=int, default=None, help="profiled steps (default: 3 CUDA, 0 CPU)")
    p.add_argument("--compile-backend", default=None, help="default: inductor on CUDA, aot_eager on CPU")
    p.add_argument("--budget-s", type=float, default=None, help="start nothing after this many seconds")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--render", type=Path, default=None, help="recompute a saved result's projections and .md only")
    args = p.parse_args(argv)
    if args.render is not None:
        render(args.render)
        print(f"rewrote {args.render} and its .md", flush=True)
        return 0
    methods = [m for m in args.methods.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    extra = [m for m in args.extra_modes.split(",") if m]
    if unknown := sorted(set(methods) - set(METHODS)) + sorted(set(modes + extra) - set(MODES)):
        p.error(f"unknown methods or modes {unknown}; methods {list(METHODS)}, modes {list(MODES)}")
    run = SpeedRun(args, argv)
    peer_subject = subject_method("gpu_speed_peer").name
    for i, method in enumerate(methods):
        # (the extra modes before the last mode: the whole-run figures use the last mode's trainer)
        run.method(method, modes[:-1] + (extra if i == 0 else []) + modes[-1:])
        if method == peer_subject and not args.skip_peer:  # the peer beside the rows of the method it computes
            run.peer()
    if peer_subject not in methods and not args.skip_peer:
        run.peer()
    run.save()
    print(f"wrote {run.stem}.json and {run.stem}.md ({run.result['seconds']} s)", flush=True)
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
