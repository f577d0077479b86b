"""How fast a training step is on the GPU, switch by switch, and what a whole run costs: `make gpu-speed`.

    python benchmarks/gpu_speed.py [--device auto|cuda|cpu] [--out DIR] [--methods d2cse,simcse,...]
        [--modes reference,eager,compiled] [--steps 30] [--warmup 5] [--profile-steps 3] [--compile-backend B]
        [--budget-s 420] [--skip-peer]

Every method's `default` preset at its real batch and length on a random-initialised BERT-base, bf16, through the real
`cse.training.loop.Trainer.run` (its log cadence, `log_steps` of the preset, included), on real rows: the Wiki1M
sample (`../shared/data/wiki1m_head.txt`; DiffAug's NLI rows: `snli_triplets.csv`) tokenised with bert-base-uncased's
vocabulary (the packaged MiniLM's tokenizer) as the tokenize stage does, cut at `max_length` and batched as a job
batches them (`speed.pad_to_max_length`); corrupted ids are random replacements (the corruption stage is measured
apart). Three modes:

- `reference`: the step as it was first measured (2026-11-24): AdamW without fused kernels, the frozen weights cast
  at every use, the loss read on the host at every step, eager;
- `eager`: today's defaults without compilation: fused AdamW, the frozen weights cast once (training/precision.py),
  nothing read on the host between log steps (the non-finite guard on the device);
- `compiled`: the same plus `torch.compile` of the whole step as one graph and of the update (clipping, guard, AdamW:
  training/update.py) as a second, replayed as CUDA graphs (`mode="reduce-overhead"`; on CPU the rehearsal traces
  them with the `aot_eager` backend). `--extra-modes`: `cudagraphs`, `autotune` (inductor's `max-autotune`),
  `compiled-eager-update` (the update outside the graph, as before 2026-11-29).

Per row: ms/step (wall time of `--steps` steps after `--warmup`, synchronised only at the window's ends); tokens/s
counted two ways: real tokens (the attention masks' ones of the timed steps' batches) and computed tokens (every
position of the batches' tensors, padding included), with the real share; MFU on computed tokens (FLOPs of one step
counted by `torch.utils.flop_counter.FlopCounterMode` on the eager step ÷ step time ÷ the GPU's dense bf16 peak) and
MFU on real tokens (those FLOPs × the real share: what an unpadded pass would need, exact for the linear layers,
attention's quadratic part a little overcounted); peak memory; the warm-up's wall time, first (a fresh compile cache:
`TORCHINDUCTOR_CACHE_DIR` is a new folder for every run of this script) and cached (after `torch.compiler.reset()`,
the same mode again in this process: dynamo traces anew, inductor's and AOTAutograd's graphs come from the cache; a
new process adds its imports and CUDA start); and from `torch.profiler` over `--profile-steps` more steps: on CUDA
device kernels per step, host launch calls per step (kernel and graph launches, copies) and the GPU-busy share
(summed device time ÷ wall time); on CPU, which has no device timeline, the top-level host operator calls per step
(a count of what the host dispatches, labelled as such) and compiled-graph calls per step.

Per method, on the compiled model: one resume-state write (the training thread's share: the snapshot copied to host
memory; the background thread's: serialising, hashing, writing) and one dev evaluation on the real STS-B dev
sentences (3,000, batch 128) in fp32 (the selection's), tf32 and bf16, with the batches kept on the device after the
first evaluation; and the projected whole run: the preset's steps on the real data × ms/step + its evaluations (every
`eval_steps`, fp32) + its state writes (every `checkpoint_steps`), with their share of it, and the total with the
warm-up (first and cached).

Evaluation precision (`--skip-eval-precision` to leave out): the packaged MiniLM (a trained encoder) scored on the
seven STS test tasks in fp32, tf32 and bf16; a precision is acceptable when every task's Spearman ×100 stays within
±0.01 of fp32's (CPU rehearsal: the first 8 pairs of each task, TF32 being a no-op there).

Peer: sentence-transformers' own `SentenceTransformerTrainer` with `MultipleNegativesRankingLoss` in the SimCSE-unsup
setting (the same Wiki1M sentence twice, batch 64, 32 tokens, random BERT-base with CLS pooling, bf16) beside our
SimCSE step in the same process, eager and compiled (`torch_compile=True`; CPU: `aot_eager`); the ratios compare like
with like (eager with eager, compiled with compiled), and our compiled step against the peer's eager one, labelled.

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
)
from benchmarks.machine import command_line, subject_method, sync, timed
from benchmarks.step_profile import device_events
from cse.config.training import resolve_train_config
from cse.storage.settings import get_settings
from cse.training.loop import TrainerHooks

MODES = {
    "reference": {"fused_adamw": False, "cast_frozen_weights": False, "compile": False},
    "eager": {"fused_adamw": True, "cast_frozen_weights": True, "compile": False},
    "compiled": {"fused_adamw": True, "cast_frozen_weights": True, "compile": True},
    # (CUDA only, `--extra-modes`: the whole step as CUDA graphs without inductor's code generation: dynamo's
    # "cudagraphs" backend, AOTAutograd's graphs run by aten ops; compiles in seconds)
    "cudagraphs": {"fused_adamw": True, "cast_frozen_weights": True, "compile": True, "compile_backend": "cudagraphs"},
    # (`--extra-modes`: inductor's autotuned kernels, paid once per node through the compile cache; the update eager)
    "autotune": {"fused_adamw": True, "cast_frozen_weights": True, "compile": True, "compile_mode": "max-autotune"},
    "compiled-eager-update": {
        "fused_adamw": True,
        "cast_frozen_weights": True,
        "compile": True,
        "compile_update": False,
    },
}
EVAL_PRECISIONS = ("fp32", "tf32", "bf16")
SCORE_TOLERANCE = 0.01  # Spearman ×100: how far a faster evaluation precision may move a reported STS score
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
    if not cuda:  # no device timeline: what the host dispatches
        events = win.prof.events()
        return {
            "profiled_steps": steps,
            "host_ops_per_step_cpu": round(
                sum(e.cpu_parent is None and e.name.startswith("aten::") for e in events) / steps, 1
            ),
            "graph_calls_per_step_cpu": round(
                sum(e.name.startswith("Torch-Compiled Region") for e in events) / steps, 1
            ),
        }
    device = device_events(win.prof)
    launches = [e for e in win.prof.events() if e.name in LAUNCH_CALLS or e.name.startswith("cudaMemcpy")]
    busy = sum(e.device_time for e in device) / 1e6  # microseconds → s
    return {
        "profiled_steps": steps,
        "kernels_per_step": round(len(device) / steps, 1),
        "launch_calls_per_step": round(len(launches) / steps, 1),
        "graph_launches_per_step": round(sum(e.name == "cudaGraphLaunch" for e in launches) / steps, 1),
        "gpu_busy_share": round(busy / win.prof_wall, 3),
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


def real_texts(n: int) -> dict[str, list[str]]:
    """The first `n` sentences of the Wiki1M sample (`text`) and of the SNLI triplets (`sent0`, `sent1`,
    `hard_neg`) in `../shared/data` (`CSE_SHARED_DATA`); FileNotFoundError when they are missing."""
    import csv

    shared = get_settings().shared_data
    with open(shared / "wiki1m_head.txt", encoding="utf-8") as f:
        texts: dict[str, list[str]] = {"text": [line.strip() for _, line in zip(range(n), f)]}
    with open(shared / "snli_triplets.csv", encoding="utf-8", newline="") as f:
        triplets = [r for _, r in zip(range(n), csv.DictReader(f))]
    texts.update({c: [r[c] for r in triplets] for c in ("sent0", "sent1", "hard_neg")})
    return texts


def sts_table(pairs: int | None = None):
    """The STS pairs of `../shared/data/senteval` (every pair, or the first `pairs` of each task and split)."""
    import pyarrow.compute as pc

    from cse.storage.readers import read_senteval

    table = read_senteval(get_settings().shared_data / "senteval")[0]
    if pairs is None:
        return table
    return table.filter(pc.less(table.column("pair_index"), pairs))


def eval_overhead(model, device) -> dict:
    """One dev evaluation's embedding pass over the real STS-B dev sentences (batch 128) in each of
    `EVAL_PRECISIONS` (fp32: the selection's default), with and without the batches kept on the device."""
    from cse.evaluation.encode import DeviceBatches, embed_token_ids
    from cse.evaluation.evaluator import Evaluator

    sentences = Evaluator(sts_table()).sentences("dev", tasks=["stsb"])
    sentences = sentences if device.type == "cuda" else sentences[:64]
    ids = model.token_ids(sentences)  # the method's own input (DiffAug: its prompt template)
    out: dict = {"dev_sentences": len(ids), "mean_tokens": round(sum(map(len, ids)) / len(ids), 1)}
    for precision in EVAL_PRECISIONS:
        cache = DeviceBatches()  # (the first run of each: warm-up / filling the cache)
        times = [
            timed(
                lambda c=c, p=precision: embed_token_ids(model, ids, batch_size=128, precision=p, device_cache=c),
                device,
            )
            for c in (None, None, cache, cache)
        ]
        out[precision] = {"eval_s": round(times[1], 3), "eval_s_device_batches": round(times[3], 3)}
    return out


def eval_precision_check(device: torch.device) -> dict:
    """The packaged MiniLM's seven STS test scores (Spearman ×100) in each of `EVAL_PRECISIONS`; a precision passes
    when no task moves more than `SCORE_TOLERANCE` from fp32's (CPU: the first 8 pairs of every task). The first fp32
    pass (tokenising, warming the device up) is run once more and its time not counted."""
    from cse.evaluation.evaluator import Evaluator
    from cse.models.embedder import PooledEncoder

    evaluator = Evaluator(sts_table(None if device.type == "cuda" else 8))
    encoder = PooledEncoder.from_pretrained("packaged:minilm", "avg").to(device)
    scores, seconds = {}, {}
    for precision in ("fp32", *EVAL_PRECISIONS):
        result = evaluator.run(encoder, mode="test", extras=False, precision=precision)
        scores[precision] = {task: round(t.spearman, 4) for task, t in result.tasks.items()}
        seconds[precision] = round(result.timing.seconds, 2)
    moved = {
        p: round(max(abs(scores[p][t] - scores["fp32"][t]) for t in scores["fp32"]), 4) for p in EVAL_PRECISIONS[1:]
    }
    return {
        "encoder": "packaged:minilm (avg pooling)",
        "pairs": "all" if device.type == "cuda" else "first 8 of each task",
        "scores": scores,
        "seconds": seconds,
        "max_move": moved,
        "acceptable": [p for p, m in moved.items() if m <= SCORE_TOLERANCE],
    }


def whole_run(method: str, trainer, result: dict, device: torch.device) -> dict:
    """State and evaluation overhead on `trainer`'s model, and the projected run at its mode's step time."""
    state, ev = state_overhead(trainer), eval_overhead(trainer.model, device)
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
    eval_s = evals * ev["fp32"]["eval_s_device_batches"]
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
        # the run's wall time with its warm-up (compilation): a fresh compile cache, and a node that has one
        "total_min_with_warmup_first": round((total + row["warmup_s"]) / 60, 2),
        "total_min_with_warmup_cached": None
        if row.get("warmup_cached_s") is None
        else round((total + row["warmup_cached_s"]) / 60, 2),
    }


