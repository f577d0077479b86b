"""Paper-scale dry run: every training preset of every method builds at full size and steps through the real trainer.

    python -m benchmarks.dry_run [--methods d2cse,simcse] [--presets default,dcpcse/sup] [--threads 1]
        [--max-memory-gb 8] [--step-budget-s 4] [--include-smoke] [--no-meta] [--out benchmarks/results]
    python -m benchmarks.dry_run --from-json   # rewrite the table from the saved JSON

For every preset of every registered method (resolved at run time by `cse.config.training.resolve_train_config`, so
presets added later are picked up; the MiniLM-sized `smoke*` presets, run by the tests, only with `--include-smoke`
or when named in `--presets`):

1. Build. The backbone is RANDOM-INITIALISED at the preset's real shape (no pretrained weights are reachable here),
   seeded with the preset's seed: `bert-base-uncased` = `BertConfig()`, `bert-large-uncased` = `LARGE`, `roberta-*`
   = the same with RoBERTa's vocabulary and special ids (`ROBERTA`); `packaged:minilm` is loaded as is. The model is
   the method's class built on it (with the class's `random_backbone_kwargs`, e.g. DCPCSE's fresh LM head with
   `mlm=True`, the same shape as the pretrained head). BERT shapes use the packaged MiniLM tokenizer
   (bert-base-uncased vocabulary); RoBERTa shapes `RobertaIdsStandIn` (RoBERTa's ids; its `encode`, which only
   DiffAug's template needs, maps words to deterministic ids, so template lengths are not RoBERTa BPE's). Trainable
   parameters are checked against the reference's count where benchmarks/facts.py gives one. Generators (the methods
   that read corrupted ids): random DistilBERT / RoBERTa MLMs of `distilbert-base-uncased` / `distilroberta-base`'s
   shape (768/6/12/3072), `random-init:*` = `cse.models.loading.build_random_masked_lm`.

2. Data. Synthetic token rows, every row exactly `cfg.max_length` ids (the worst case: no padding is saved), `[CLS]
   w … w [SEP]` (RoBERTa: `<s> … </s>`) of the backbone's ordinary vocabulary; one column unsupervised (two dropout
   views), three supervised; DiffAug also gets NLI triplet rows (stage-1 data and the auxiliary batch). They are
   wrapped as the training stage does (`TokenRows` / `CorruptionRows` → `TrainingRows`) and the phases come from
   `cse.training.job.training_phases`. Corruption (DiffCSE, D2CSE): the preset's random-init generator runs through
   `cse.models.corruption.Corruptor` + `corrupt_sequences` at the preset's mask ratio and mode, one variant per view
   (epoch 0 of the fresh-corruption default), on up to 16 distinct sentences per (column, variant) that the batches
   tile (the generator's shape is exercised; corrupting every row of a 512-row batch would cost CPU minutes).

3. Steps. The real `cse.training.loop.Trainer` with the job's loop settings (`cse.training.job.loop_config`, fp32,
   deterministic off, `eval_steps`/`checkpoint_steps`/`log_steps` = 10^9, no resume state written) and a
   `StepProbe` on its public hooks runs 2 optimiser steps: 2 of the one phase, or for DiffAug 1 prefix-phase step + 1
   joint step (its joint step costs ~25 s of batch-independent template denoising on BERT-base, so its timings are
   first-step timings, ~5–20 % above a warm step judging from the other methods). `evaluate_dev` returns 0.0;
   nothing is saved or logged.
   a. CPU run at a micro batch: the largest of {real batch, 64, 32, 16, 8, 4, 2} (below the real batch) whose
      predicted CPU time of the batch-proportional part of a step fits `--step-budget-s` and whose predicted peak
      RSS fits `--max-memory-gb` (a FLOP model calibrated on the presets measured so far). Every batch size of the
      job (main, DiffAug prefix phase, aux NLI) is scaled by the same factor (>= 2, aux >= 1); where the real batch
      fits, it runs for real (`real_batch_run`: true).
   b. Meta run at the REAL batch (`--no-meta` skips it): the same model on `torch.device("meta")` (shapes only), a
      fresh trainer, the real batch sizes and the same step counts: it catches shape/build errors at the real batch.
      Model code that branches on tensor VALUES (DiffAug's row checks, DCPCSE's MLM boolean indexing) cannot run on
      meta: such a preset is reported `meta: unsupported (<op> at file:line)`, not as a failure (the CPU run covers
      those paths); any other meta error fails the preset. The HF encoders switch to an attention that always builds
      the mask (`build_full_masks`: the default one reads the padding mask's values to skip it).

4. Figures (per phase; the table shows the joint/main phase):
   - s/step measured = the last step of the phase in the CPU run, as wall time and as process CPU time (with one
     thread the CPU time is the compute, unaffected by other jobs sharing the cores); `const` = its
     batch-independent part: the parameter update (clipping + AdamW + LR step, between the `on_update_start` /
     `on_update_end` hooks), + for DiffAug the template-denoising forward/backward (timed on its own after the run).
   - CPU s/step projected at the real batch (`--threads` threads) = const + (measured CPU s - const) × real rows /
     measured rows: LINEAR in rows (attention over 32–50 positions is close to linear); the wall time's is in the JSON.
   - peak CPU memory: peak RSS during the steps (VmHWM reset through /proc/self/clear_refs before every step, else
     psutil sampling), and `act_mb` = peak RSS during the forward of the last step − RSS before that step: the saved
     activations and forward temporaries of that batch (the previous step's grads and AdamW states are resident; the
     weight gradients do not grow with the batch). `step_peak_delta_mb` (JSON): the whole step's peak − RSS before.
   - projected GPU memory at the real batch, bf16 autocast (CUDA context not included):
       4·N_all (fp32 weights) + 2·N_all (autocast's bf16 weight copies) + 12·N_trainable (fp32 grads + AdamW m, v)
       + 0.5 × act_mb × real rows / measured rows (activations measured in fp32 on CPU, halved for bf16;
       DiffAug's template-denoising activations are batch-independent and added unscaled),
     `N_trainable` being the phase's optimiser parameters; the GPU figure is the max over phases.

Output: `<out>/dry_run.json` (rewritten after every preset) and a markdown table (`<out>/dry_run.md`). A preset that
fails to build or step prints its traceback and the others still run; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.machine import REPO_ROOT, command_line, release_freed_heap, set_offline_environment


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--methods", default="", help="comma-separated methods (default: every method of cse.config.methods.REGISTRY)"
    )
    p.add_argument("--presets", default="", help="comma-separated preset names or method/name pairs (default: all)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--max-memory-gb", type=float, default=8.0, help="predicted peak RSS budget of a CPU run")
    p.add_argument(
        "--step-budget-s",
        type=float,
        default=4.0,
        help="predicted CPU seconds of the batch-proportional part of one step (picks the micro batch)",
    )
    p.add_argument(
        "--include-smoke", action="store_true", help="also run the smoke* presets (MiniLM-sized, covered by tests)"
    )
    p.add_argument("--no-meta", action="store_true", help="skip the real-batch meta-device run")
    p.add_argument(
        "--from-json",
        action="store_true",
        help="rewrite <out>/dry_run.md from <out>/dry_run.json without running anything (after a change of the table)",
    )
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results", help="output folder")
    return p.parse_args(argv)


if __name__ == "__main__":  # thread settings must precede the torch import
    _ARGS = _parse_args(sys.argv[1:])
    for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[_v] = str(_ARGS.threads)

set_offline_environment()
os.environ.setdefault("TQDM_DISABLE", "1")

import contextlib
import json
import math
import platform
import re
import statistics
import tempfile
import threading
import time
import traceback
import zlib

import numpy as np
import psutil
import torch
from torch import nn

from benchmarks.facts import facts
from benchmarks.gpu_check import loop_config, scale_batches
from benchmarks.machine import quiet_trainer
from cse.config.methods import REGISTRY, model_class
from cse.config.training import resolve_train_config
from cse.models.corruption import Corruptor, SpecialTokens, corrupt_sequences
from cse.models.loading import (
    PACKAGED_MINILM,
    RANDOM_INIT,
    build_random_masked_lm,
    is_random_init,
    load_encoder,
    load_tokenizer,
)
from cse.storage.training_data import CorruptionRows, TokenRows
from cse.training.job import training_phases
from cse.training.loop import Trainer, TrainerHooks
from cse.training.memory import PeakMemory
from cse.training.rows import TrainingRows

MB = 2**20
GB = 2**30
MICRO_CANDIDATES = (64, 32, 16, 8, 4, 2)
CORRUPT_POOL = 16  # distinct sentences the generator corrupts per (column, variant)
SUP_COLUMNS = ("sent0", "sent1", "hard_neg")
# RoBERTa's vocabulary and special ids, and the large shape (BERT and RoBERTa alike)
ROBERTA = dict(
    vocab_size=50265,
    max_position_embeddings=514,
    type_vocab_size=1,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    layer_norm_eps=1e-5,
)
LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)


# ---------------------------------------------------------------------------------------------- shapes
def backbone_model(name: str, seed: int) -> nn.Module:
    """A random-initialised encoder of `name`'s shape (packaged MiniLM: the real one)."""
    from transformers import AutoModel, BertConfig, RobertaConfig

    if name == PACKAGED_MINILM:
        return load_encoder(name)
    shapes = {
        "bert-base-uncased": lambda: BertConfig(),
        "bert-large-uncased": lambda: BertConfig(**LARGE),
        "roberta-base": lambda: RobertaConfig(**ROBERTA),
        "roberta-large": lambda: RobertaConfig(**ROBERTA, **LARGE),
    }
    if name not in shapes:
        raise ValueError(f"no random-init shape for backbone {name!r}; known: {sorted(shapes) + [PACKAGED_MINILM]}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModel.from_config(shapes[name]())


def generator_model(name: str, seed: int) -> nn.Module:
    """A random-initialised masked-LM generator of `name`'s shape."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    if is_random_init(name) or name == "distilbert-base-uncased":  # (the random one is of its shape)
        return build_random_masked_lm(name if is_random_init(name) else RANDOM_INIT + name, seed=seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if name == "distilroberta-base":
            shape = dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072)
            return RobertaForMaskedLM(RobertaConfig(**ROBERTA, **shape))
    raise ValueError(
        f"no random-init shape for generator {name!r}; known: distilbert-base-uncased, "
        "distilroberta-base, random-init:*"
    )


class RobertaIdsStandIn:
    """The RoBERTa ids a model needs from its tokenizer, offline (no RoBERTa tokenizer is reachable here).

    `encode` splits text into `<mask>` / words / punctuation and maps each piece to a deterministic id of the
    ordinary vocabulary (crc32), so template lengths are word counts, not RoBERTa BPE counts.
    """

    name_or_path = "roberta-ids-stand-in"
    cls_token_id, pad_token_id, sep_token_id, unk_token_id, mask_token_id = 0, 1, 2, 3, 50264
    bos_token_id, eos_token_id = 0, 2
    cls_token, pad_token, sep_token, unk_token, mask_token = "<s>", "<pad>", "</s>", "<unk>", "<mask>"
    all_special_ids = [0, 1, 2, 3, 50264]
    vocab_size = 50265

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [
            self.mask_token_id if piece == self.mask_token else 4 + zlib.crc32(piece.encode()) % (self.vocab_size - 5)
            for piece in re.findall(r"<mask>|\w+|[^\w\s]", text)
        ]
        return [self.cls_token_id, *ids, self.sep_token_id] if add_special_tokens else ids

    def __call__(self, texts, add_special_tokens: bool = True, truncation: bool = False, **_):
        return {"input_ids": [self.encode(t, add_special_tokens) for t in texts]}


def tokenizer_for(backbone: str):
    if backbone.startswith("roberta"):
        return RobertaIdsStandIn()
    return load_tokenizer(PACKAGED_MINILM)  # bert-base-uncased vocabulary (also bert-large-uncased's)


def ordinary_id_range(tokenizer) -> tuple[int, int]:
    """[low, high) of ids that are ordinary vocabulary entries (no special/unused ids)."""
    if isinstance(tokenizer, RobertaIdsStandIn):
        return 4, tokenizer.mask_token_id
    return 1000 if len(tokenizer) > 1000 else max(tokenizer.all_special_ids) + 1, len(tokenizer)


# ---------------------------------------------------------------------------------------------- data
def token_rows(tokenizer, n: int, length: int, columns: tuple[str, ...], seed: int) -> TokenRows:
    """`n` rows per column, each exactly `length` ids: [CLS] ordinary ids [SEP]."""
    rng = np.random.default_rng(seed)
    low, high = ordinary_id_range(tokenizer)
    seqs = {}
    for c in columns:
        body = rng.integers(low, high, size=(n, length - 2), dtype=np.int64)
        seqs[c] = list(np.column_stack([np.full(n, tokenizer.cls_token_id), body, np.full(n, tokenizer.sep_token_id)]))
    return TokenRows(ids=np.arange(n), seqs=seqs)


def corruption_rows(cfg, tokens: TokenRows, n_views: int, tokenizer, seed: int) -> tuple[CorruptionRows, dict]:
    """Corrupted ids of every row by the preset's random-init generator (a pool of CORRUPT_POOL rows, tiled)."""
    t0 = time.perf_counter()
    gen = generator_model(cfg.corrupt.generator, seed)
    n_gen = sum(p.numel() for p in gen.parameters())
    variants = n_views if cfg.corrupt.variants is None else min(cfg.corrupt.variants, n_views)
    corruptor = Corruptor(
        gen,
        SpecialTokens.from_tokenizer(tokenizer),
        cfg.corrupt.mask_ratio,
        cfg.corrupt.mode,
        device="cpu",
        bf16=False,
        dropout=cfg.corrupt.generator_dropout,
    )
    corrupted, labels, replaced = {}, {}, []
    pool = min(CORRUPT_POOL, len(tokens))
    for c in tokens.columns:
        seqs = tokens.seqs[c][:pool]
        flat = np.concatenate(seqs)
        offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
        for v in range(variants):
            out = corrupt_sequences(
                corruptor, flat, offsets, torch.Generator().manual_seed(seed * 1009 + 31 * v), batch_size=pool
            )
            cor = [out.corrupted[offsets[i] : offsets[i + 1]] for i in range(pool)]
            lab = [out.labels[offsets[i] : offsets[i + 1]] for i in range(pool)]
            corrupted[(c, v)] = [cor[i % pool] for i in range(len(tokens))]
            labels[(c, v)] = [lab[i % pool] for i in range(len(tokens))]
            replaced.append(float(out.n_replaced.sum()) / float(offsets[-1]))
    info = {
        "generator": cfg.corrupt.generator,
        "generator_parameters": n_gen,
        "mask_ratio": cfg.corrupt.mask_ratio,
        "mode": cfg.corrupt.mode,
        "variants": variants,
        "replaced_token_share": round(statistics.mean(replaced), 4),
        "generator_seconds": round(time.perf_counter() - t0, 2),
    }
    # The corruption is tiled from the pool: the original ids of the tiled rows must be the pool's as well.
    for c in tokens.columns:
        tokens.seqs[c] = [tokens.seqs[c][i % pool] for i in range(len(tokens))]
    del corruptor, gen
    return CorruptionRows(variants=variants, corrupted=corrupted, labels=labels), info


# ---------------------------------------------------------------------------------------------- memory
def rss() -> int:
    return psutil.Process().memory_info().rss


class PeakRSS:
    """Peak RSS over a region: VmHWM reset by /proc/self/clear_refs (`cse.training.memory.PeakMemory`), else a 2 ms
    psutil sampling thread."""

    hwm = PeakMemory(torch.device("cpu"))
    use_hwm = hwm.resettable

    def __enter__(self) -> PeakRSS:
        self.peak = rss()
        if self.use_hwm:
            self.hwm.reset()
        else:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        if self.use_hwm:
            self.peak = max(self.peak, round(self.hwm.peak_gb() * 2**30))
        else:
            self._stop.set()
            self._thread.join()
        self.peak = max(self.peak, rss())


# ---------------------------------------------------------------------------------------------- trainer
class StepProbe(TrainerHooks):
    """Per-step timing and memory probes on the real Trainer's hooks: wall/CPU time of the step (forward to the end of
    the parameter update), the batch-independent part (the update: clipping + AdamW + LR step), peak RSS over the step
    and over the forward alone."""

    def __init__(self):
        self.records: list[dict] = []

    def on_step_start(self, trainer: Trainer, batch) -> None:
        if trainer.device.type != "meta":
            release_freed_heap()
        self.before = rss()
        self.step_peak = PeakRSS().__enter__()

    def on_forward_start(self, trainer: Trainer, batch) -> None:
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.forward_peak = PeakRSS().__enter__()  # peak RSS while the forward builds the graph: the saved activations

    def on_forward_end(self, trainer: Trainer, batch) -> None:
        self.forward_peak.__exit__(None, None, None)

    def on_update_start(self, trainer: Trainer) -> None:
        self.u0, self.uc0 = time.perf_counter(), time.process_time()

    def on_update_end(self, trainer: Trainer) -> None:
        t, c = time.perf_counter(), time.process_time()
        self.const_s, self.const_cpu_s = t - self.u0, c - self.uc0
        self.seconds, self.cpu_seconds = t - self.t0, c - self.c0

    def on_step_end(self, trainer: Trainer, batch, metrics: dict[str, float]) -> None:
        self.step_peak.__exit__(None, None, None)
        aux = batch.aux.input_ids.shape[0] if batch.aux is not None else 0
        self.records.append(
            {
                "phase": trainer.phase.name,
                "rows": int(batch.input_ids.shape[0]),
                "aux_rows": int(aux),
                "views": int(batch.input_ids.shape[1]),
                "length": int(batch.input_ids.shape[2]),
                "seconds": self.seconds,
                "cpu_seconds": self.cpu_seconds,
                "const_s": self.const_s,
                "const_cpu_s": self.const_cpu_s,
                "rss_before": self.before,
                "peak_rss": max(self.step_peak.peak, self.forward_peak.peak),
                "forward_peak_rss": self.forward_peak.peak,
                "loss": metrics.get("loss"),
            }
        )


def build_full_masks(model: nn.Module) -> None:
    """Meta run only: every HF model inside `model` switches to a copy of its attention implementation, registered
    through transformers' public `AttentionInterface` / `AttentionMaskInterface` under `<name>+full-mask`, whose mask
    function always builds the mask. transformers' SDPA mask otherwise reads the padding mask's values to skip
    building it when nothing is padded, which meta tensors cannot answer; the full mask has the same shape and is
    what any padded batch gets. Implementations without a registered attention function (a family's own eager
    code) are left as they are."""
    from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cse.models.loading import attention_implementation

    def full_mask(mask_fn):
        return lambda *args, **kwargs: mask_fn(*args, **{**kwargs, "allow_is_bidirectional_skip": False})

    outer = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    inner = {id(s) for m in outer for s in m.modules() if s is not m}
    for m in outer:
        name = attention_implementation(m)
        registered = name in ALL_ATTENTION_FUNCTIONS and name in ALL_MASK_ATTENTION_FUNCTIONS
        if id(m) in inner or name.endswith("+full-mask") or not registered:
            continue
        AttentionInterface.register(f"{name}+full-mask", ALL_ATTENTION_FUNCTIONS[name])
        AttentionMaskInterface.register(f"{name}+full-mask", full_mask(ALL_MASK_ATTENTION_FUNCTIONS[name]))
        m.set_attn_implementation(f"{name}+full-mask")


def stepped_config(cfg):
    """`cfg` with 2 optimiser steps per job (2 for one-phase methods, 1 prefix + 1 joint for DiffAug), fp32, without
    evaluation."""
    n = 1 if cfg.prefix_phase is not None else 2
    update = {"max_steps": n, "eval_steps": 10**9, "precision": "fp32"}
    if cfg.prefix_phase is not None:
        update["prefix_phase"] = cfg.prefix_phase.model_copy(update={"steps": n})
    return cfg.model_copy(update=update)


def run_trainer(model, cfg, rows, nli_rows, device: torch.device) -> StepProbe:
    """Run the job's phases of `cfg` on `device` through the real Trainer; returns the step probe with its records."""
    probe = StepProbe()
    if device.type == "meta":
        build_full_masks(model)
    # the job's loop settings in fp32, without evaluation, logging (a log reads the step's values) or resume state
    loop = loop_config(cfg, "fp32", cfg.max_steps, log_steps=10**9, save_state=False)
    phases = training_phases(cfg, rows, nli_rows)
    with tempfile.TemporaryDirectory(prefix="dry-run-state-") as state:
        quiet_trainer(model, phases, loop, device, Path(state) / "state", [probe]).run()
    return probe


# ---------------------------------------------------------------------------------------------- cost model
class CostModel:
    """Step seconds ≈ flops / rate and activation bytes ≈ k · tokens · layers · d, calibrated on measured presets."""

    def __init__(self):
        self.rates: list[float] = []  # flop/s
        self.act: list[float] = []  # bytes per (token · layer · hidden)

    @property
    def rate(self) -> float:
        return statistics.median(self.rates) if self.rates else 55e9

    @property
    def act_k(self) -> float:
        return max(self.act) if self.act else 150.0

    @staticmethod
    def work(info: dict, rows: int, phase: str) -> tuple[float, float]:
        """(flops, token·layer·hidden units) of the batch-proportional part of one step of `rows` rows."""
        views, length = info["views_by_phase"][phase], info["length_by_phase"][phase]
        tokens = rows * views * length * info["passes_by_phase"][phase]
        factor = 6.0 if info["backbone_trainable_by_phase"][phase] else 4.0
        return factor * info["layer_params"] * tokens, tokens * info["layers"] * info["hidden"]

    def predict(self, info: dict, rows: int, phase: str) -> tuple[float, float]:
        flops, units = self.work(info, rows, phase)
        return flops / self.rate, units * self.act_k

    def update(self, info: dict, rows: int, phase: str, seconds: float, act_bytes: float) -> None:
        flops, units = self.work(info, rows, phase)
        if seconds > 0.05:
            self.rates.append(flops / seconds)
        if act_bytes > 0:
            self.act.append(act_bytes / units)


# ---------------------------------------------------------------------------------------------- one preset
def model_kwargs(cls, cfg, backbone: nn.Module) -> dict:
    """Extra constructor arguments of the method for a random-initialised backbone (the class's
    `random_backbone_kwargs`, e.g. a fresh LM head), seeded with the preset's seed + 1."""
    if not hasattr(cls, "random_backbone_kwargs"):
        return {}
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed + 1)
        return cls.random_backbone_kwargs(cfg.model, backbone)


