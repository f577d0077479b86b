"""Does training improve the encoder? Start vs trained STS Avg. per method, and SimCSE vs sentence-transformers.

    python -m benchmarks.learning [--methods simcse,simcse-sup,dcpcse,diffcse,d2cse,diffaug,peer]
        [--steps N] [--batch-size B] [--out benchmarks/results/learning.json]

CPU scale: the packaged MiniLM (all-MiniLM-L6-v2), the local Wiki1M sample (11,913 sentences) or the local NLI
sample (5,864 SNLI triplets), a few hundred steps; the whole script is sized for <= 60 min on 2 CPU cores. It is
not part of `make test`. The script is the check: it exits 1 when a method does not improve its starting point
or when our SimCSE and the sentence-transformers peer differ by more than 1.0 STS Avg. point.

What runs (the project's own pieces, no re-implementation):
- data: the ingestion, tokenisation and corruption stages (`cse.tasks.ingest.ingest_dataset`, `cse.tasks.tokenize.
  tokenize_dataset`, `cse.tasks.corrupt.plan_corruption` / `corrupt_shard` / `publish_corruption`, called through
  their Prefect tasks' `.fn`, so no Prefect server is needed) into a temporary `CSE_HOME` (MLflow's data-stage
  runs land in that temporary SQLite store); sources are read from `../shared/data` (never copied);
- configs: `cse.config.training.resolve_train_config(preset, overrides, method=...)` from each method's `smoke` preset
  (supervised SimCSE: its `sup` preset brought to MiniLM / CPU scale), with the overrides in the table below;
- training: `cse.training.job.fit` (the training stage's own function: `build_model`, `training_phases`, the real
  `cse.training.loop.Trainer`, STS-B dev selection every `eval_steps`, best checkpoint written by `save_checkpoint`),
  with plain callables instead of MLflow for params/metrics;
- evaluation: `cse.evaluation.evaluator.Evaluator` in `test` mode (the seven STS tasks, Avg. = mean of the seven
  Spearman x 100, rounded as the papers do), fp32, retrieval/alignment extras off.

"start" = the method's model as `cse.training.job.build_model` builds it at step 0 with `torch.manual_seed(seed)`,
evaluated with its own `embed` (its evaluation pooler: CLS before pooler for SimCSE-unsup/DiffCSE/D2CSE/DCPCSE-
unsup with the random initial prompts on, CLS -> the fresh MLP for supervised SimCSE, the template's [MASK] state
with the random initial prefixes for DiffAug). `fit` is called right after seeding again with the same seed, so it
builds the identical model (the script checks that two seeded builds have the same trainable tensors and
records their hash). "trained" = the best STS-B dev checkpoint (`cse.models.checkpoint.load_checkpoint` of the job's
`best/` folder), our default selection.

Per-run settings: the `learning_runs` of each method in benchmarks/facts.py (preset, steps, eval_steps, overrides and
a note on the learning rate, always the preset's own); batch 32 everywhere; `--steps` / `--batch-size` override all.
`max_train_sentences` is lifted (the whole sample; `epochs` is raised only where steps x batch exceed the rows).

Budget. Unloaded, 2 cores: a seven-task evaluation of MiniLM takes ~75 s and a MiniLM D2CSE step at batch 64 ~4.6 s,
so it was planned for a few hundred steps per method within 60 min; the per-run step counts are smaller because the
machine it ran on was shared (load average 6–8 on 2 cores: a SimCSE step took 3.7 s with 1 torch thread and 10.8–18.6
s with 2, OpenMP threads stalling when a core is taken away; a seven-task evaluation ~260 s). Hence `--threads 1` on a
shared machine, and the runs split over side-by-side processes (disjoint `--methods`, separate `--out`), joined with
`--merge a.json b.json ... --out benchmarks/results/learning.json` (the merged report keeps every process's command
and seconds, and the wall time). On an idle machine run it as one process and raise `--steps`. The committed
benchmarks/results/learning.json was made that way: one process per run (`--threads 1`), the peer check with `--steps
30` (the default SimCSE row beside it is the 80-step `simcse` run), start evaluations shared through `--start-cache`
where the probe matched.

Peer cross-check (`peer`): the same job three ways, on the same sentences in the same order (the batches are taken
from `Trainer.batch_at` of our run: `epoch_order(n, seed + 7919·phase, epoch)`), same batch, steps, learning rate
and seed:
- `simcse-peerlike`: our SimCSE configured like the peer: no training-time MLP (`model.train_mlp: false`, so the
  loss reads the raw CLS state, which is also what `embed` returns with `mlp_only_train`), final weights (no dev
  selection), through the real `Trainer`;
- `st-peer`: `sentence_transformers.SentenceTransformer([Transformer(MiniLM, max_seq_length 32), Pooling(cls)])`
  (no Normalize) trained with its `MultipleNegativesRankingLoss(scale=20 = 1/0.05)` on (s, s) pairs, fed our token
  ids (the same tokenizer, max length 32), AdamW (β 0.9/0.999, ε 1e-8, weight decay 0), linear decay to 0 without
  warm-up, gradient clipping 1.0, train mode (dropout on), fp32; evaluated with the same Evaluator through a
  `PooledEncoder(cls_before_pooler)` on its fine-tuned HF model (= ST CLS pooling of the same weights);
- `simcse` (the default run above: training-time MLP, best dev checkpoint) is printed beside both.
The two like-for-like STS Avg. (`simcse-peerlike` vs `st-peer`) must agree within 1.0.

Output: JSON (`--out`, default benchmarks/results/learning.json) and a markdown table beside it (`.md`); both
tables are printed at the end. Progress bars come from the trainer.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.facts import registry_facts
from benchmarks.machine import (
    REPO_ROOT,
    SHARED_DATA,
    command_line,
    cpu_environment,
    quiet_trainer,
    set_offline_environment,
    sts_evaluator,
)

set_offline_environment()

PEER_DIFF_LIMIT = 1.0
SEVEN = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")


def _runs() -> tuple[dict[str, dict[str, Any]], str]:
    """(run name → method, preset, per-run overrides, default steps, eval_steps and a note on the learning rate: the
    `learning_runs` of every registry method (benchmarks/facts.py); the run the peer check ("peer") reproduces: the
    `learning_peer_run`). The JSON's peer keys (`simcse_peerlike`, `simcse_default`) are the report format."""
    runs, peer = {}, ""
    for name, method_facts in registry_facts().items():
        for run, settings in method_facts.learning_runs.items():
            runs[run] = dict(method=name, **settings)
        peer = method_facts.learning_peer_run or peer
    return runs, peer