def peer_arguments(folder: str, batch: int, max_steps: int, cuda: bool, compiled: bool = False):
    """The peer trainer's arguments: `max_steps` at `batch`, lr 3e-5, bf16 on CUDA, nothing saved or reported;
    `compiled`: `torch_compile=True` (its default backend, inductor, on CUDA; `aot_eager` on CPU)."""
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
        torch_compile=compiled,
        **({"torch_compile_backend": "inductor" if cuda else "aot_eager"} if compiled else {}),
    )


def peer_row(
    device: torch.device, size: str, steps: int, warmup: int, tokenizer, texts: list[str], compiled: bool
) -> dict:
    """sentence-transformers' trainer, SimCSE-unsup setting, on the Wiki1M sentences `texts` (module docstring)."""
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
        sentences = texts[: batch * (warmup + steps + 1)]
        data = Dataset.from_dict({"anchor": sentences, "positive": sentences})
        marks: dict[str, float] = {}

        class Timer(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step in (warmup, warmup + steps):
                    sync(device)
                    marks[state.global_step] = time.perf_counter()

        trainer = SentenceTransformerTrainer(
            model=model,
            args=peer_arguments(folder, batch, warmup + steps, cuda, compiled),
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
        "compiled": compiled,
        "batch_size": batch,
        "max_length": length,
        "steps": steps,
        "ms_per_step": round(1e3 * step_s, 2),
    }


def markdown(result: dict) -> str:
    cuda = result["environment"].get("cuda_device", True)
    launches = "launch calls/step | GPU busy" if cuda else "host ops/step (CPU) | graph calls/step (CPU)"
    lines = [
        report_header("GPU speed", result),
        "",
        "Rows: the Wiki1M sample as a job batches it. Real tokens: the attention masks' ones; computed: every position "
        "of the batch, padding included. MFU on computed tokens, and on real tokens (× the real share).",
        "",
        f"| method | mode | batch × length | ms/step | real tokens/s (real share) | MFU real (computed) | kernels/step | "
        f"{launches} | peak GiB | warm-up s first / cached |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v, f="{}": "–" if v is None else f.format(v)
    pct = lambda v, f="{:.1f} %": fmt(None if v is None else 100 * v, f)
    for r in result["rows"]:
        if "error" in r or "skipped" in r:
            lines.append(
                f"| {r.get('method', '?')} | {r.get('mode', '?')} | {r.get('error') or r['skipped']} | | | | | | | | |"
            )
            continue
        tail = (
            f"{fmt(r.get('launch_calls_per_step'))} | {pct(r.get('gpu_busy_share'), '{:.0f} %')}"
            if cuda
            else f"{fmt(r.get('host_ops_per_step_cpu'))} | {fmt(r.get('graph_calls_per_step_cpu'))}"
        )
        lines.append(
            f"| {r['method']} | {r['mode']} | {r['batch_size']} × {r['max_length']} | {r['ms_per_step']:.2f} | "
            f"{r['real_tokens_per_s']:,.0f} ({pct(r['real_token_share'], '{:.1f} %')}) | {pct(r['mfu_real'])} "
            f"({pct(r['mfu'])}) | {fmt(r.get('kernels_per_step'))} | {tail} | {fmt(r['peak_memory_gib'])} | "
            f"{r['warmup_s']} / {fmt(r.get('warmup_cached_s'))} |"
        )
    if result["runs"]:
        lines += [
            "",
            "| method (mode) | state MiB | snapshot s | write s (background) | STS-B dev eval s fp32 / tf32 / bf16 "
            "(device batches) | projected run: steps | states (every n steps) | train min | eval min | state min | "
            "total min | overhead | total with warm-up: first / cached |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m, x in result["runs"].items():
            if "error" in x:
                lines.append(f"| {m} | failed: {x['error']} | | | | | | | | | | | |")
                continue
            s, e, p = x["state"], x["evaluation"], x["projected"]
            ev = " / ".join(f"{e[q]['eval_s']} ({e[q]['eval_s_device_batches']})" for q in EVAL_PRECISIONS)
            lines.append(
                f"| {m} ({x['mode']}) | {s['state_mib']} | {s['snapshot_s']} | {s['write_s']} | {ev} | "
                f"{p['steps']:,} | {p['state_writes']} ({p['state_every_steps']}) | {p['train_min']} | {p['eval_min']} | "
                f"{p['state_min']} | {p['total_min']} | {100 * p['overhead_share']:.1f} % | "
                f"{p['total_min_with_warmup_first']} / {fmt(p['total_min_with_warmup_cached'])} |"
            )
    check = result.get("eval_precision") or {}
    if "scores" in check:
        tasks = list(check["scores"]["fp32"])
        lines += ["", f"Evaluation precision ({check['encoder']}, {check['pairs']}; Spearman ×100):", ""]
        lines += ["| precision | " + " | ".join(tasks) + " | max move | s |", "|---" * (len(tasks) + 3) + "|"]
        for q, sc in check["scores"].items():
            move = "–" if q == "fp32" else check["max_move"][q]
            lines.append(
                f"| {q} | " + " | ".join(f"{sc[t]:.2f}" for t in tasks) + f" | {move} | {check['seconds'][q]} |"
            )
        lines.append(f"\nWithin ±{SCORE_TOLERANCE} of fp32 on every task: {', '.join(check['acceptable']) or 'none'}")
    elif check:
        lines += ["", f"Evaluation precision: {check.get('error') or check.get('skipped')}"]
    lines += peer_lines(result)
    return "\n".join(lines) + "\n"


def peer_lines(result: dict) -> list[str]:
    """The peer's rows and the ratios: eager with eager, compiled with compiled, and our compiled step against the
    peer's eager trainer (labelled: it compares compilation, not the implementations)."""
    subject = subject_method("gpu_speed_peer").name
    ours = {r["mode"]: r["ms_per_step"] for r in result["rows"] if r.get("method") == subject and "ms_per_step" in r}
    peers = {("compiled" if p.get("compiled") else "eager"): p for p in result.get("peers", [])}
    lines = []
    for kind, peer in peers.items():
        if "ms_per_step" not in peer:
            lines += ["", f"Peer ({kind}): {peer.get('error') or peer.get('skipped')}"]
            continue
        lines += [
            "",
            f"Peer {kind} ({peer['peer']}, {peer['batch_size']} × {peer['max_length']}, each batch padded to its "
            f"longest row): {peer['ms_per_step']} ms/step",
        ]
        pairs = [(kind, f"like with like: our {subject} {kind}")]
        if kind == "eager":
            pairs.append(
                ("compiled", f"our compiled {subject} against the peer's eager trainer (compilation, not code)")
            )
        for mode, label in pairs:
            if mode in ours:
                lines.append(
                    f"- {label}: {ours[mode]} ms/step, {peer['ms_per_step'] / ours[mode]:.2f}× the peer's speed"
                )
    return lines


class SpeedRun:
    """One run of the benchmark: its settings, the result so far, and the file it is saved to after every row."""

    def __init__(self, args, argv: list[str] | None):
        from cse.models.loading import pick_device

        self.args, self.t_start = args, time.monotonic()
        self.device = pick_device(args.device)
        self.cuda = cuda = self.device.type == "cuda"
        self.steps = args.steps or (30 if cuda else 2)
        self.warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
        self.profile_steps = args.profile_steps if args.profile_steps is not None else (3 if cuda else 1)
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
                "cuda_device": cuda,
            },
            "rows": [],
            "runs": {},
            "peers": [],
        }
        args.out.mkdir(parents=True, exist_ok=True)
        self.stem = args.out / f"gpu_speed-{device_slug(self.device)}"
        self.failed = False
        from cse.models.loading import PACKAGED_MINILM, load_tokenizer

        self.tokenizer = load_tokenizer(PACKAGED_MINILM)  # (bert-base-uncased's vocabulary)
        self.texts = real_texts(4096)
        # a fresh compile cache: the first warm-up of a mode compiles, the second ("cached") finds its graphs
        self.cache = tempfile.TemporaryDirectory(prefix="gpu-speed-compile-cache-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.cache.name

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
        if key in ("rows", "peers"):
            self.result[key].append(value)
        elif key == "eval_precision":
            self.result[key] = value
        else:
            self.result["runs"][key] = value
        print(json.dumps({key: value}), flush=True)
        self.save()

    def measure(self, method: str, mode: str, flops: int | None, steps: int | None = None, profile: bool = True):
        """One (method, mode) row and its trainer (for the per-method extras); `steps`: fewer timed steps."""
        device, cuda, warmup = self.device, self.cuda, self.warmup
        steps, profile_steps = steps or self.steps, self.profile_steps if profile else 0
        switches = dict(MODES[mode])
        if switches["compile"] and "compile_backend" not in switches:
            switches["compile_backend"] = self.backend
        n_steps = warmup + steps + profile_steps
        state = tempfile.TemporaryDirectory(prefix="gpu-speed-")
        cfg, trainer = benchmark_trainer(
            method, device, self.size, self.precision, n_steps, self.tokenizer, switches, state.name, [], self.texts
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
        # the timed steps' batches, built again on the host (pure): their real and computed tokens
        timed_batches = [trainer.batch_at(s) for s in range(win.start, win.stop)]
        real = sum(b[4] for b in timed_batches) / steps
        computed = sum(b[0].input_ids.numel() + (b[0].aux.input_ids.numel() if b[0].aux else 0) for b in timed_batches)
        share = real / (computed / steps)
        tflops = None if flops is None else flops / step_s / 1e12
        mfu = None if (tflops is None or not self.peak) else tflops / self.peak
        row = {
            "method": method,
            "mode": mode,
            "switches": switches,
            "batch_size": cfg.batch_size,
            "max_length": cfg.max_length,
            "steps": steps,
            "ms_per_step": round(1e3 * step_s, 2),
            "real_tokens_per_s": round(real / step_s, 1),
            "computed_tokens_per_s": round(computed / steps / step_s, 1),
            "real_token_share": round(share, 4),
            "flops_per_step": flops,
            "achieved_tflops": None if tflops is None else round(tflops, 2),
            "mfu": None if mfu is None else round(mfu, 4),  # (on computed tokens)
            "mfu_real": None if mfu is None else round(mfu * share, 4),
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
            if MODES[mode]["compile"]:  # the same compilation again, its graphs in the compile cache now
                torch.compiler.reset()
                row["warmup_cached_s"] = self.measure(method, mode, row["flops_per_step"], 1, False)[0]["warmup_s"]
            return row

        for mode in modes:
            self.record("rows", lambda mode=mode: one(mode), method=method, mode=mode)
            if self.cuda:
                torch.cuda.empty_cache()
        trainer = measured.pop("trainer")
        if trainer is not None and not self.over_budget():
            self.record(method, lambda t=trainer: whole_run(method, t, self.result, self.device))
        del trainer
        torch.compiler.reset()  # (the compiled graphs and their CUDA-graph memory go with the method)
        if self.cuda:
            torch.cuda.empty_cache()

    def peer(self) -> None:
        for compiled in (False, True):

            def row(compiled: bool = compiled) -> dict:
                if self.over_budget():
                    return {"compiled": compiled, "skipped": "time budget spent"}
                args = (self.device, self.size, self.steps, self.warmup, self.tokenizer, self.texts["text"], compiled)
                return peer_row(*args)

            self.record("peers", row, compiled=compiled)
            torch.compiler.reset()

    def eval_precision(self) -> None:
        self.record(
            "eval_precision",
            lambda: {"skipped": "time budget spent"} if self.over_budget() else eval_precision_check(self.device),
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--methods", default=",".join(METHODS), help="default: every registered method, in registry order")
    p.add_argument("--modes", default="reference,eager,compiled")
    p.add_argument("--extra-modes", default="", help="modes measured for the first method only (e.g. cudagraphs)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 30 CUDA, 2 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 5 CUDA, 1 CPU)")
    p.add_argument("--profile-steps", type=int, default=None, help="profiled steps (default: 3 CUDA, 1 CPU)")
    p.add_argument("--compile-backend", default=None, help="default: inductor on CUDA, aot_eager on CPU")
    p.add_argument("--budget-s", type=float, default=None, help="start nothing after this many seconds")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--skip-eval-precision", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=None)
    args = p.parse_args(argv)
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
    if not args.skip_eval_precision:
        run.eval_precision()
    run.save()
    print(f"wrote {run.stem}.json and {run.stem}.md ({run.result['seconds']} s)", flush=True)
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