def pick_micro(cost: CostModel, info: dict, cfg, args, fixed_bytes: float) -> tuple[int, dict]:
    """The largest candidate batch whose predicted step time and peak memory fit the budgets."""
    real = cfg.batch_size
    candidates = [real] + [c for c in MICRO_CANDIDATES if c < real]
    main = info["main_phase"]
    chosen, why = candidates[-1], {}
    for c in candidates:
        scale = c / real
        secs, act = 0.0, 0.0
        for phase, real_rows in info["real_rows_by_phase"].items():
            rows = max(2, round(real_rows * scale)) if phase == main or phase == "prefix" else real_rows
            s, a = cost.predict(info, rows, phase)
            secs, act = max(secs, s), max(act, a)
        mem = fixed_bytes + act
        why = {"predicted_step_s": round(secs, 1), "predicted_peak_gb": round(mem / GB, 2)}
        if secs <= args.step_budget_s and mem <= args.max_memory_gb * GB:
            chosen = c
            break
    return chosen, why


def describe_model(method: str, cfg, model, backbone) -> dict:
    """What the cost model and the report need to know about the built model."""
    phases = model_class(method).phases
    layer_params = sum(p.numel() for p in backbone.encoder.parameters())
    passes = facts(method).dry_run_encoder_passes  # per view of a step: an int or a function of the model config
    passes = passes(cfg.model) if callable(passes) else passes
    views_main = 3 if cfg.supervised else 2
    info = {
        "layers": backbone.config.num_hidden_layers,
        "hidden": backbone.config.hidden_size,
        "layer_params": layer_params,
        "main_phase": phases[-1],
        "views_by_phase": {},
        "length_by_phase": {},
        "passes_by_phase": {},
        "backbone_trainable_by_phase": {},
        "real_rows_by_phase": {},
    }
    template = facts(method).dry_run_template_ids  # ids a prompt template wraps a sentence in
    for ph in phases:
        trainable_ids = {id(p) for p in model.phase_parameters(ph)}
        backbone_trainable = any(id(p) in trainable_ids for p in backbone.parameters())
        info["backbone_trainable_by_phase"][ph] = backbone_trainable
        if ph == "prefix":
            info["views_by_phase"][ph], info["real_rows_by_phase"][ph] = 3, cfg.prefix_phase.batch_size
        else:
            aux = cfg.aux_nli_batch_size * 3 / max(1, views_main * cfg.batch_size) if cfg.aux_nli_batch_size else 0
            info["views_by_phase"][ph] = views_main * (1 + aux)
            info["real_rows_by_phase"][ph] = cfg.batch_size
        info["length_by_phase"][ph] = cfg.max_length + template
        info["passes_by_phase"][ph] = passes
    return info


