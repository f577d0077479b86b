"""What the RTD probe of every evaluation (the h probe and the gradient share) costs beside the STS-B dev evaluation
it runs with.

    python -m benchmarks.rtd_probe_cost [--threads 1] [--home .cse/evidence-v2]

For every registered method with a conditional discriminator (`ConditionalRTDModel`), on the packaged MiniLM in fp32:
the seconds of one `rtd_h_probe` on the training job's fixed batch shape (64 rows of 32 tokens, 30 % of them
replaced; the mean of 3 calls after one warm-up), of one `rtd_grad_share` on the same batch (one training forward of
its two views and two gradients; the same averaging) and of one STS-B dev evaluation (1,500 pairs, batch 128), as the
training job runs them at every evaluation (training/job.py). Prints one line per method.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.machine import REPO_ROOT, set_offline_environment, sts_evaluator


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--home", type=Path, default=REPO_ROOT / ".cse" / "evidence-v2", help="CSE_HOME (the STS data)")
    args = p.parse_args(argv)
    os.environ["CSE_HOME"] = str(args.home.resolve())
    set_offline_environment()
    import torch

    from cse.config.methods import REGISTRY, build_model
    from cse.models.methods.crtd import ConditionalRTDModel

    torch.set_num_threads(args.threads)
    evaluator = sts_evaluator()
    for spec in REGISTRY.values():
        if not issubclass(spec.model_class, ConditionalRTDModel):
            continue
        torch.manual_seed(0)
        model = build_model(spec.name, {"backbone": "packaged:minilm"})
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1000, 20000, (64, 32), generator=g)
        ids[:, 0], ids[:, -1] = 101, 102
        replaced = torch.rand(64, 32, generator=g) < 0.3
        replaced[:, 0] = replaced[:, -1] = False
        corrupted = torch.where(replaced, torch.randint(1000, 20000, (64, 32), generator=g), ids)
        mask = torch.ones_like(ids)
        model.rtd_h_probe(ids, mask, corrupted)  # warm-up
        t0 = time.perf_counter()
        for _ in range(3):
            model.rtd_h_probe(ids, mask, corrupted)
        probe = (time.perf_counter() - t0) / 3
        model.rtd_grad_share(ids, mask, corrupted)  # warm-up
        t0 = time.perf_counter()
        for _ in range(3):
            model.rtd_grad_share(ids, mask, corrupted)
        share = (time.perf_counter() - t0) / 3
        t0 = time.perf_counter()
        evaluator.run(model, mode="dev", batch_size=128, precision="fp32")
        dev = time.perf_counter() - t0
        print(
            f"{spec.name}: h probe {probe:.2f} s, gradient share {share:.2f} s (64 rows x 32 tokens), STS-B dev "
            f"evaluation {dev:.1f} s, (probe + share) / evaluation {(probe + share) / dev:.3f} "
            f"(torch threads {args.threads})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
