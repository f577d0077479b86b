"""Gradient caching at a paper preset's real batch: peak memory and step time per chunk size, on the same batches.

    python -m benchmarks.grad_cache [--method METHOD (default: the registry default, D2CSE)] [--preset default] [--chunks full,128,64,32,16] [--steps 2]
        [--threads 2] [--device cpu|cuda] [--out benchmarks/results]

The preset (`cse.config.presets`) is resolved as a job would resolve it; its backbone is a RANDOM-INITIALISED
BERT-base (`BertConfig()`, no pretrained weights are reachable here: the memory and time of a step do not depend on
the weights), its batch is the real one, every row exactly the preset's maximum length (no padding saved), corrupted
ids (DiffCSE, D2CSE) are 30 % random replacements (the helpers of benchmarks/gpu_check.py). Each chunk size runs in a
fresh process (so memory freed by an earlier configuration is not counted as resident), builds the model from the
same seed and trains `--steps` optimiser steps through the real `cse.training.loop.Trainer` with
`LoopConfig.grad_cache_chunk_size` (`full` = off); every configuration sees the same batches in the same order.

Figures (the first steps warm the allocator up):

- `s/step`: the second-last step's wall time from the trainer's `on_forward_start` to `on_update_end` (forward,
  backward, clipping, AdamW), with the heap as a training loop keeps it;
- `peak GB`: that step's peak as the trainer logs it (`training/memory.py`: CUDA allocated tensors; CPU the
  process's resident set, which includes the weights, gradients, AdamW states and the heap glibc keeps);
- `step Δ GB`: the last step's peak minus the memory in use when it began (CUDA allocated; CPU the resident set
  after `malloc_trim` has returned the heap the earlier steps freed): what the step itself adds, which is where the
  chunk size acts. (The last step is not timed: re-faulting the returned pages would slow it.)
- ratios against the full batch: time (the extra encode without a graph is the cost of the cache) and step Δ.

Output: `<out>/grad_cache.json` and `<out>/grad_cache.md` (with `--device cuda`: `grad_cache_cuda.{json,md}`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from benchmarks.gpu_check import build_model, job_phases, loop_config, synthetic_rows, synthetic_tokenizer
from benchmarks.machine import quiet_trainer, release_freed_heap, sync
from cse.config.methods import DEFAULT_METHOD
from cse.config.training import resolve_train_config
from cse.training.loop import TrainerHooks
from cse.training.memory import PeakMemory

HERE = Path(__file__).resolve().parent


def _in_use_gb(device: torch.device) -> float:
    """Memory in use now: CUDA allocated tensors; CPU the resident set (VmRSS)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    return psutil.Process().memory_info().rss / 2**30


class StepTimes(TrainerHooks):
    """Wall time, peak memory and the memory in use at the start of each step. Before the step `trim_step` (0-based)
    the heap freed by the steps before is returned to the system, so that step's start is what is live."""

    def __init__(self, device: torch.device, trim_step: int):
        self.device, self.trim_step, self.records = device, trim_step, []

    def on_forward_start(self, trainer, batch) -> None:
        sync(self.device)
        if self.device.type != "cuda" and len(self.records) == self.trim_step:
            release_freed_heap()
            trainer.memory.reset()
        self.before = _in_use_gb(self.device)
        self.t0 = time.perf_counter()

    def on_update_end(self, trainer) -> None:
        sync(self.device)
        self.records.append({"seconds": time.perf_counter() - self.t0, "in_use_before_gb": self.before})

    def on_step_end(self, trainer, batch, metrics) -> None:
        self.records[-1]["peak_gb"] = trainer.step_peak_memory_gb
        self.records[-1]["loss"] = metrics["loss"]