def run_preset(method: str, name: str, args, cost: CostModel) -> dict:
    """One preset's record: built at full size, stepped on the CPU at a micro batch, projected to the real batch, then
    (unless --no-meta) stepped at the real batch on the meta device."""
    rec: dict = {"method": method, "preset": name, "status": "running"}
    t_start = time.perf_counter()
    release_freed_heap()
    cfg = resolve_train_config(name, method=method)
    rec.update(config_fields(cfg))
    cls = model_class(method)
    rss_start = rss()
    tokenizer, backbone, model = build_full_size(cfg, cls, rec)
    n_all, by_phase = parameter_fields(method, cfg, cls, model, backbone, tokenizer, rec)
    info = describe_model(method, cfg, model, backbone)
    rows, nli_rows = real_batch_rows(cfg, cls, tokenizer, rec)

    # ---- CPU run at the micro batch
    release_freed_heap()
    rss_model = rss()
    micro, prediction = pick_micro(cost, info, cfg, args, rss_model + 12 * max(by_phase.values()))
    rec.update(
        micro_batch=micro,
        real_batch_run=micro == cfg.batch_size,
        prediction=prediction,
        model_rss_mb=round((rss_model - rss_start) / MB),
        process_rss_before_steps_mb=round(rss_model / MB),
    )
    mcfg = scale_batches(stepped_config(cfg), micro, device="cpu")  # every batch size scaled alike
    micro_nli = None
    if nli_rows is not None:
        micro_nli = head_rows(
            nli_rows, 2 * max(mcfg.prefix_phase.batch_size if mcfg.prefix_phase else 0, mcfg.aux_nli_batch_size)
        )
    t0 = time.perf_counter()
    trainer = run_trainer(model, mcfg, head_rows(rows, 2 * micro), micro_nli, torch.device("cpu"))
    rec["cpu_run_seconds"] = round(time.perf_counter() - t0, 1)
    constant = batch_independent_forward(model, rec)
    phases_out = {
        ph: phase_record(ph, trainer.records, info, by_phase[ph], n_all, constant if ph == "joint" else None, cost)
        for ph in cls.phases
    }
    rec["phases"] = phases_out
    rec.update(main_phase_fields(phases_out, info["main_phase"]))
    del trainer
    release_freed_heap()

    # ---- meta run at the real batch
    if args.no_meta:
        rec["meta"] = "skipped (--no-meta)"
    else:
        rec["meta"] = meta_run(model, cfg, rows, nli_rows)
        if rec["meta"].startswith("FAILED"):
            raise RuntimeError(f"meta run at the real batch: {rec['meta']}")
    del model, backbone
    release_freed_heap()
    rec["status"] = "ok"
    rec["seconds"] = round(time.perf_counter() - t_start, 1)
    return rec