RUNS, PEER_RUN = _runs()
# The peer run's method first (its run, then the peer check), then the other runs in registry order.
_FIRST = [r for r in RUNS if RUNS[r]["method"] == RUNS[PEER_RUN]["method"]]
ALL = tuple(
    n for run in sorted(RUNS, key=lambda r: r not in _FIRST) for n in ((run, "peer") if run == PEER_RUN else (run,))
)


def _log(msg: str) -> None:
    print(f"[learning {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Bench:
    """The temporary data root, the prepared datasets and one Evaluator shared by every run."""

    def __init__(self, batch_size: int, start_cache: list[Path] | None = None):
        import torch

        from cse.config.stages import local_mirror_ingest
        from cse.storage.layout import DataRoot
        from cse.storage.settings import get_settings

        self.device = torch.device("cpu")
        self.batch_size = batch_size
        self.ingest = local_mirror_ingest(SHARED_DATA)
        self.root = DataRoot(get_settings().data_root)
        self._stages: dict[tuple, Any] = {}
        self._probe: list[str] | None = None
        self._starts: dict[tuple, dict[str, Any]] = {}
        self._start_cache = list(start_cache or ())
        t0 = time.perf_counter()
        self.evaluator = sts_evaluator()
        self.data_seconds = time.perf_counter() - t0

    def _read_start_cache(self) -> None:
        """Start evaluations of other processes' reports (read when needed: they may be written meanwhile)."""
        for f in self._start_cache:
            if not Path(f).is_file():
                continue
            rep = json.loads(Path(f).read_text())
            starts = [(r["run"], r["start"]) for r in rep.get("runs", [])]
            if rep.get("peer"):
                starts.append((f"{PEER_RUN}-peerlike", rep["peer"]["start"]))
            for run, st in starts:
                if st.get("probe") and "shared_with" not in st:
                    self._starts.setdefault(
                        (st.get("pooler"), st["probe"]),
                        {**{k: v for k, v in st.items() if k != "probe"}, "evaluated_for": f"{run} ({Path(f).name})"},
                    )

    # ------------------------------------------------------------------ data stages
    def _stage(self, key: tuple, run):
        """The output of a data stage, run (and timed into `data_seconds`) the first time `key` is asked for."""
        if key not in self._stages:
            t0 = time.perf_counter()
            self._stages[key] = run()
            self.data_seconds += time.perf_counter() - t0
        return self._stages[key]

    def tokens(self, dataset: str, cfg):
        from cse.tasks.ingest import ingest_dataset
        from cse.tasks.tokenize import tokenize_dataset

        tc = cfg.tokenize_config()
        run = lambda: tokenize_dataset.fn(ingest_dataset.fn(dataset, self.ingest), tc)
        return self._stage(("tokens", dataset, tc.model_dump_json()), run)

    def corruption(self, tokens, cfg):
        from cse.tasks.corrupt import corrupt_shard, plan_corruption, publish_corruption

        def run():
            plan = plan_corruption.fn(tokens.key, cfg.corrupt)
            shards = [] if plan.cached else [corrupt_shard.fn(plan, i) for i in range(plan.n_shards)]
            return publish_corruption.fn(plan, shards)

        return self._stage(("corruption", tokens.key, cfg.corrupt.model_dump_json()), run)

    def config(self, spec: dict[str, Any], steps: int):
        """The resolved TrainConfig of a run: the preset + CPU-scale overrides (epochs raised to cover the steps)."""
        from cse.config.training import resolve_train_config

        base = {
            "batch_size": self.batch_size,
            "max_steps": steps,
            "epochs": 1,
            "max_train_sentences": None,
            "eval_steps": spec["eval_steps"],
            "log_steps": 10,
            "system_metrics": False,
            "device": "cpu",
            "precision": "fp32",
            "ingest": self.ingest.model_dump(mode="json"),
            **spec["overrides"],
        }
        cfg = resolve_train_config(spec["preset"], base, method=spec["method"])
        rows = self.tokens(cfg.dataset, cfg).rows
        epochs = max(1, math.ceil(steps * cfg.batch_size / rows))
        if epochs != cfg.epochs:
            cfg = resolve_train_config(spec["preset"], {**base, "epochs": epochs}, method=spec["method"])
        return cfg

    def inputs(self, cfg):
        """(tokens, corruption, nli_tokens, rows, nli_rows) of a config, through the real stages and loaders."""
        from cse.models.loading import load_tokenizer
        from cse.training.job import load_training_rows

        tokens = self.tokens(cfg.dataset, cfg)
        corruption = self.corruption(tokens, cfg) if cfg.uses_corruption else None
        nli_tokens = None
        if cfg.needs_nli:
            nli_tokens = tokens if cfg.dataset == "nli" else self.tokens("nli", cfg)
        pad = load_tokenizer(cfg.backbone).pad_token_id
        rows, nli_rows = load_training_rows(cfg, self.root, tokens, corruption, nli_tokens, pad)
        return tokens, corruption, nli_tokens, rows, nli_rows

    # ------------------------------------------------------------------ evaluation
    def probe(self, model) -> str:
        """Hash of the model's embeddings (exact float32 bytes) of 256 test sentences spread over the seven tasks."""
        from cse.evaluation.encode import embed_sentences

        if self._probe is None:
            everything = self.evaluator.sentences("test", extras=False)
            self._probe = everything[:: max(1, len(everything) // 256)][:256]
        emb, _ = embed_sentences(model, self._probe, batch_size=128, precision="fp32")
        return hashlib.sha256(emb.numpy().tobytes()).hexdigest()[:16]

    def evaluate_start(self, model, cfg, name: str) -> dict[str, Any]:
        """The start evaluation, shared only between truly identical starting models: the same evaluation pooler
        and bit-identical embeddings of the 256 probe sentences (e.g. SimCSE-unsup, DiffCSE and the peers all
        start from the untouched MiniLM read at CLS before the pooler)."""
        key = (getattr(model, "evaluation_pooler", None), self.probe(model))
        self._read_start_cache()
        if key in self._starts:
            shared = dict(self._starts[key])
            shared["shared_with"] = shared.pop("evaluated_for", None)
            shared["seconds"] = 0.0  # not evaluated again
            shared["probe"] = key[1]
            return shared
        res = self.evaluate(model, cfg)
        self._starts[key] = {**res, "evaluated_for": name}
        return {**res, "probe": key[1]}

    def evaluate(self, model, cfg=None) -> dict[str, Any]:
        precision = getattr(cfg, "eval_precision", "fp32") if cfg is not None else "fp32"
        t0 = time.perf_counter()
        res = self.evaluator.run(model, mode="test", extras=False, batch_size=128, precision=precision)
        m = res.metrics()
        return {
            "sts_avg": float(m["sts_avg"]),
            "tasks": {t: round(float(m[t]), 2) for t in SEVEN},
            "seconds": round(time.perf_counter() - t0, 1),
            "pooler": getattr(model, "evaluation_pooler", None) or model.describe().get("pooler"),
        }


def state_hash(model) -> str:
    from cse.models.checkpoint import trainable_state_dict

    h = hashlib.sha256()
    for k, v in sorted(trainable_state_dict(model).items()):
        h.update(k.encode())
        h.update(v.float().numpy().tobytes())
    return h.hexdigest()[:16]


def seeded_build(cfg, device):
    import torch

    from cse.training.job import build_model

    torch.manual_seed(cfg.seed)
    return build_model(cfg, device)


def run_method(bench: Bench, name: str, steps: int) -> dict[str, Any]:
    """Start evaluation, `cse.training.job.fit`, evaluation of the best dev checkpoint."""
    from cse.models.checkpoint import load_checkpoint, read_checkpoint_meta
    from cse.storage.runs import RunDir
    from cse.training.job import run_key, training_phases

    spec = RUNS[name]
    cfg = bench.config(spec, steps)
    tokens, corruption, nli_tokens, rows, nli_rows = bench.inputs(cfg)
    total_steps = sum(p.total_steps for p in training_phases(cfg, rows, nli_rows))
    _log(f"{name}: {cfg.method}/{cfg.preset}, {total_steps} steps, batch {cfg.batch_size}, lr {cfg.learning_rate}")
    start, start_hash = evaluate_start(bench, cfg, name)
    run_dir = RunDir(cfg.method, "learning-" + run_key(cfg, tokens, corruption, nli_tokens))
    if run_dir.path.exists():
        shutil.rmtree(run_dir.path)
        run_dir = RunDir(cfg.method, run_dir.path.name)
    loop, params, dev, losses, train_s = fit_logged(bench, cfg, rows, nli_rows, run_dir)
    best = load_checkpoint(run_dir.best, device=bench.device)
    trained = bench.evaluate(best, cfg)
    meta = read_checkpoint_meta(run_dir.best)["meta"]
    del best
    _log(
        f"{name}: trained STS Avg. {trained['sts_avg']:.2f} (best dev {loop.best_score:.2f} at step {loop.best_step}; "
        f"train {train_s:.0f} s)"
    )
    return {
        "run": name,
        "method": cfg.method,
        "preset": cfg.preset,
        "dataset": cfg.dataset,
        "overrides": run_overrides(spec, cfg),
        "steps": loop.steps,
        "batch_size": cfg.batch_size,
        "learning_rate": cfg.learning_rate,
        "prefix_phase": cfg.prefix_phase.model_dump() if cfg.prefix_phase else None,
        "lr_note": spec["lr_note"],
        "seed": cfg.seed,
        "eval_steps": cfg.eval_steps,
        "train_rows": len(rows),
        "corruption": cfg.corrupt.model_dump() if cfg.uses_corruption else None,
        "corruption_reuse": params.get("corruption_reuse"),
        "trainable_parameters": params.get("trainable_parameters"),
        "selection": "best STS-B dev checkpoint",
        "best_step": loop.best_step,
        "best_stsb_dev": loop.best_score,
        "checkpoint_step": meta.get("step"),
        "dev_curve": dev,
        "loss_curve": losses,
        "start_state_hash": start_hash,
        "start": start,
        "trained": trained,
        "delta": round(trained["sts_avg"] - start["sts_avg"], 2),
        "seconds": {"train": round(train_s, 1), "eval_start": start["seconds"], "eval_trained": trained["seconds"]},
        "improved": trained["sts_avg"] > start["sts_avg"],
        "config": cfg.model_dump(mode="json"),
    }


def run_overrides(spec: dict[str, Any], cfg) -> dict[str, Any]:
    """What a run sets over its preset: the run's own overrides and the benchmark's batch, steps, epochs and dev
    evaluation (every training sentence)."""
    return {
        **spec["overrides"],
        "batch_size": cfg.batch_size,
        "max_steps": cfg.max_steps,
        "epochs": cfg.epochs,
        "max_train_sentences": None,
        "eval_steps": cfg.eval_steps,
    }


def evaluate_start(bench: Bench, cfg, name: str, built_hash: str | None = None) -> tuple[dict[str, Any], str]:
    """The start model's scores and weights' hash, after checking that another build of the seed is the same model
    (the start is then the trained model's start): a second build, or the one whose weights' hash is `built_hash`."""
    start_model = seeded_build(cfg, bench.device)
    start_hash = state_hash(start_model)
    start = bench.evaluate_start(start_model, cfg, name)
    del start_model
    if (built_hash or state_hash(seeded_build(cfg, bench.device))) != start_hash:
        raise RuntimeError(f"{name}: two builds with seed {cfg.seed} differ: the start model would not be fit's model")
    _log(f"{name}: start STS Avg. {start['sts_avg']:.2f} ({start['seconds']:.0f} s)")
    return start, start_hash


def fit_logged(bench: Bench, cfg, rows, nli_rows, run_dir) -> tuple[Any, dict[str, Any], list, list, float]:
    """`cse.training.job.fit` at fp32 into `run_dir`: its loop, the parameters it logged, the STS-B dev and loss
    curves, and the training seconds."""
    import torch

    from cse.training.job import fit

    params: dict[str, Any] = {}
    dev: list[tuple[int, float]] = []
    losses: list[tuple[int, float]] = []

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        if "stsb_dev" in metrics:
            dev.append((step, round(float(metrics["stsb_dev"]), 2)))
        if "loss" in metrics:
            losses.append((step, round(float(metrics["loss"]), 4)))

    torch.manual_seed(cfg.seed)  # fit builds the model first: the same init as the start model
    t0 = time.perf_counter()
    loop = fit(
        cfg,
        rows,
        nli_rows,
        run_dir,
        "learning-benchmark",
        bench.device,
        "fp32",
        bench.evaluator,
        params.update,
        log_metrics,
    )
    return loop, params, dev, losses, time.perf_counter() - t0


def run_peer(bench: Bench, steps: int, default_simcse: dict[str, Any] | None) -> dict[str, Any]:
    """Our SimCSE configured like the peer (no training-time MLP, final weights) beside sentence-transformers."""
    spec = {**RUNS[PEER_RUN], "eval_steps": 10**9}
    cfg = bench.config(spec, steps)
    _, _, _, rows, _ = bench.inputs(cfg)
    out: dict[str, Any] = {
        "steps": steps,
        "batch_size": cfg.batch_size,
        "learning_rate": cfg.learning_rate,
        "seed": cfg.seed,
        "temperature": cfg.model.temperature,
        "scale": 1.0 / cfg.model.temperature,
    }
    # ours, like the peer: no training-time MLP (the start is evaluated at the end, on a fresh seeded build)
    cfg = cfg.model_copy(update={"model": dataclasses.replace(cfg.model, train_mlp=False)})
    batches, order_hash, start_hash, ours, ours_s = train_peerlike(bench, cfg, rows)
    peer, st_s, st_losses = train_st_peer(bench, cfg, batches)
    start, _ = evaluate_start(bench, cfg, f"{PEER_RUN}-peerlike", built_hash=start_hash)
    diff = round(ours["sts_avg"] - peer["sts_avg"], 2)
    out.update(
        {
            "batches_hash": order_hash,
            "start": start,
            "simcse_peerlike": {
                "trained": ours,
                "seconds": {"train": round(ours_s, 1)},
                "selection": "final weights",
                "training_mlp": False,
                "delta": round(ours["sts_avg"] - start["sts_avg"], 2),
            },
            "st_peer": {
                "trained": peer,
                "seconds": {"train": round(st_s, 1)},
                "selection": "final weights",
                "loss": "MultipleNegativesRankingLoss(scale=20) on (s, s)",
                "loss_curve": st_losses,
                "delta": round(peer["sts_avg"] - start["sts_avg"], 2),
            },
            "difference": diff,
            "limit": PEER_DIFF_LIMIT,
            "agree": abs(diff) <= PEER_DIFF_LIMIT,
        }
    )
    if default_simcse is not None:
        out["simcse_default"] = default_summary(default_simcse)
    return out


def train_peerlike(bench: Bench, cfg, rows) -> tuple[list, str, str, dict[str, Any], float]:
    """Our SimCSE without its training-time MLP, trained by the job's loop at fp32 and evaluated: its batches (the
    peer trains on the same), their hash, the start weights' hash, the trained scores and the training seconds."""
    from benchmarks.gpu_check import loop_config
    from cse.training.job import training_phases

    model = seeded_build(cfg, bench.device)
    start_hash = state_hash(model)
    loop = loop_config(cfg, "fp32", cfg.max_steps, log_steps=cfg.log_steps)  # no dev evaluation, a log every 10 steps
    state = Path(tempfile.mkdtemp(prefix="peerlike-state-"))
    trainer = quiet_trainer(model, training_phases(cfg, rows, None), loop, bench.device, state)
    batches = [trainer.batch_at(s)[0] for s in range(trainer.total_steps)]
    order_hash = hashlib.sha256(b"".join(b.input_ids.numpy().tobytes() for b in batches)).hexdigest()[:16]
    _log(f"peer: {PEER_RUN}-peerlike, {trainer.total_steps} steps (batches hash {order_hash})")
    t0 = time.perf_counter()
    trainer.run()
    ours_s = time.perf_counter() - t0
    ours = bench.evaluate(model, cfg)
    shutil.rmtree(state, ignore_errors=True)
    del model, trainer
    _log(f"peer: {PEER_RUN}-peerlike trained STS Avg. {ours['sts_avg']:.2f} ({ours_s:.0f} s)")
    return batches, order_hash, start_hash, ours, ours_s


def train_st_peer(bench: Bench, cfg, batches: list) -> tuple[dict[str, Any], float, list[tuple[int, float]]]:
    """sentence-transformers' MNRL on the same batches (CLS pooling, AdamW, linear decay, clip 1.0), evaluated: the
    scores, the training seconds and the loss every 10 steps."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from tqdm.auto import tqdm

    from cse.models.embedder import PooledEncoder
    from cse.models.loading import PACKAGED_MINILM, load_tokenizer, resolve_model_path

    torch.manual_seed(cfg.seed)
    tr = Transformer(resolve_model_path(PACKAGED_MINILM), max_seq_length=cfg.max_length)
    dim = tr.get_embedding_dimension() if hasattr(tr, "get_embedding_dimension") else tr.get_word_embedding_dimension()
    st = SentenceTransformer(modules=[tr, Pooling(dim, pooling_mode="cls")], device="cpu")
    loss_fn = MultipleNegativesRankingLoss(st, scale=1.0 / cfg.model.temperature)
    params = [p for p in st.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    n = len(batches)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / n))
    st.train()
    st_losses = []
    t0 = time.perf_counter()
    for step, b in enumerate(tqdm(batches, desc="st-peer", unit="step")):
        ids, mask = b.input_ids[:, 0], b.attention_mask[:, 0]
        feats = [{"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)} for _ in range(2)]
        loss = loss_fn(feats, None)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if (step + 1) % 10 == 0 or step + 1 == n:
            st_losses.append((step + 1, round(float(loss.detach()), 4)))
    st_s = time.perf_counter() - t0
    st.eval()
    enc = PooledEncoder(
        tr.auto_model,
        "cls_before_pooler",
        tokenizer=load_tokenizer(PACKAGED_MINILM),
        name="sentence-transformers MNRL (CLS pooling)",
    )
    peer = bench.evaluate(enc, cfg)
    peer["pooler"] = "cls (ST Pooling) = cls_before_pooler"
    del st, enc, tr
    _log(f"peer: st-peer trained STS Avg. {peer['sts_avg']:.2f} ({st_s:.0f} s)")
    return peer, st_s, st_losses


def default_summary(run: dict[str, Any]) -> dict[str, Any]:
    """The peer table's row of the default SimCSE run (training-time MLP, best dev checkpoint)."""
    return {k: run[k] for k in ("trained", "steps", "selection", "best_step")} | {"training_mlp": True}


# ---------------------------------------------------------------------------------------------- tables
def method_table(results: list[dict[str, Any]]) -> str:
    head = (
        "| run | preset | data | steps | batch | lr | start | trained | Δ | best step | train s | eval s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in results:
        steps = str(r["steps"])
        if r.get("prefix_phase"):
            pp = r["prefix_phase"]
            steps = f"{pp['steps']}+{r['steps'] - pp['steps']}"
        lr = f"{r['learning_rate']:g}" + (
            f" (stage 1 {r['prefix_phase']['learning_rate']:g})" if r.get("prefix_phase") else ""
        )
        data = {"wiki1m": "Wiki1M sample", "nli": "NLI sample"}[r["dataset"]] + (
            " (+NLI)" if r.get("prefix_phase") else ""
        )
        lines.append(
            f"| {r['run']} | {r['method']}/{r['preset']} | {data} | {steps} | {r['batch_size']} | {lr} | "
            f"{r['start']['sts_avg']:.2f} | {r['trained']['sts_avg']:.2f} | {r['delta']:+.2f} | {r['best_step']} | "
            f"{r['seconds']['train']:.0f} | {r['seconds']['eval_start'] + r['seconds']['eval_trained']:.0f} |"
        )
    return "\n".join(lines)


def task_table(results: list[dict[str, Any]]) -> str:
    lines = ["| run | model | " + " | ".join(t.upper() for t in SEVEN) + " | Avg. |", "|---|---|" + "---|" * 8]
    for r in results:
        for which in ("start", "trained"):
            e = r[which]
            lines.append(
                f"| {r['run']} | {which} | "
                + " | ".join(f"{e['tasks'][t]:.2f}" for t in SEVEN)
                + f" | {e['sts_avg']:.2f} |"
            )
    return "\n".join(lines)


def peer_table(p: dict[str, Any]) -> str:
    lines = [
        "| model | training MLP | selection | steps | STS Avg. | Δ vs start | train s |",
        "|---|---|---|---|---|---|---|",
        f"| MiniLM CLS (start) | – | – | 0 | {p['start']['sts_avg']:.2f} | – | – |",
        f"| ours, peer-like | no | final | {p['steps']} | {p['simcse_peerlike']['trained']['sts_avg']:.2f} | "
        f"{p['simcse_peerlike']['delta']:+.2f} | {p['simcse_peerlike']['seconds']['train']:.0f} |",
        f"| sentence-transformers MNRL | no | final | {p['steps']} | {p['st_peer']['trained']['sts_avg']:.2f} | "
        f"{p['st_peer']['delta']:+.2f} | {p['st_peer']['seconds']['train']:.0f} |",
    ]
    if "simcse_default" in p:
        d = p["simcse_default"]
        lines.append(
            f"| ours, default | yes | best dev (step {d['best_step']}) | {d['steps']} | {d['trained']['sts_avg']:.2f} | "
            f"{d['trained']['sts_avg'] - p['start']['sts_avg']:+.2f} | – |"
        )
    lines.append(
        f"\nours (peer-like) − sentence-transformers = {p['difference']:+.2f} (limit ±{p['limit']:.1f}): "
        + ("agree" if p["agree"] else "DISAGREE")
    )
    return "\n".join(lines)


def write_report(args, argv, env, data_seconds, results, peer, total: float, complete: bool) -> tuple[str, list[str]]:
    """JSON + markdown (written after every run, so an interrupted benchmark leaves its finished runs)."""
    failures = [
        f"{r['run']}: trained {r['trained']['sts_avg']:.2f} <= start {r['start']['sts_avg']:.2f}"
        for r in results
        if not r["improved"]
    ]
    if peer is not None and not peer["agree"]:
        failures.append(f"peer: |{peer['difference']:+.2f}| > {PEER_DIFF_LIMIT}")
    command = command_line("benchmarks.learning", argv)
    report = {
        "benchmark": "learning",
        "command": command.strip(),
        "complete": complete,
        "environment": env,
        "batch_size": args.batch_size,
        "data_seconds": round(data_seconds, 1),
        "total_seconds": round(total, 1),
        "runs": results,
        "peer": peer,
        "failures": failures,
        "passed": complete and not failures,
        "data": {
            "wiki1m": str(SHARED_DATA / "wiki1m_head.txt"),
            "nli": str(SHARED_DATA / "snli_triplets.csv"),
            "sts": str(SHARED_DATA / "senteval"),
        },
    }
    md = [
        f"# Learning benchmark (CPU, {env['torch_threads']} torch threads, {env['cpu']})",
        "",
        f"`{report['command']}`: total {total / 60:.1f} min"
        + f" (data stages {data_seconds:.0f} s)"
        + ("" if complete else " — INCOMPLETE (interrupted or still running)"),
        "",
    ]
    if results:
        md += [
            "## Start vs trained STS Avg. (7 tasks, Spearman × 100; trained = best STS-B dev checkpoint)",
            "",
            method_table(results),
            "",
            "### Per task",
            "",
            task_table(results),
        ]
    if peer is not None:
        md += [
            "",
            "## SimCSE vs sentence-transformers (same sentences, order, batch, steps, lr, seed)",
            "",
            peer_table(peer),
        ]
    md += ["", ("PASS" if not failures else "FAIL: " + "; ".join(failures)) if complete else "(incomplete)"]
    text = "\n".join(md) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(text)
    return text, failures


def merge(args, argv) -> int:
    """One report from several processes' JSON files (runs of disjoint `--methods`, e.g. started side by side on a
    shared machine): runs in the canonical order, the peer check from the file that has it, each process's
    command and seconds, and the wall time from the earliest start to the latest end (file mtime − its seconds)."""
    parts = [(Path(f), json.loads(Path(f).read_text())) for f in args.merge]
    by_run: dict[str, dict[str, Any]] = {}
    peer = None
    for path, rep in parts:
        for r in rep["runs"]:
            if r["run"] in by_run:
                raise SystemExit(f"run {r['run']} appears in two files ({path})")
            by_run[r["run"]] = r
        if rep.get("peer") is not None:
            if peer is not None:
                raise SystemExit(f"two files hold the peer check ({path})")
            peer = rep["peer"]
    if peer is not None and "simcse_default" not in peer and PEER_RUN in by_run:
        peer["simcse_default"] = default_summary(by_run[PEER_RUN])
    results = [by_run[n] for n in ALL if n in by_run]
    ends = [path.stat().st_mtime for path, _ in parts]
    starts = [path.stat().st_mtime - rep["total_seconds"] for path, rep in parts]
    wall = max(ends) - min(starts)
    env = dict(parts[0][1]["environment"])
    processes = [
        {
            "file": str(path),
            "command": rep["command"],
            "total_seconds": rep["total_seconds"],
            "runs": [r["run"] for r in rep["runs"]] + (["peer"] if rep.get("peer") else []),
            "data_seconds": rep.get("data_seconds"),
            "torch_threads": rep["environment"]["torch_threads"],
        }
        for path, rep in parts
    ]
    missing = [n for n in ALL if n not in by_run and not (n == "peer" and peer is not None)]

    data_seconds = sum(p["data_seconds"] or 0.0 for p in processes)
    text, failures = write_report(args, argv, env, data_seconds, results, peer, wall, complete=not missing)
    report = json.loads(args.out.read_text())
    report.update(
        {
            "merged_from": processes,
            "wall_seconds": round(wall, 1),
            "missing": missing,
            "cpu_seconds_sum_of_processes": round(sum(p["total_seconds"] for p in processes), 1),
        }
    )
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    text += "\n## Processes (run side by side, 1 torch thread each)\n\n| file | command | runs | seconds |\n|---|---|---|---|\n"
    text += "\n".join(
        f"| {Path(p['file']).name} | `{p['command']}` | {', '.join(p['runs'])} | {p['total_seconds']:.0f} |"
        for p in processes
    )
    text += f"\n\nwall time {wall / 60:.1f} min (earliest start to latest end)"
    text += (f"; missing: {missing}" if missing else "") + "\n"
    args.out.with_suffix(".md").write_text(text)
    print("\n" + text)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 1 if failures or missing else 0


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The command line and the runs it names (checked unless it merges)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(ALL), help=f"comma-separated subset of {','.join(ALL)}")
    p.add_argument("--steps", type=int, default=None, help="steps of every run (default: per run, see the docstring)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "learning.json")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's own, = the cores); 1 is far faster on a shared machine",
    )
    p.add_argument("--keep-home", action="store_true", help="keep the temporary CSE_HOME (runs, data) and print it")
    p.add_argument(
        "--start-cache",
        nargs="+",
        type=Path,
        default=None,
        metavar="JSON",
        help="reuse start evaluations from these reports when a start model is bit-identical on the probe",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        metavar="JSON",
        help="write one report (--out) from the JSON files of several runs of this script, then exit",
    )
    args = p.parse_args(argv)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.merge and (unknown := sorted(set(names) - set(ALL))):
        p.error(f"unknown --methods {unknown}; known: {list(ALL)}")
    if not args.merge and args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    return args, names


def main(argv: list[str] | None = None) -> int:
    args, names = parse_args(argv)
    if args.merge:
        return merge(args, argv)
    home = Path(tempfile.mkdtemp(prefix="cse-learning-"))
    os.environ["CSE_HOME"] = str(home)  # before cse.storage.settings is read
    for k in ("CSE_DATA_ROOT", "MLFLOW_TRACKING_URI", "CSE_MLFLOW_ARTIFACTS"):
        os.environ.pop(k, None)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    import sentence_transformers

    env = cpu_environment(sentence_transformers=sentence_transformers.__version__)
    env["threads_flag"] = args.threads
    _log(f"CSE_HOME {home}; torch threads {env['torch_threads']}; cpu {env['cpu']}")
    results, peer = [], None
    try:
        bench = Bench(args.batch_size, args.start_cache)
        for name in names:  # in the given order (default: SimCSE and its peer check first)
            if name == "peer":
                default = next((r for r in results if r["run"] == PEER_RUN), None)
                steps = args.steps or (default["steps"] if default else RUNS[PEER_RUN]["steps"])
                peer = run_peer(bench, steps, default)
            else:
                results.append(run_method(bench, name, args.steps or RUNS[name]["steps"]))
            write_report(args, argv, env, bench.data_seconds, results, peer, time.perf_counter() - t_all, False)
    finally:
        if args.keep_home:
            _log(f"kept CSE_HOME {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    total = time.perf_counter() - t_all
    text, failures = write_report(args, argv, env, bench.data_seconds, results, peer, total, complete=True)
    print("\n" + text)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
