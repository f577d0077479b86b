"""Where a training step's time goes: the GPU's busy share, kernel launches per step and the top kernels.

    python -m benchmarks.step_profile [--method METHOD] [--device auto|cuda|cpu] [--size base|tiny]
        [--steps 5] [--warmup 3] [--fused-adamw] [--compile] [--top 15] [--out DIR]

The method's `default` preset at its real batch and length on a random-initialised BERT (the same model, rows and
loop as `benchmarks/gpu_check.py`'s throughput rows), `--warmup` steps, then `torch.profiler` over `--steps` steps:

- step wall time: the profiled steps' wall time ÷ steps (the profiler adds a little of its own);
- GPU busy share: the summed device time of the kernels (and memcpy/memset) ÷ the wall time. Well under 1 means
  the GPU waits for the host: launch overhead, Python, synchronisations, not arithmetic;
- kernels per step, and the top kernels and host operators by self time.

Prints the tables and writes `<out>/step_profile-<method>-<device>.json` when `--out` is given. On CPU (`--size tiny`)
it only rehearses the script (no device timeline).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from benchmarks.gpu_check import METHODS, benchmark_trainer, synthetic_tokenizer
from benchmarks.machine import sync
from cse.training.loop import TrainerHooks


def device_events(prof) -> list:
    """The profiler's device-side work (kernels, memcpy, memset): device events, less the step annotations that the
    profiler also draws on the device's timeline (`ProfilerStep#N`, spanning whole steps)."""
    return [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and not e.name.startswith("ProfilerStep")
    ]


def _top_kernels(kernels: list, steps: int, top: int) -> list[dict]:
    """The device's kernels grouped by name, by summed device time."""
    totals: dict[str, list] = {}
    for e in kernels:
        t = totals.setdefault(e.name, [0.0, 0])
        t[0] += e.device_time
        t[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return [{"name": n[:90], "ms_per_step": round(us / 1e3 / steps, 3), "calls": c} for n, (us, c) in ranked]


class _Step(TrainerHooks):
    """After each parameter update: synchronise, mark the profiled window's start and end, advance the profiler."""

    def __init__(self, device: torch.device, marks: dict[str, float]):
        self.device, self.marks, self.updates = device, marks, 0

    def arm(self, prof, skip: int, steps: int) -> None:
        self.prof, self.skip, self.steps = prof, skip, steps

    def on_update_end(self, trainer):
        sync(self.device)
        self.updates += 1
        if self.updates in (self.skip, self.skip + self.steps):
            self.marks["t0" if self.updates == self.skip else "t1"] = time.perf_counter()
        self.prof.step()


def profile_steps(method: str, device: torch.device, size: str, steps: int, warmup: int, switches: dict, top: int):
    """Profile `steps` training steps of `method`'s default preset after `warmup` steps; returns the summary."""
    cuda = device.type == "cuda"
    n_steps = warmup + steps
    marks: dict[str, float] = {}
    state = tempfile.TemporaryDirectory(prefix="step-profile-")
    hook = _Step(device, marks)
    precision, tokenizer = "bf16" if cuda else "fp32", synthetic_tokenizer()
    cfg, trainer = benchmark_trainer(method, device, size, precision, n_steps, tokenizer, switches, state.name, [hook])
    skip = sum(p.max_steps for p in trainer.phases[:-1]) + warmup  # profile the last phase's last `steps` steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # the profiler's own warm-up is the last unprofiled step
    prof = profile(activities=activities, schedule=schedule(wait=skip - 1, warmup=1, active=steps, repeat=1))
    hook.arm(prof, skip, steps)
    with state, prof:
        trainer.run()
    wall = (marks["t1"] - marks["t0"]) / steps
    averages = prof.key_averages()
    kernels = device_events(prof)
    busy = sum(e.device_time for e in kernels) / 1e6 / steps if cuda else None  # device_time: microseconds
    by_host = [e for e in averages if not e.key.startswith("ProfilerStep")]
    by_host = sorted(by_host, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "method": method,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "size": size,
        "batch_size": cfg.batch_size,
        "max_length": cfg.max_length,
        "steps": steps,
        "switches": switches,
        "step_wall_ms": round(1e3 * wall, 2),
        "gpu_busy_ms": None if busy is None else round(1e3 * busy, 2),
        "gpu_busy_share": None if busy is None else round(busy / wall, 3),
        "kernels_per_step": round(len(kernels) / steps, 1) if cuda else None,
        "top_device": _top_kernels(kernels, steps, top),
        "top_host": [
            {"name": e.key[:90], "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3), "calls": e.count}
            for e in by_host
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default=METHODS[0], choices=list(METHODS), help="default: the registry's first")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--size", default=None, choices=["base", "tiny"], help="default: base on CUDA, tiny on CPU")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="unprofiled steps first (at least 1)")
    p.add_argument("--fused-adamw", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1")
    from cse.models.loading import pick_device

    device = pick_device(args.device)
    size = args.size or ("base" if device.type == "cuda" else "tiny")
    switches = {"fused_adamw": args.fused_adamw, "compile": args.compile}
    rec = profile_steps(args.method, device, size, args.steps, args.warmup, switches, args.top)
    print(
        f"{rec['method']} on {rec['device']} ({size}, {rec['batch_size']} × {rec['max_length']}, {switches}): "
        f"step {rec['step_wall_ms']} ms, GPU busy {rec['gpu_busy_ms']} ms ({rec['gpu_busy_share']}), "
        f"{rec['kernels_per_step']} kernels/step"
    )
    for title, rows in (("device kernels", rec["top_device"]), ("host (self time)", rec["top_host"])):
        if rows:
            print(f"\n{title}: ms/step  calls  name")
            for r in rows:
                print(f"  {r['ms_per_step']:8.3f}  {r['calls']:6d}  {r['name']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"step_profile-{rec['method']}-{device.type}.json"
        path.write_text(json.dumps(rec, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