def config_fields(cfg) -> dict:
    """The record's fields of the preset's configuration: backbone, supervision, lengths, batch sizes, model."""
    fields = {
        "backbone": cfg.backbone,
        "supervised": cfg.supervised,
        "max_length": cfg.max_length,
        "batch_size": cfg.batch_size,
        "model_config": cfg.model_dump()["model"],
    }
    if cfg.prefix_phase is not None:
        fields["prefix_phase_batch_size"] = cfg.prefix_phase.batch_size
    if cfg.aux_nli_batch_size:
        fields["aux_nli_batch_size"] = cfg.aux_nli_batch_size
    return fields


def build_full_size(cfg, cls, rec: dict):
    """The preset's tokenizer, backbone and model at full size (random weights, the job's seed); `rec` gets the
    build's seconds."""
    t0 = time.perf_counter()
    tokenizer = tokenizer_for(cfg.backbone)
    backbone = backbone_model(cfg.backbone, cfg.seed)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        model = cls(cfg.model, backbone=backbone, tokenizer=tokenizer, **model_kwargs(cls, cfg, backbone))
    rec["build_seconds"] = round(time.perf_counter() - t0, 1)
    return tokenizer, backbone, model


def parameter_fields(method: str, cfg, cls, model, backbone, tokenizer, rec: dict) -> tuple[int, dict[str, int]]:
    """`rec`'s parameter counts, backbone shape and tokenizer, and the check of the trainable counts against the
    reference's figures (an AssertionError when they differ); the total and per-phase trainable counts."""
    n_all = sum(p.numel() for p in model.parameters())
    n_train = model.trainable_parameter_count()
    by_phase = {ph: sum(p.numel() for p in model.phase_parameters(ph)) for ph in cls.phases}
    rec.update(
        total_parameters=n_all,
        trainable_parameters=n_train,
        trainable_parameters_by_phase=by_phase,
        backbone_shape={
            "layers": backbone.config.num_hidden_layers,
            "hidden": backbone.config.hidden_size,
            "heads": backbone.config.num_attention_heads,
            "vocab": backbone.config.vocab_size,
        },
        tokenizer=getattr(tokenizer, "name_or_path", type(tokenizer).__name__),
    )
    # (trainable, prefix-phase trainable) parameters the reference gives for this configuration (None: no figure)
    figures = facts(method).dry_run_trainable
    expected = figures(cfg.backbone, cfg.model) if figures else (None, None)
    checks = []
    for label, exp, got in zip(("trainable", "prefix-phase trainable"), expected, (n_train, by_phase.get("prefix"))):
        if exp is not None and exp != got:
            raise AssertionError(f"{label} parameters {got:,} differ from reference {exp:,}")
        if exp is not None:
            checks.append(f"{label} {got:,} == reference {exp:,}")
    rec["parameter_check"] = "; ".join(checks) or "no DCPCSE reference prefixes figure for this configuration"
    return n_all, by_phase


