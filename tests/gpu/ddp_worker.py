"""One rank of the gpu tier's data-parallel check, started by torchrun as `-m tests.gpu.ddp_worker` from the checkout
root (tests/gpu/test_cuda.py): joins the process group through `cse.training.distributed.init_process_group` (NCCL on
CUDA, gloo on CPU), trains 2 steps of a tiny SimCSE with `cse.training.loop.Trainer` and, on rank 0, writes the losses
and the world size as JSON to argv[1]."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from benchmarks.gpu_check import build_model, job_phases, loop_config, preset, synthetic_rows, synthetic_tokenizer
from cse.training.distributed import init_process_group
from cse.training.loop import Trainer


def main(out: str, device_kind: str) -> None:
    cfg = preset("simcse", "tiny", batch=8, length=12).model_copy(update={"device": device_kind})
    device = init_process_group(cfg)
    tok = synthetic_tokenizer()
    model = build_model("simcse", cfg, "tiny", tok).to(device)
    rows, nli = synthetic_rows(cfg, "simcse", 16, tok)
    losses: list[float] = []
    with tempfile.TemporaryDirectory() as state:
        trainer = Trainer(
            model,
            job_phases(cfg, rows, nli, 2),
            loop_config(cfg, "fp32", 2),
            device,
            Path(state) / "s",
            lambda *a: None,
            lambda m: 0.0,
            lambda m, step: "loss" in m and losses.append(m["loss"]),
        )
        trainer.run()
    if dist.get_rank() == 0:
        Path(out).write_text(
            json.dumps(
                {"world": dist.get_world_size(), "backend": dist.get_backend(), "losses": losses, "device": str(device)}
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
