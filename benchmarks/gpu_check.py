"""One command that proves and measures the CUDA path: the `gpu` test tier, then throughput at paper size.

    python -m benchmarks.gpu_check [--device auto|cuda|cpu] [--out benchmarks/results] [--methods d2cse,simcse]
        [--steps 10] [--warmup 3] [--skip-tests] [--skip-throughput] [--fused-adamw] [--compile]
        [--sdpa-backend flash|efficient|cudnn|math] [--peak-tflops F]

(`make gpu-check`; `make gpu-check DEVICE=cpu` is the rehearsal that `make test` runs.) Needs only the project, its
training subset of wheels (README "Air-gapped GPU nodes") and a torch: no network, no pretrained weights, no data.

1. Tests: `pytest -m gpu tests/gpu` with CSE_GPU_CHECK_DEVICE set (CUDA: tiny and BERT-base sizes, bf16 and fp16;
   `--device cpu`: tiny size, bf16, gloo instead of NCCL, so the same code runs on every `make test`).
2. Throughput (size "base" on CUDA, "tiny" on CPU): every method's `default` preset at its real batch and maximum
   length (`--device cpu`: batch 4, length 16) on a random-initialised BERT-base (`BertConfig()`), through the real
   `cse.training.loop.Trainer.run` with its precision (bf16 on CUDA, fp32 on CPU). Rows are synthetic ids of exactly
   the preset's maximum length; corrupted ids are random replacements (the corruption stage is measured apart).
   - steps/s and tokens/s: median step wall time of the last `--steps` steps, after `--warmup` steps;
   - peak memory: the highest per-step `torch.cuda.max_memory_allocated` of the run (`Trainer.peak_memory_gb`;
     CPU: null);
   - FLOPs: counted by `torch.utils.flop_counter.FlopCounterMode` over one whole training step (forward and
     backward as they run: matmuls, attention, convolutions; elementwise ops are not counted), MFU = FLOPs/step ÷
     step time ÷ the GPU's dense bf16 peak (`PEAK_TFLOPS` by device name, or `--peak-tflops`; CPU: null);
   - host wait share: `Trainer.host_wait_s / Trainer.loop_s`: the part of the loop spent getting each batch onto
     the device (waiting for the prefetch thread, building the batch, issuing the copy); the timing hook ends each
     step in a sync, so this is time the GPU waits for the host (benchmarks/gpu_speed.py times steps unsynchronised);
   - projected schedule: the preset's optimiser steps on the real data sizes (Wiki1M 1,000,000 sentences; NLI
     275,601 triplets for supervised presets and DiffAug's NLI phase) × the median step time (DiffAug's NLI
     phase at the joint step's time).
   Corruption: sentences/s of `cse.models.corruption.Corruptor` with a random DistilBERT-size generator (768/6/12) on
   32-token rows, and the projected minutes of the faithful Wiki1M corruption (1,000,000 sentences × 2 epochs × 2
   views, d2cse/default's variants). Evaluation: sentences/s of `cse.evaluation.encode.embed_token_ids` on BERT-base
   (batch 128, CUDA: bf16-free fp32 as the evaluator's default) over synthetic sentences, and the seven-task STS
   wall time = the seven tasks' sentences (`STS_PAIRS` × 2) ÷ that rate.
3. Writes `<out>/gpu_check-<device-slug>.json` and `.md` (the README's GPU table copies the markdown).
Exit status: non-zero if the tests or any measurement failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import statistics
import subprocess
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

from benchmarks.machine import REPO_ROOT, command_line, quiet_trainer, sync, timed
from cse.config.methods import REGISTRY, model_class
from cse.config.training import resolve_train_config
from cse.storage.training_data import CorruptionRows, TokenRows
from cse.training.job import loop_config as job_loop_config
from cse.training.job import training_phases
from cse.training.loop import LoopConfig, Trainer, TrainerHooks
from cse.training.rows import TrainingRows

METHODS = tuple(REGISTRY)  # every registered method, in registry order
VOCAB = 30522  # bert-base-uncased's size and special-id layout
WIKI1M, NLI = 1_000_000, 275_601
# SentEval STS pairs: STS12–16 (all subsets), STS-B test, SICK-R test.
STS_PAIRS = {
    "STS12": 3108,
    "STS13": 1500,
    "STS14": 3750,
    "STS15": 3000,
    "STS16": 1186,
    "STSBenchmark": 1379,
    "SICKRelatedness": 4927,
}
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0, "V100": 125.0}
SIZES = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}


# ------------------------------------------------------------------------------------------------ models and data
def synthetic_tokenizer():
    """A BERT WordPiece tokenizer with bert-base-uncased's size and special ids ([PAD] 0, [UNK] 100, [CLS] 101,
    [SEP] 102, [MASK] 103) and a synthetic vocabulary (letters, digits, their ## pieces, filler): no download and
    no packaged model needed; ids are what a random-initialised model sees anyway."""
    from transformers import BertTokenizerFast

    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)] + list(".,;:!?'\"-()")
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += chars + [f"##{c}" for c in chars] + ["the", "a", "of", "and", "to", "in", "is", "<mask>"]
    vocab += [f"w{i}" for i in range(VOCAB - len(vocab))]
    folder = Path(tempfile.mkdtemp(prefix="cse-synthetic-tokenizer-"))
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True)


def backbone(size: str, seed: int = 0, attn: str = "sdpa", layers: int | None = None):
    """A random-initialised BERT of `size` ("tiny" or "base" = BertConfig()) with bert-base-uncased's vocabulary
    (`layers`: another depth)."""
    from transformers import BertConfig, BertModel

    dims = {**SIZES[size], **({"num_hidden_layers": layers} if layers else {})}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return BertModel(BertConfig(vocab_size=VOCAB, attn_implementation=attn, **dims), add_pooling_layer=False)


def preset(method: str, size: str, batch: int | None = None, length: int | None = None):
    """The method's default preset; `batch`/`length` override its batch size (every phase scaled alike) and
    maximum length."""
    cfg = resolve_train_config("default", method=method).model_copy(update={"eval_steps": 10**9})
    if length is not None:
        cfg = cfg.model_copy(update={"max_length": length})
    return cfg if batch is None else scale_batches(cfg, batch)


def scale_batches(cfg, batch: int, **update):
    """`cfg` (with `update`) at batch size `batch`, every phase's batch scaled alike (the auxiliary NLI batch to at
    least 1 row, DiffAug's prefix phase to at least 2)."""
    scale = batch / cfg.batch_size
    update["batch_size"] = batch
    if cfg.aux_nli_batch_size:
        update["aux_nli_batch_size"] = max(1, round(cfg.aux_nli_batch_size * scale))
    if cfg.prefix_phase is not None:
        update["prefix_phase"] = cfg.prefix_phase.model_copy(
            update={"batch_size": max(2, round(cfg.prefix_phase.batch_size * scale))}
        )
    return cfg.model_copy(update=update)


def build_model(method: str, cfg, size: str, tokenizer, seed: int = 0, layers: int | None = None):
    """The method's model on a random BERT of `size` (with the class's `random_backbone_kwargs`, e.g. DCPCSE's fresh
    LM head with mlm, as the dry run; `layers`: another depth)."""
    cls = model_class(method)
    enc = backbone(size, seed, layers=layers)
    with torch.random.fork_rng():  # (the fresh heads of `random_backbone_kwargs` too: the same model every time)
        torch.manual_seed(seed)
        kwargs = cls.random_backbone_kwargs(cfg.model, enc) if hasattr(cls, "random_backbone_kwargs") else {}
        return cls(cfg.model, backbone=enc, tokenizer=tokenizer, **kwargs)


def synthetic_rows(
    cfg, method: str, n: int, tokenizer, seed: int = 0, texts: dict | None = None
) -> tuple[TrainingRows, TrainingRows | None]:
    """`n` rows of exactly `cfg.max_length` ids ([CLS] ordinary ids [SEP]); corrupted ids = 30 % random
    replacements (one variant per view); DiffAug also gets NLI triplet rows. `texts` (column → sentences: `text`,
    `sent0`, `sent1`, `hard_neg`): real sentences instead, tokenised as the tokenize stage does (cut at `max_length`)
    and padded as the job pads (`speed.pad_to_max_length`); their corrupted ids stay random replacements."""
    rng = np.random.default_rng(seed)

    def tokens(columns, count):
        if texts is not None:
            cut = lambda c: tokenizer(texts[c][:count], truncation=True, max_length=cfg.max_length)["input_ids"]
            return TokenRows(ids=np.arange(count), seqs={c: [np.array(s) for s in cut(c)] for c in columns})
        body = rng.integers(1000, VOCAB, size=(count, cfg.max_length - 2))
        full = np.column_stack([np.full(count, tokenizer.cls_token_id), body, np.full(count, tokenizer.sep_token_id)])
        return TokenRows(ids=np.arange(count), seqs={c: list(full) for c in columns})

    columns = ("sent0", "sent1", "hard_neg") if cfg.supervised else ("text",)
    tok = tokens(columns, n)
    corruption = None
    if model_class(method).uses_corruption:
        views = 3 if cfg.supervised else 2
        cor, lab = {}, {}
        for c in columns:
            for v in range(views):
                pairs = []
                for s in tok.seqs[c]:
                    pick = rng.random(len(s)) < 0.3
                    pick[0] = pick[-1] = False
                    new = np.where(pick, rng.integers(1000, VOCAB, len(s)), s)
                    pairs.append((new, (new != s).astype(np.int8)))
                cor[(c, v)], lab[(c, v)] = [p[0] for p in pairs], [p[1] for p in pairs]
        corruption = CorruptionRows(variants=views, corrupted=cor, labels=lab)
    pad_to = cfg.max_length if texts is not None and cfg.speed.pad_to_max_length else None
    rows = TrainingRows(tok, corruption, cfg.supervised, tokenizer.pad_token_id, pad_to)
    nli = None
    if cfg.needs_nli:
        n_nli = 2 * max(cfg.prefix_phase.batch_size if cfg.prefix_phase else 0, cfg.aux_nli_batch_size)
        triplets = tokens(("sent0", "sent1", "hard_neg"), max(n_nli, n))
        nli = TrainingRows(triplets, None, True, tokenizer.pad_token_id, pad_to)
    return rows, nli


def loop_config(cfg, precision: str, steps: int, **switches) -> LoopConfig:
    """The job's loop settings (`cse.training.job.loop_config`) for `steps` steps of one epoch, no dev evaluation, a log
    every step and the speed `switches`."""
    job = cfg.model_copy(
        update={
            "epochs": 1,
            "max_steps": steps,
            "eval_steps": 10**9,
            "checkpoint_steps": 10**9,
            "log_steps": 1,
            "deterministic": False,
        }
    )
    return dataclasses.replace(job_loop_config(job, precision), **switches)


def job_phases(cfg, rows, nli, steps: int):
    """The preset's phases, each capped at `steps` optimiser steps (DiffAug: its NLI phase gets `steps` too)."""
    phases = training_phases(cfg.model_copy(update={"max_steps": steps}), rows, nli)
    for p in phases:
        p.max_steps = steps
        p.cycle = True
        p.schedule_steps = None
    return phases


def projected_steps(cfg) -> int:
    """Optimiser steps of the preset's whole schedule on the real data sizes."""
    n = NLI if cfg.supervised else WIKI1M
    steps = math.ceil(n / cfg.batch_size) * cfg.epochs
    if cfg.max_steps:
        steps = min(steps, cfg.max_steps)
    return steps + (cfg.prefix_phase.steps if cfg.prefix_phase is not None else 0)


# ------------------------------------------------------------------------------------------------ measurements
def last_phase_batch(trainer: Trainer):
    """A full batch of the trainer's last phase (its first rows, with the auxiliary NLI batch where it has one)."""
    last = trainer.phases[-1]
    batch = last.rows.batch(np.arange(last.batch_size), 0)
    if last.aux_rows is not None:
        batch.aux = last.aux_rows.batch(np.arange(last.aux_batch_size), 0)
    return batch


def device_peak(device: torch.device, peak_tflops: float | None) -> tuple[str, float | None]:
    """(the device's name, its dense bf16 peak TFLOP/s: `peak_tflops` when given, else `PEAK_TFLOPS` by name on CUDA)."""
    if device.type != "cuda":
        return platform.processor() or "cpu", peak_tflops or None
    name = torch.cuda.get_device_name(device)
    return name, peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def count_step_flops(trainer: Trainer, batch) -> int:
    """FLOPs of one whole training step (forward + backward + optimiser), by FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        trainer.train_step(batch)
    return int(counter.get_total_flops())


def benchmark_trainer(
    method: str,
    device: torch.device,
    size: str,
    precision: str,
    n_steps: int,
    tokenizer,
    switches: dict,
    folder: str | Path,
    hooks: list,
    texts: dict | None = None,
):
    """The method's default preset (at its real batch and length on BERT-base size; batch 4 × length 16 on the tiny
    size of the CPU rehearsals) on a random BERT of `size`, its synthetic rows (`texts`: real sentences, `synthetic_rows`)
    and a `Trainer` of `n_steps` steps per
    phase, no dev evaluation and no resume state written (its folder: `folder`/state); returns (config, trainer).
    Shared by the throughput rows, `benchmarks/step_profile.py` and `benchmarks/gpu_speed.py`."""
    cfg = preset(method, size) if size == "base" else preset(method, size, batch=4, length=16)
    model = build_model(method, cfg, size, tokenizer, cfg.seed).to(device)
    big = max(cfg.batch_size, cfg.prefix_phase.batch_size if cfg.prefix_phase else 0)
    rows, nli = synthetic_rows(cfg, method, big * 2, tokenizer, cfg.seed, texts)
    loop = dataclasses.replace(loop_config(cfg, precision, n_steps, **switches), save_state=False)  # steps, not I/O
    phases = job_phases(cfg, rows, nli, n_steps)
    return cfg, quiet_trainer(model, phases, loop, device, Path(folder) / "state", hooks)


def training_throughput(
    method: str,
    device: torch.device,
    size: str,
    precision: str,
    steps: int,
    warmup: int,
    tokenizer,
    peak_tflops: float | None,
    switches: dict,
) -> dict:
    n_steps = warmup + steps
    times: list[float] = []

    class Timed(TrainerHooks):  # one step: forward to the end of the parameter update, synchronised
        def on_forward_start(self, trainer, b):
            sync(device)
            self.t0 = time.perf_counter()

        def on_update_end(self, trainer):
            sync(device)
            times.append(time.perf_counter() - self.t0)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory(prefix="gpu-check-state-") as folder:
        hooks = [Timed()]
        cfg, trainer = benchmark_trainer(method, device, size, precision, n_steps, tokenizer, switches, folder, hooks)
        trainer.run()
        peak = trainer.peak_memory_gb if device.type == "cuda" else None  # the steps' peak (training/memory.py)
        probe = last_phase_batch(trainer)
        tokens = probe.tokens
        flops = count_step_flops(trainer, probe.to(device))
    step_s = statistics.median(times[-steps:])  # the joint/main phase: the last `steps` steps of the last phase
    tflops = flops / step_s / 1e12
    rec = {
        "method": method,
        "preset": "default",
        "size": size,
        "precision": precision,
        "batch_size": cfg.batch_size,
        "max_length": cfg.max_length,
        "steps": steps,
        "warmup": warmup,
        "step_s": round(step_s, 5),
        "steps_per_s": round(1 / step_s, 3),
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / step_s, 1),
        "peak_memory_gib": None if peak is None else round(peak, 2),
        "flops_per_step": flops,
        "achieved_tflops": round(tflops, 2),
        "mfu": None if not peak_tflops else round(tflops / peak_tflops, 4),
        "host_wait_share": round(trainer.host_wait_s / max(trainer.loop_s, 1e-9), 4),
        "projected_schedule_steps": projected_steps(resolve_train_config("default", method=method)),
        "switches": switches,
    }
    rec["projected_schedule_h"] = round(rec["projected_schedule_steps"] * step_s / 3600, 2)
    return rec


def corruption_throughput(device: torch.device, size: str, sentences: int, length: int, precision: str) -> dict:
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    from cse.models.corruption import Corruptor, SpecialTokens

    dims = (
        dict(dim=768, n_layers=6, n_heads=12, hidden_dim=3072)
        if size == "base"
        else dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64)
    )
    torch.manual_seed(0)
    gen = DistilBertForMaskedLM(DistilBertConfig(vocab_size=VOCAB, pad_token_id=0, **dims)).to(device).eval()
    tokens = SpecialTokens(pad=0, mask=103, special=(0, 100, 101, 102, 103), vocab_size=VOCAB)
    corruptor = Corruptor(gen, tokens, 0.3, "sample", device=device, bf16=precision == "bf16")
    ids = torch.randint(1000, VOCAB, (sentences, length))  # the Corruptor takes CPU batches, runs G on `device`
    ids[:, 0], ids[:, -1] = 101, 102
    mask = torch.ones_like(ids)
    batch = 256 if size == "base" else 8

    def corrupt_all() -> None:
        for i in range(0, sentences, batch):
            corruptor(ids[i : i + batch], mask[i : i + batch])

    corruptor(ids[:batch], mask[:batch])  # warm-up
    rate = sentences / timed(corrupt_all, device)
    views = 2 * 2  # d2cse/default: 2 epochs × 2 views, a fresh corruption each
    return {
        "generator": f"random DistilBERT {dims}",
        "length": length,
        "batch": batch,
        "sentences": sentences,
        "sentences_per_s": round(rate, 1),
        "wiki1m_faithful_minutes": round(WIKI1M * views / rate / 60, 1),
    }


def evaluation_throughput(device: torch.device, size: str, sentences: int, tokenizer) -> dict:
    from cse.evaluation.encode import embed_token_ids
    from cse.models.embedder import PooledEncoder

    model = PooledEncoder(backbone(size), "cls_before_pooler", tokenizer=tokenizer).to(device).eval()
    rng = np.random.default_rng(0)
    # STS sentence lengths: 8–40 word pieces
    ids = [[101, *rng.integers(1000, VOCAB, int(rng.integers(6, 39))).tolist(), 102] for _ in range(sentences)]
    embed_token_ids(model, ids[:128])  # warm-up
    rate = sentences / timed(lambda: embed_token_ids(model, ids), device)
    total = 2 * sum(STS_PAIRS.values())
    return {
        "encoder": f"random BERT {size}",
        "sentences": sentences,
        "sentences_per_s": round(rate, 1),
        "sts7_sentences": total,
        "sts7_wall_s": round(total / rate, 1),
    }


# ------------------------------------------------------------------------------------------------ report
def device_slug(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def report_header(title: str, result: dict) -> str:
    """The first line of a GPU report: what ran, on which device and torch, when, by which command."""
    env = result["environment"]
    return (
        f"{title} on **{env['device_name']}** (torch {env['torch']}, CUDA {env['cuda']}), "
        f"{result['date']}; `{result['command']}`"
    )


def markdown(result: dict) -> str:
    lines = [
        report_header("GPU check", result),
        "",
        f"Tests (`pytest -m gpu`): {result['tests']['summary']}",
        "",
        "| method (default preset) | batch × length | precision | steps/s | tokens/s | peak GiB | TFLOP/s | MFU | "
        "host wait | projected schedule |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["training"]:
        if "error" in r:
            lines.append(f"| {r['method']} | failed: {r['error']} | | | | | | | | |")
            continue
        mfu = "–" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %"
        mem = "–" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}"
        lines.append(
            f"| {r['method']} | {r['batch_size']} × {r['max_length']} | {r['precision']} | {r['steps_per_s']:.2f} | "
            f"{r['tokens_per_s']:,.0f} | {mem} | {r['achieved_tflops']:.1f} | {mfu} | "
            f"{100 * r['host_wait_share']:.1f} % | {r['projected_schedule_steps']:,} steps ≈ "
            f"{r['projected_schedule_h']:.2f} h |"
        )
    c, e = result.get("corruption", {}), result.get("evaluation", {})
    if "sentences_per_s" in c:
        lines += [
            "",
            f"Corruption ({c['generator']}, length {c['length']}): {c['sentences_per_s']:,.0f} sentences/s; "
            f"faithful Wiki1M corruption (4 M sentences) ≈ {c['wiki1m_faithful_minutes']:.1f} min.",
        ]
    if "sentences_per_s" in e:
        lines += [
            "",
            f"Evaluation ({e['encoder']}): {e['sentences_per_s']:,.0f} sentences/s; seven-task STS "
            f"({e['sts7_sentences']:,} sentences) ≈ {e['sts7_wall_s']:.1f} s.",
        ]
    return "\n".join(lines) + "\n"


def run_tests(device: torch.device, out: Path) -> dict:
    env = {**os.environ, "CSE_GPU_CHECK_DEVICE": device.type}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    cmd += [str(REPO_ROOT / "tests" / "gpu"), f"--junitxml={out / 'gpu_tests.xml'}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next(
        (ln for ln in reversed(tail) if re.search(r"\d+ (passed|failed|error)", ln)), tail[-1] if tail else ""
    )
    print("\n".join(tail[-40:]), flush=True)
    return {
        "returncode": proc.returncode,
        "summary": summary.strip("= "),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def measure_throughput(
    result: dict, args, device: torch.device, methods: list[str], steps: int, warmup: int, peak
) -> bool:
    """Each method's training step, then the corruption and evaluation passes, into `result` (a failure is reported
    in its entry, and the others still run); whether any failed."""
    cuda, failed = device.type == "cuda", False
    size, precision = ("base", "bf16") if cuda else ("tiny", "fp32")
    switches = {"fused_adamw": args.fused_adamw, "compile": args.compile, "sdpa_backend": args.sdpa_backend}
    tokenizer = synthetic_tokenizer()
    for method in methods:
        try:
            rec = training_throughput(method, device, size, precision, steps, warmup, tokenizer, peak, switches)
        except Exception as e:  # noqa: BLE001 - one method's failure is reported; the others still run
            traceback.print_exc()
            rec, failed = {"method": method, "error": f"{type(e).__name__}: {e}"[:300]}, True
        print(json.dumps(rec), flush=True)
        result["training"].append(rec)
        if cuda:
            torch.cuda.empty_cache()
    for key, fn in (
        ("corruption", lambda: corruption_throughput(device, size, 8192 if cuda else 16, 32, precision)),
        ("evaluation", lambda: evaluation_throughput(device, size, 8192 if cuda else 32, tokenizer)),
    ):
        try:
            result[key] = fn()
        except Exception as e:  # noqa: BLE001 - one measurement's failure is reported; the others still run
            traceback.print_exc()
            result[key], failed = {"error": f"{type(e).__name__}: {e}"[:300]}, True
        print(json.dumps({key: result[key]}), flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=None, help="measured steps per method (default: 10 CUDA, 2 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 3 CUDA, 1 CPU)")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--fused-adamw", action="store_true", help="LoopConfig.fused_adamw (CSE_FUSED_ADAMW=1)")
    p.add_argument("--compile", action="store_true", help="LoopConfig.compile: torch.compile the training step")
    p.add_argument("--sdpa-backend", default="", choices=["", "flash", "efficient", "cudnn", "math"])
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (default: by name)")
    args = p.parse_args(argv)
    from cse.models.loading import pick_device

    device = pick_device(args.device)
    cuda = device.type == "cuda"
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; known: {list(METHODS)}")
    steps, warmup = args.steps or (10 if cuda else 2), args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.out.mkdir(parents=True, exist_ok=True)
    name, peak = device_peak(device, args.peak_tflops)
    result: dict = {
        "benchmark": "gpu_check",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": command_line("benchmarks.gpu_check", argv),
        "environment": {
            "device_name": name,
            "device": device.type,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpus": torch.cuda.device_count() if cuda else 0,
            "python": platform.python_version(),
            "peak_bf16_tflops": peak,
        },
        "flops_counting": "torch.utils.flop_counter.FlopCounterMode over one whole training step (forward + backward as "
        "run: matmuls, attention, convolutions; elementwise not counted)",
        "tests": {"summary": "not run (--skip-tests)"},
        "training": [],
        "corruption": {},
        "evaluation": {},
    }
    failed = False
    if not args.skip_tests:
        result["tests"] = run_tests(device, args.out)
        failed |= result["tests"]["returncode"] != 0
    if not args.skip_throughput:
        failed |= measure_throughput(result, args, device, methods, steps, warmup, peak)
    stem = args.out / f"gpu_check-{device_slug(device)}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {stem}.json and {stem}.md", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