def real_batch_rows(cfg, cls, tokenizer, rec: dict) -> tuple[TrainingRows, TrainingRows | None]:
    """Two real batches' worth of synthetic rows (2 steps = one epoch), with their corruption when the method
    corrupts (`rec` gets its figures), and the NLI rows when the preset needs them."""
    n_views = 3 if cfg.supervised else 2
    columns = SUP_COLUMNS if cfg.supervised else ("text",)
    tokens = token_rows(tokenizer, 2 * cfg.batch_size, cfg.max_length, columns, cfg.seed)
    corruption = None
    if cls.uses_corruption:
        corruption, rec["corruption"] = corruption_rows(cfg, tokens, n_views, tokenizer, cfg.seed)
    rows = TrainingRows(tokens, corruption, cfg.supervised, tokenizer.pad_token_id)
    nli_rows = None
    if cfg.needs_nli:
        n_nli = 2 * max(cfg.prefix_phase.batch_size if cfg.prefix_phase else 0, cfg.aux_nli_batch_size)
        nli_rows = TrainingRows(
            token_rows(tokenizer, n_nli, cfg.max_length, SUP_COLUMNS, cfg.seed + 1), None, True, tokenizer.pad_token_id
        )
    return rows, nli_rows


def head_rows(tr: TrainingRows, n: int) -> TrainingRows:
    """The first `n` rows of `tr` (tokens and corruption alike)."""
    return TrainingRows(
        TokenRows(tr.tokens.ids[:n], {c: s[:n] for c, s in tr.tokens.seqs.items()}),
        None
        if tr.corruption is None
        else CorruptionRows(
            tr.corruption.variants,
            {k: v[:n] for k, v in tr.corruption.corrupted.items()},
            {k: v[:n] for k, v in tr.corruption.labels.items()},
        ),
        len(tr.view_columns) == 3,
        tr.pad_id,
    )


