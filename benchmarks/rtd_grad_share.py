"""How large is the RTD term's gradient beside the contrastive one, in every CRTD preset, at its start?

    python -m benchmarks.rtd_grad_share [--rows 32] [--threads 1] [--presets d2cse/default,...]

For every preset of every registered method with a conditional discriminator (`ConditionalRTDModel`: D2CSE, DiffCSE),
built as benchmarks/dry_run.py builds it (the preset's backbone random-initialised from its config where no weights
are here: BERT-base/large, RoBERTa-base; the `smoke` presets on the packaged MiniLM, its real weights; the preset's
seed), `ConditionalRTDModel.rtd_grad_share` (the figure every training run logs at each evaluation) on one batch:
the first `--rows` sentences of the Wiki1M sample at length 32 (the preset's tokenizer; RoBERTa's offline id stand-in),
read as two dropout views, 30 % of each sentence's real tokens (not [CLS] / [SEP]) replaced by a uniformly drawn
ordinary id standing in for the generator (seeded). Per trainable group: ‖λ∇L_RTD‖ / ‖∇L_CL‖ at the preset's λ, and
‖λ∇L_RTD‖ where only the RTD loss reaches. At initialisation only: the ratio's order of magnitude is the point, not
its course over training. A supervised preset's batch is its anchor column read as two views (the probe's shape in a
training run), not its three-column objective. Writes benchmarks/results/rtd_grad_share.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import REPO_ROOT, SHARED_DATA, command_line, cpu_environment, set_offline_environment

OUT = REPO_ROOT / "benchmarks" / "results"
LENGTH, SHARE = 32, 0.3


def crtd_presets() -> list[tuple[str, str]]:
    """(method, preset) of every preset of the methods with a conditional discriminator, in registry order."""
    from cse.config.methods import REGISTRY
    from cse.config.presets import PRESETS
    from cse.models.methods.crtd import ConditionalRTDModel

    return [
        (spec.name, preset)
        for spec in REGISTRY.values()
        if issubclass(spec.model_class, ConditionalRTDModel)
        for preset in PRESETS[spec.name]
    ]


def batch(tokenizer, rows: int, seed: int):
    """`rows` Wiki1M-sample sentences at length `LENGTH` (padded), and their corruption by random ids."""
    import torch

    lines = (SHARED_DATA / "wiki1m_head.txt").read_text(encoding="utf-8").splitlines()[:rows]
    seqs = [s[: LENGTH - 1] for s in tokenizer(lines)["input_ids"]]
    seqs = [s if s[-1] == tokenizer.sep_token_id else [*s, tokenizer.sep_token_id] for s in seqs]
    ids = torch.full((rows, LENGTH), tokenizer.pad_token_id)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    mask = (torch.arange(LENGTH)[None] < torch.tensor([len(s) for s in seqs])[:, None]).long()
    g = torch.Generator().manual_seed(seed)
    inner = mask.bool() & (ids != tokenizer.cls_token_id) & (ids != tokenizer.sep_token_id)
    pick = inner & (torch.rand(ids.shape, generator=g) < SHARE)
    corrupted = torch.where(pick, torch.randint(1000, 20000, ids.shape, generator=g), ids)
    return ids, mask, corrupted


def measure(method: str, preset: str, rows: int) -> dict[str, Any]:
    import torch

    from benchmarks.dry_run import build_full_size
    from cse.config.methods import get_method
    from cse.config.training import resolve_train_config

    cfg = resolve_train_config(preset, method=method)
    t0 = time.perf_counter()
    tokenizer, backbone, model = build_full_size(cfg, get_method(method).model_class, {})
    ids, mask, corrupted = batch(tokenizer, rows, cfg.seed)
    t1 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    shares = model.rtd_grad_share(ids, mask, corrupted)
    return {
        "method": method,
        "preset": preset,
        "backbone": cfg.backbone,
        "weights": "packaged" if cfg.backbone.startswith("packaged:") else "random-init",
        "rtd_weight": cfg.model.rtd_weight,
        "rows": rows,
        "shares": shares,
        "seconds": {"build": round(t1 - t0, 1), "share": round(time.perf_counter() - t1, 1)},
    }


def markdown(records: list[dict[str, Any]], command: str) -> str:
    from cse.models.methods.crtd import GRAD_GROUPS

    keys = [
        f"{k}_{g}" for g in GRAD_GROUPS for k in ("share", "norm") if any(f"{k}_{g}" in r["shares"] for r in records)
    ]
    title = {k: (f"‖λ∇RTD‖ / ‖∇CL‖, {k[6:]}" if k.startswith("share") else f"‖λ∇RTD‖, {k[5:]}") for k in keys}
    lines = [
        "| preset | backbone | λ | " + " | ".join(title[k] for k in keys) + " | s |",
        "|---|---|---|" + "---|" * len(keys) + "---|",
    ]
    for r in records:
        cells = [f"{r['shares'][k]:.1e}" if k in r["shares"] else "–" for k in keys]
        weights = "" if r["weights"] == "packaged" else " (random-init)"
        lines.append(
            f"| `{r['method']}/{r['preset']}` | {r['backbone']}{weights} | {r['rtd_weight']:g} | "
            + " | ".join(cells)
            + f" | {r['seconds']['share']:.0f} |"
        )
    return "\n".join(["# RTD gradient share at initialisation", "", *lines, "", f"`{command}`", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--presets", default=None, help="comma-separated method/preset subset")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    set_offline_environment()
    import torch

    torch.set_num_threads(args.threads)
    wanted = None if args.presets is None else set(args.presets.split(","))
    records = []
    for method, preset in crtd_presets():
        if wanted is None or f"{method}/{preset}" in wanted:
            records.append(measure(method, preset, args.rows))
            print(json.dumps(records[-1]), flush=True)
    command = command_line("benchmarks.rtd_grad_share", argv).strip()
    report = {"benchmark": "rtd_grad_share", "records": records, "environment": cpu_environment(), "command": command}
    (args.out / "rtd_grad_share.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "rtd_grad_share.md").write_text(markdown(records, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
