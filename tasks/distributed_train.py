"""The torchrun entry point of a distributed training job: every rank runs `python -m cse.tasks.distributed_train
<run dir>/distributed/job.json` (training/distributed.py launches it, holds the protocol and trains the rank).

This module only adds the tracking: rank 0 logs params and per-step metrics into the job's MLflow run through
`cse.tracking.training_runs.rank_zero_callbacks` (an unreachable server spools into the job's folder; the launching task flushes).
"""

from __future__ import annotations

import sys
from pathlib import Path

from cse.config.training import TrainConfig
from cse.models import distributed
from cse.tracking.training_runs import rank_zero_callbacks
from cse.training.distributed import DistributedJob, rank_main
from cse.training.distributed import torchrun_command as _torchrun_command

WORKER_MODULE = "cse.tasks.distributed_train"  # what torchrun runs on every rank: this module


def torchrun_command(cfg: TrainConfig, job_file: Path, rdzv_id: str) -> list[str]:
    """This node's torchrun command, running this module on every rank."""
    return _torchrun_command(cfg, job_file, rdzv_id, worker_module=WORKER_MODULE)


def _main_callbacks(job: DistributedJob):
    phases = 2 if job.config.prefix_phase is not None else 1
    return rank_zero_callbacks(job.run_id, job.run_folder(), world_size=distributed.world(), phases=phases)


def main(argv: list[str] | None = None) -> int:
    """Run one rank of a distributed training job, with rank 0 logging to MLflow.

    Args:
        argv: the command-line arguments (the job file); `None` reads `sys.argv`.

    Returns:
        The process exit status.
    """
    return rank_main(argv, _main_callbacks)


if __name__ == "__main__":
    sys.exit(main())