def batch_independent_forward(model, rec: dict) -> tuple[float, float, int]:
    """The batch-independent forward and backward of a step (DiffAug: template denoising), timed on its own (warm):
    its wall seconds, CPU seconds and activation bytes (zeros for a model without one); `rec` gets them."""
    constant = (
        model.dry_run_batch_independent_forward() if hasattr(model, "dry_run_batch_independent_forward") else None
    )
    if constant is None:
        return 0.0, 0.0, 0
    model.train()
    release_freed_heap()
    before = rss()
    with PeakRSS() as peak:
        t0, c0 = time.perf_counter(), time.process_time()
        constant().backward()
        const_fwd_s, const_fwd_cpu = time.perf_counter() - t0, time.process_time() - c0
    const_fwd_bytes = max(0, peak.peak - before)
    model.zero_grad(set_to_none=True)
    rec["template_denoising"] = {
        "seconds": round(const_fwd_s, 2),
        "cpu_seconds": round(const_fwd_cpu, 2),
        "activation_mb": round(const_fwd_bytes / MB),
    }
    return const_fwd_s, const_fwd_cpu, const_fwd_bytes


def phase_record(
    ph: str,
    records: list[dict],
    info: dict,
    n_phase: int,
    n_all: int,
    constant: tuple[float, float, int] | None,
    cost: CostModel,
) -> dict:
    """One phase's measured steps and their projection to the real batch (time, CPU peak, GPU memory); the cost model
    learns from its warm step.

    Args:
        ph: the phase.
        records: the trainer's step records (every phase's).
        info: `describe_model`'s figures.
        n_phase: the phase's trainable parameters.
        n_all: all the model's parameters.
        constant: the batch-independent forward's (seconds, CPU seconds, bytes) when it belongs to this phase.
        cost: the cost model.
    """
    recs = [r for r in records if r["phase"] == ph]
    if not recs:
        raise RuntimeError(f"phase {ph!r} ran no step")
    warm = recs[-1]
    denoise, denoise_cpu, denoise_bytes = constant if constant and constant[0] else (0.0, 0.0, 0)
    const = warm["const_s"] + denoise
    const_cpu = warm["const_cpu_s"] + denoise_cpu
    # activations = peak RSS during the forward of the warm step - RSS before it (grads/AdamW states of the
    # previous step are already resident then; the backward's weight grads are batch-independent)
    act = max(0, warm["forward_peak_rss"] - warm["rss_before"] - denoise_bytes)
    ratio = info["real_rows_by_phase"][ph] / warm["rows"]
    gpu = 6 * n_all + 12 * n_phase + 0.5 * (act * ratio + denoise_bytes)
    cpu_peak = warm["rss_before"] + act * ratio + denoise_bytes
    cost.update(info, warm["rows"], ph, warm["cpu_seconds"] - const_cpu, act)
    if any(not math.isfinite(r["loss"]) for r in recs):
        raise FloatingPointError(f"phase {ph}: non-finite loss {[r['loss'] for r in recs]}")
    return {
        "steps": len(recs),
        "rows_measured": warm["rows"],
        "aux_rows_measured": warm["aux_rows"],
        "real_rows": info["real_rows_by_phase"][ph],
        "views": warm["views"],
        "length": warm["length"],
        "s_per_step_all": [round(r["seconds"], 2) for r in recs],
        "s_per_step_measured": round(warm["seconds"], 2),
        "cpu_s_per_step_all": [round(r["cpu_seconds"], 2) for r in recs],
        "cpu_s_per_step_measured": round(warm["cpu_seconds"], 2),
        "const_s": round(const, 2),
        "const_cpu_s": round(const_cpu, 2),
        "s_per_step_projected_real_batch": round(const + max(0.0, warm["seconds"] - const) * ratio, 1),
        "cpu_s_per_step_projected_real_batch": round(const_cpu + max(0.0, warm["cpu_seconds"] - const_cpu) * ratio, 1),
        "peak_rss_mb": round(max(r["peak_rss"] for r in recs) / MB),
        "activation_mb_measured": round(act / MB),
        "step_peak_delta_mb": round(max(0, warm["peak_rss"] - warm["rss_before"]) / MB),
        "projected_cpu_peak_gb_real_batch": round(cpu_peak / GB, 1),
        "projected_gpu_gb_real_batch_bf16": round(gpu / GB, 1),
        "losses": [r["loss"] for r in recs],
    }