def one_configuration(args: argparse.Namespace, chunk: int | None) -> dict:
    """Build the preset's model and train `args.steps` steps with `chunk` (None: no cache); the last step's figures."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tokenizer = synthetic_tokenizer()
    cfg = resolve_train_config(args.preset, method=args.method).model_copy(update={"eval_steps": 10**9})
    model = build_model(args.method, cfg, "base", tokenizer, cfg.seed).to(device)
    rows, nli = synthetic_rows(cfg, args.method, cfg.batch_size * args.steps, tokenizer, cfg.seed)
    precision = "bf16" if device.type == "cuda" else "fp32"
    loop = loop_config(cfg, precision, args.steps, save_state=False, grad_cache_chunk_size=chunk)
    times = StepTimes(device, trim_step=args.steps - 1)
    with tempfile.TemporaryDirectory(prefix="grad-cache-bench-") as state:
        quiet_trainer(model, job_phases(cfg, rows, nli, args.steps), loop, device, Path(state) / "state", [times]).run()
    timed, trimmed = times.records[-2], times.records[-1]
    views = 3 if cfg.supervised else 2
    return {
        "chunk_size": chunk,
        "rows": cfg.batch_size * views,
        "seconds_per_step": round(timed["seconds"], 2),
        "seconds_all_steps": [round(r["seconds"], 2) for r in times.records],
        "peak_gb": round(timed["peak_gb"], 3),
        "step_delta_gb": round(trimmed["peak_gb"] - trimmed["in_use_before_gb"], 3),
        "losses": [r["loss"] for r in times.records],
        "peak_memory_kind": "cuda allocated" if device.type == "cuda" else "resident set (VmHWM)",
        "resettable_peak": PeakMemory(device).resettable,
    }


def markdown(report: dict) -> str:
    rows = report["configurations"]
    full = next((r for r in rows if r["chunk_size"] is None), None)
    head = report["preset"]
    lines = [
        f"# Gradient caching at the real batch (`benchmarks/grad_cache.py`, {report['device']})",
        "",
        f"Preset `{head['method']}/{head['preset']}`: batch {head['batch_size']} ({head['rows']} rows of "
        f"{head['max_length']} tokens), random-initialised BERT-base, {report['precision']}, "
        f"{report['threads']} torch threads; {report['steps']} steps per configuration (time and peak of the "
        "second-last, step Δ of the last). "
        f"Host: {report['host']}; torch {report['torch']}. Command: `{report['command']}`.",
        "",
        "| chunk size | s/step | time vs full | peak GB | step Δ GB | step Δ vs full | loss (timed step) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t_ratio = f"{r['seconds_per_step'] / full['seconds_per_step']:.2f}×" if full else "–"
        m_ratio = f"{r['step_delta_gb'] / full['step_delta_gb']:.2f}×" if full and full["step_delta_gb"] > 0 else "–"
        lines.append(
            f"| {r['chunk_size'] or 'full (off)'} | {r['seconds_per_step']} | {t_ratio} | {r['peak_gb']:.2f} | "
            f"{r['step_delta_gb']:.2f} | {m_ratio} | {r['losses'][-2]:.4f} |"
        )
    lines += [
        "",
        "`peak GB`: the timed step's peak "
        + (
            "CUDA allocation"
            if report["device"] == "cuda"
            else "resident set of the process (weights, gradients, AdamW states and the heap glibc keeps between steps)"
        )
        + "; `step Δ`: the last step's peak minus what was in use when it began (CPU: after `malloc_trim` returned "
        "the heap the earlier steps freed), the part the chunk size acts on. "
        "Same batches, same seed in every configuration: the losses differ only by the dropout draws of chunked "
        "encoding (a cached chunk draws its own masks).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default=DEFAULT_METHOD, help=f"a method of the registry (default {DEFAULT_METHOD})")
    p.add_argument("--preset", default="default")
    p.add_argument("--chunks", default="full,128,64,32,16", help="comma-separated chunk sizes; full = no cache")
    p.add_argument("--steps", type=int, default=3, help="optimiser steps per configuration (>= 3)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one chunk size, print its JSON
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps must be >= 3: a warm-up step, a timed step, a memory step")
    if args.one is not None:
        print("RESULT " + json.dumps(one_configuration(args, None if args.one == "full" else int(args.one))))
        return 0
    configurations = []
    passed_on = [a for a in argv if not a.startswith("--one")]
    for chunk in args.chunks.split(","):
        cmd = [sys.executable, "-m", "benchmarks.grad_cache", "--one", chunk, *passed_on]
        proc = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"chunk size {chunk}: the run failed (exit {proc.returncode})")
        rec = json.loads(line[len("RESULT ") :])
        print(f"chunk {chunk}: {rec['seconds_per_step']} s/step, peak {rec['peak_gb']} GB, Δ {rec['step_delta_gb']} GB")
        configurations.append(rec)
    cfg = resolve_train_config(args.preset, method=args.method)
    report = {
        "preset": {
            "method": args.method,
            "preset": args.preset,
            "batch_size": cfg.batch_size,
            "rows": cfg.batch_size * (3 if cfg.supervised else 2),
            "max_length": cfg.max_length,
        },
        "device": args.device,
        "precision": "bf16" if args.device == "cuda" else "fp32",
        "threads": args.threads,
        "steps": args.steps,
        "host": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "torch": torch.__version__,
        "command": "python -m benchmarks.grad_cache " + " ".join(argv),
        "configurations": configurations,
    }
    suffix = "" if args.device == "cpu" else "_cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"grad_cache{suffix}.json").write_text(json.dumps(report, indent=2))
    (args.out / f"grad_cache{suffix}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
