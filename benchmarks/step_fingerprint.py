"""The training step's fingerprint: each method's `default` preset on a tiny random BERT, CPU fp32, fixed seeds,
3 optimiser steps through `cse.training.job.fit` (a prefix phase, DiffAug's, 3 steps first), writing every logged figure
but the timing ones and, at each dev evaluation, the abs-sum of every trainable parameter (as `repr` floats) to JSON.

A reorganisation that keeps the batches and gradients leaves the file byte-identical: run it on two commits with the
same thread count and compare (the figures differ at 1e-6 across thread counts and CPUs, so the file is a comparison
between two trees on one machine, not a record):

    python -m benchmarks.step_fingerprint --out /tmp/after.json
    git stash; python -m benchmarks.step_fingerprint --out /tmp/before.json; git stash pop
    cmp /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

# timing and memory figures differ run to run; every other logged figure must be byte-identical
TIMING = {"host_wait_share", "peak_memory_gb", "sentences_per_s", "tokens_per_s", "step_time_s", "step_ms"}


def token_rows(n_columns: int, variants: int | None, n: int = 16, seed: int = 0) -> Any:
    """`n` rows of random ids (3–8 tokens between [CLS] and [SEP]) in `n_columns` columns, each corrupted at one
    random position in each of `variants` variants (none: no corruption)."""
    from cse.storage.training_data import CorruptionRows, TokenRows
    from cse.training.rows import TrainingRows

    rng = np.random.default_rng(seed)
    cols = ("sent0", "sent1", "hard_neg")[:n_columns] if n_columns > 1 else ("text",)
    seqs = {
        c: [np.array([101, *rng.integers(1000, 5000, size=int(rng.integers(3, 9))), 102]) for _ in range(n)]
        for c in cols
    }
    corrupted: dict[tuple[str, int], list[np.ndarray]] = {}
    labels: dict[tuple[str, int], list[np.ndarray]] = {}
    for c in cols:
        for v in range(variants or 0):
            corrupted[(c, v)], labels[(c, v)] = [], []
            for s in seqs[c]:
                s2, lab, j = s.copy(), np.zeros(len(s), dtype=np.int8), 1 + int(rng.integers(0, len(s) - 2))
                s2[j], lab[j] = int(rng.integers(1000, 5000)), 1
                corrupted[(c, v)].append(s2)
                labels[(c, v)].append(lab)
    corruption = CorruptionRows(variants, corrupted, labels) if variants else None
    return TrainingRows(TokenRows(ids=np.arange(n), seqs=seqs), corruption, supervised=n_columns > 1, pad_id=0)


def fingerprint(methods: list[str], work: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each of `methods` trained 3 steps in `work` (its CSE_HOME): the logged figures and the parameter sums
    (`overrides`: more job settings, e.g. `{"speed": {...}}`; the fingerprint itself takes none)."""
    from transformers import BertConfig, BertModel

    from cse.models.loading import PACKAGED_MINILM, load_tokenizer

    tok = load_tokenizer(PACKAGED_MINILM)
    bert = work / "tiny_bert"
    torch.manual_seed(0)
    shape = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    # 512 positions: DiffAug's template denoising reaches position 152
    BertModel(BertConfig(vocab_size=len(tok), max_position_embeddings=512, **shape)).save_pretrained(bert)
    tok.save_pretrained(bert)
    return {method: train_three_steps(method, bert, overrides) for method in methods}


def train_three_steps(method: str, bert: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """`method`'s default preset on the tiny BERT at `bert`, 3 steps: its logged figures and parameter sums
    (`overrides`: more job settings)."""
    from cse.config.methods import model_class
    from cse.config.training import resolve_train_config
    from cse.storage.runs import RunDir
    from cse.training.job import fit

    over: dict[str, Any] = {"backbone": str(bert), "max_steps": 3, "eval_steps": 3, "batch_size": 4}
    over |= {"log_steps": 1, "precision": "fp32", "eval_precision": "fp32", **(overrides or {})}
    cfg = resolve_train_config("default", over, method=method)
    if cfg.prefix_phase is not None:  # a prefix phase first (DiffAug's NLI): 3 steps too, at the test batch size
        cfg = resolve_train_config("default", {**over, "prefix_phase": {"steps": 3, "batch_size": 4}}, method=method)
    variants = cfg.corrupt.variants if model_class(method).uses_corruption else None
    main = token_rows(3 if cfg.supervised else 1, variants)
    nli = token_rows(3, variants, seed=1) if cfg.prefix_phase is not None else None
    logged: list[dict[str, Any]] = []
    sums: list[dict[str, str]] = []

    class Dev:  # the dev evaluation: records the parameters' abs-sums, scores 50
        def run(self, model: torch.nn.Module, mode: str, batch_size: int, precision: str) -> Any:
            sums.append(
                {n: repr(float(p.detach().abs().sum())) for n, p in model.named_parameters() if p.requires_grad}
            )
            return type("Result", (), {"metrics": staticmethod(lambda: {"stsb_dev": 50.0})})()

    def log_metrics(metrics: dict[str, Any], step: int) -> None:
        kept = {k: repr(float(v)) for k, v in sorted(metrics.items()) if isinstance(v, int | float) and k not in TIMING}
        logged.append({"step": step, **kept})

    fit(
        cfg,
        main,
        nli,
        RunDir(method, f"fingerprint-{method}"),
        "run",
        torch.device("cpu"),
        "fp32",
        Dev(),
        lambda p: None,
        log_metrics,
    )
    return {"logged": logged, "param_abs_sums": sums}


def main(argv: list[str] | None = None) -> None:
    from cse.config.presets import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--methods", default=",".join(sorted(PRESETS)), help="comma-separated (default: every method)")
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads (compare at the same count)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as work:
        os.environ["CSE_HOME"] = str(Path(work) / "home")
        found = fingerprint(args.methods.split(","), Path(work))
    args.out.write_text(json.dumps(found, indent=1, sort_keys=True))
    print(f"{args.out}: " + ", ".join(f"{m} {len(r['logged'])} logs" for m, r in found.items()))


if __name__ == "__main__":
    main()