def main_phase_fields(phases_out: dict[str, dict], main_phase: str) -> dict:
    """The record's headline fields: the main phase's measured and projected step, and the peaks over the phases."""
    main = phases_out[main_phase]
    return {
        "steps_run": sum(p["steps"] for p in phases_out.values()),
        "rows_per_step_measured": main["rows_measured"],
        "peak_cpu_mb": max(p["peak_rss_mb"] for p in phases_out.values()),
        "s_per_step_measured": main["s_per_step_measured"],
        "cpu_s_per_step_measured": main["cpu_s_per_step_measured"],
        "s_per_step_projected": main["s_per_step_projected_real_batch"],
        "cpu_s_per_step_projected": main["cpu_s_per_step_projected_real_batch"],
        "projected_gpu_gb": max(p["projected_gpu_gb_real_batch_bf16"] for p in phases_out.values()),
    }


_META_UNSUPPORTED = (
    "meta tensor",
    "meta tensors",
    "on meta",
    "data-dependent",
    "Cannot copy out of meta",
    "nonzero",
    "cannot be called on meta",
    "is not supported for meta",
    "NotImplementedError",
)


def meta_run(model, cfg, rows, nli_rows) -> str:
    """2 steps per phase at the real batch on the meta device: 'ok …', 'unsupported …' or 'FAILED …'."""
    meta = torch.device("meta")
    model.to(meta)
    try:
        trainer = run_trainer(model, stepped_config(cfg), rows, nli_rows, meta)
    except Exception as e:  # noqa: BLE001 - the failure is recorded with its frames in the project's code
        frames, root = traceback.extract_tb(e.__traceback__), str(REPO_ROOT)
        ours = lambda f: root in f.filename and "/benchmarks/" not in f.filename and "/.venv/" not in f.filename
        site, lib = ([f for f in frames if ours(f)] or frames)[-1], frames[-1]  # the project's frame, the raising one
        file = Path(site.filename).relative_to(REPO_ROOT) if root in site.filename else site.filename
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''} at {file}:{site.lineno}"
        if lib is not site:
            msg += f" (raised in {Path(lib.filename).name}:{lib.lineno})"
        text = f"{type(e).__name__}: {e}"
        if any(s.lower() in text.lower() for s in _META_UNSUPPORTED):
            return f"unsupported on meta ({msg})"
        traceback.print_exc()
        return f"FAILED ({msg})"
    shapes = ", ".join(
        f"{r['phase']} {r['rows']}×{r['views']}×{r['length']}" + (f"+aux {r['aux_rows']}" if r["aux_rows"] else "")
        for r in trainer.records
    )
    return f"ok ({len(trainer.records)} steps at the real batch: {shapes})"


# ---------------------------------------------------------------------------------------------- output
def selected_presets(args) -> list[tuple[str, str]]:
    methods = [m for m in args.methods.split(",") if m] or list(REGISTRY)
    unknown = [m for m in methods if m not in REGISTRY]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {list(REGISTRY)}")
    wanted = [p for p in args.presets.split(",") if p]
    out = []
    for m in methods:
        for name in REGISTRY[m].presets:
            named = name in wanted or f"{m}/{name}" in wanted
            if named or (not wanted and (args.include_smoke or not name.startswith("smoke"))):
                out.append((m, name))
    if not out:
        raise SystemExit("no preset selected")
    return out


def fmt_int(n) -> str:
    return f"{n:,}" if isinstance(n, int) else "–"


GPU_BUDGETS_GB = (24, 80)


def largest_chunk(rec: dict, budget_gb: float) -> str:
    """The largest power-of-two `grad_cache.chunk_size` (rows of the batch) at which the preset's projected GPU memory
    fits `budget_gb`, projected as the GPU column: the batch-independent part (6·N_all + 12·N_trainable, and
    DiffAug's template denoising) plus 0.5 × the measured activations per row × the chunk's rows. "full": the whole
    batch fits without the cache; "–": the batch-independent part alone does not fit. The binding phase decides."""
    answer = None  # None = every phase fits whole
    for p in rec.get("phases", {}).values():
        flat_measured = p["rows_measured"] * p["views"] + p.get("aux_rows_measured", 0) * 3
        if not flat_measured or p["projected_gpu_gb_real_batch_bf16"] <= budget_gb:
            continue
        ratio = p["real_rows"] / p["rows_measured"]
        per_row = 0.5 * p["activation_mb_measured"] * MB / GB / flat_measured
        fixed = p["projected_gpu_gb_real_batch_bf16"] - per_row * flat_measured * ratio
        rows = (budget_gb - fixed) / per_row if per_row > 0 else 0
        fits = 2 ** int(math.log2(rows)) if rows >= 1 else 0
        answer = fits if answer is None else min(answer, fits)
    if answer is None:
        return "full"
    return str(answer) if answer >= 1 else "–"


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        "# Paper-scale dry run (`benchmarks/dry_run.py`)",
        "",
        f"Command: `{meta['command']}`  ",
        f"Host: {meta['host']}; torch {meta['torch']} with {meta['threads']} thread(s); started {meta['started']}, "
        f"wall {meta.get('wall_seconds', '?')} s.",
        "",
        "Random-initialised models at the presets' real shapes; synthetic rows of the preset's maximum length (no "
        "padding); the real `cse.training.loop.Trainer`, fp32 on CPU. `rows/step measured` = sentence tuples per step of "
        "the CPU run (a micro batch unless `real` is marked); `steps` = optimiser steps run (DiffAug: 1 prefix + 1 joint). "
        "s/step measured = the last step of the phase, wall time and process CPU time (other jobs shared the 2 cores, "
        "so wall > CPU); projected = CPU time, linear in rows at the real batch on this CPU with `--threads` threads "
        "(batch-independent AdamW/clip/denoising time not scaled). GPU GB = 6·N_all + 12·N_trainable + 0.5·activations "
        "(forward peak RSS measured in fp32, scaled to the real batch) in bytes, bf16 autocast, CUDA context not "
        "included. `meta` = the same steps at the real batch on the meta device. DiffAug rows show the joint phase "
        "(prefix phase in the notes). `largest chunk` = the largest power-of-two `grad_cache.chunk_size` (rows of "
        "the batch, per rank) at which the preset fits 24 / 80 GB, projected the same way with the activations of a "
        "chunk instead of the batch (`full`: the whole batch fits without the cache; `–`: the weights and AdamW "
        "states alone do not fit).",
        "",
        "Caveats: projections from micro batches of 2–4 rows multiply measurement noise by the batch ratio (up to 256×). "
        "DiffAug's joint step is dominated by its batch-independent template denoising (~19 CPU s, timed separately "
        "and subtracted), so its batch-proportional part (1–3 CPU s at 2–4 rows) is within the noise of that "
        "subtraction: its joint-phase CPU s/step and GPU GB projections are unreliable (see the JSON "
        "`template_denoising` and `step_peak_delta_mb`).",
        "",
        "| method | preset | backbone | batch (real) | rows/step measured | steps | trainable params | peak CPU MB | "
        "s/step measured (wall / CPU) | CPU s/step projected (real batch) | projected GPU GB | "
        "largest chunk 24 / 80 GB | meta (real batch) | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for r in results:
        lines.append(table_row(r))
        notes += row_notes(r)
    if notes:
        lines += ["", "Notes:", ""] + notes
    return "\n".join(lines) + "\n"


def table_row(r: dict) -> str:
    """A preset's row of the dry run's table (dashes where a failed run has no figure)."""
    ok = r["status"] == "ok"
    rows = f"{r.get('rows_per_step_measured', '–')}" + (" (real)" if r.get("real_batch_run") else "")
    meta_s = r.get("meta", "–")
    cells = [
        r["method"],
        r["preset"],
        r.get("backbone", "–"),
        str(r.get("batch_size", "–")),
        rows,
        str(r.get("steps_run", "–")),
        fmt_int(r.get("trainable_parameters")),
        fmt_int(r.get("peak_cpu_mb")),
        f"{r['s_per_step_measured']} / {r['cpu_s_per_step_measured']}" if ok else "–",
        str(r.get("cpu_s_per_step_projected", "–")),
        str(r.get("projected_gpu_gb", "–")),
        " / ".join(largest_chunk(r, b) for b in GPU_BUDGETS_GB) if ok else "–",
        meta_s.split(" (")[0] if isinstance(meta_s, str) else "–",
        r["status"] if ok else "**FAILED**",
    ]
    return "| " + " | ".join(cells) + " |"


def row_notes(r: dict) -> list[str]:
    """The notes under the table of a preset: its prefix phase, a meta run that did not pass, a failure, and the
    check of its trainable parameters against the reference's figure."""
    notes = []
    meta_s = r.get("meta", "–")
    if "prefix" in r.get("phases", {}):
        p = r["phases"]["prefix"]
        notes.append(
            f"- {r['method']}/{r['preset']} prefix phase: batch {p['real_rows']} (measured {p['rows_measured']}), "
            f"trainable {fmt_int(r['trainable_parameters_by_phase']['prefix'])}, {p['s_per_step_measured']} / "
            f"{p['cpu_s_per_step_measured']} s/step measured (wall / CPU), "
            f"{p['cpu_s_per_step_projected_real_batch']} CPU s/step projected, "
            f"GPU {p['projected_gpu_gb_real_batch_bf16']} GB projected."
        )
    if isinstance(meta_s, str) and not meta_s.startswith("ok") and meta_s != "–":
        notes.append(f"- {r['method']}/{r['preset']} meta run: {meta_s}")
    if r["status"] != "ok":
        notes.append(f"- {r['method']}/{r['preset']} FAILED: {r.get('error', '')}")
    if r.get("parameter_check", "").startswith("trainable") or r.get("parameter_check", "").startswith("prefix"):
        notes.append(f"- {r['method']}/{r['preset']}: {r['parameter_check']}")
    return notes


def write_outputs(results: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "dry_run.json").write_text(json.dumps({"run": meta, "presets": results}, indent=2, default=str))
    (out / "dry_run.md").write_text(markdown(results, meta))


def failed_record(method: str, name: str, e: Exception) -> dict:
    """The record of a preset whose run raised `e` (called while it is handled): the error, the end of its
    traceback and, when the preset resolves, its backbone and batch size."""
    rec = {
        "method": method,
        "preset": name,
        "status": "FAILED",
        "error": f"{type(e).__name__}: {e}"[:2000],
        "traceback": traceback.format_exc()[-6000:],
    }
    with contextlib.suppress(Exception):
        cfg = resolve_train_config(name, method=method)
        rec.update(backbone=cfg.backbone, batch_size=cfg.batch_size)
    return rec


def main(args: argparse.Namespace) -> int:
    if args.from_json:
        saved = json.loads((args.out / "dry_run.json").read_text())
        (args.out / "dry_run.md").write_text(markdown(saved["presets"], saved["run"]))
        return 0
    torch.set_num_threads(args.threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    started = time.perf_counter()
    meta = {
        "command": command_line("benchmarks.dry_run"),
        "host": f"{platform.node()} ({psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / GB:.0f} GB RAM)",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "max_memory_gb": args.max_memory_gb,
        "step_budget_s": args.step_budget_s,
        "peak_rss_method": "VmHWM reset via /proc/self/clear_refs" if PeakRSS.use_hwm else "psutil sampling (2 ms)",
    }
    cost = CostModel()
    results: list[dict] = []
    failed = []
    for method, name in selected_presets(args):
        print(f"[dry-run] {method}/{name} …", file=sys.stderr, flush=True)
        try:
            rec = run_preset(method, name, args, cost)
        except Exception as e:  # noqa: BLE001 — report, continue, fail at the end
            traceback.print_exc()
            rec = failed_record(method, name, e)
            failed.append(f"{method}/{name}")
            release_freed_heap()
        results.append(rec)
        print(
            f"[dry-run] {method}/{name}: {rec['status']} "
            f"(micro batch {rec.get('micro_batch')}, {rec.get('s_per_step_measured')} / {rec.get('cpu_s_per_step_measured')} "
            f"s/step measured (wall / CPU), {rec.get('cpu_s_per_step_projected')} CPU s/step projected, "
            f"GPU {rec.get('projected_gpu_gb')} GB, "
            f"meta {str(rec.get('meta', '–'))[:60]}; {rec.get('seconds')} s)",
            file=sys.stderr,
            flush=True,
        )
        meta["wall_seconds"] = round(time.perf_counter() - started)
        write_outputs(results, meta, args.out)
    meta["wall_seconds"] = round(time.perf_counter() - started)
    meta["failed"] = failed
    write_outputs(results, meta, args.out)
    summary = {"wall_seconds": meta["wall_seconds"], "presets": len(results), "failed": failed}
    summary |= {"json": str(args.out / "dry_run.json"), "markdown": str(args.out / "dry_run.md")}
    print(json.dumps(summary, indent=2))
    if failed:
        print(f"[dry-run] FAILED presets: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(_ARGS))
