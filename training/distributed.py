r"""A training job on several processes: what the `train` task launches when `nproc_per_node × nnodes` > 1, and
what each rank that torchrun starts does.

`launch` writes the job's `RunDir.distributed_job` (`<run dir>/distributed/job.json`: the resolved TrainConfig, the
dataset refs, the MLflow run id, the resolved precision and `stop_after`) and runs, on its own node,

    python -m torch.distributed.run --standalone --nproc-per-node N -m <worker module> <run dir>/distributed/job.json

(`torchrun --standalone --nproc-per-node N -m <worker module> <job.json>` is the same command; the worker module
is the caller's torchrun entry point, tasks/distributed_train.py). A multi-node job (`nnodes` > 1) uses a c10d
rendezvous at `$CSE_RDZV_ENDPOINT` (host:port, reachable from every node) instead of `--standalone`:

    torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id <run key> \
        -m <worker module> <run dir>/distributed/job.json

The task starts it on its node and logs the command; the other nodes must run the same command (the data root
and `CSE_HOME` must be on a filesystem every node sees: the ranks read the rows and the resume state there).

Every rank (`rank_main`) joins the process group (NCCL on GPU, one GPU per rank = `LOCAL_RANK`; gloo on CPU), loads
the rows, builds the model and runs `cse.training.job.fit`, i.e. the Trainer on its slice of each global batch
(models/distributed.py: the step equals the single-process step on the whole batch). Rank 0 alone evaluates on
STS-B dev, saves the best checkpoint and the resume state, and logs params/metrics through the callbacks the entry
point injects (the job's MLflow run stays open in, and is ended by, the launching task). At the end rank 0 writes
`RunDir.distributed_result` (the loop result, or that `stop_after` interrupted the run); `launch` reads it and the
task goes on with test evaluation, artifacts and export as for a single-process job.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel

from cse.config.training import TrainConfig
from cse.models import distributed
from cse.storage.atomic import atomic_file
from cse.storage.datasets import DatasetRef
from cse.storage.runs import RunDir
from cse.storage.settings import REPO_ROOT
from cse.training.job import LogMetrics, LogParams
from cse.training.loop import LoopResult, TrainingInterrupted

log = logging.getLogger(__name__)

# Rank 0's tracking callbacks, made on rank 0 only: job → (log_params, log_metrics).
MainCallbacks = Callable[["DistributedJob"], tuple[LogParams, LogMetrics]]


class DistributedJob(BaseModel):
    """Everything a rank needs, written by the launching task."""

    config: TrainConfig
    tokens: DatasetRef
    corruption: DatasetRef | None = None
    nli_tokens: DatasetRef | None = None
    sts: DatasetRef
    run_dir: str
    run_id: str
    precision: str
    stop_after: int | None = None

    def run_folder(self) -> RunDir:
        return RunDir.at(self.run_dir)


# ------------------------------------------------------------------------------------------------ launching (the task)
def torchrun_command(cfg: TrainConfig, job_file: Path, rdzv_id: str, worker_module: str) -> list[str]:
    """The torchrun command line of this node (`python -m torch.distributed.run` = `torchrun`), running
    `python -m <worker_module> <job_file>` on every rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.nproc_per_node)]
    if cfg.nnodes == 1:
        cmd.append("--standalone")  # a free local port; several jobs may run side by side
    else:
        endpoint = os.environ.get("CSE_RDZV_ENDPOINT")
        if not endpoint:
            raise ValueError(
                f"a job on {cfg.nnodes} nodes needs $CSE_RDZV_ENDPOINT=host:port (the c10d rendezvous, "
                "reachable from every node)"
            )
        cmd += [
            "--nnodes",
            str(cfg.nnodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            rdzv_id,
        ]
    return [*cmd, "-m", worker_module, str(job_file)]


def launch(
    job: DistributedJob,
    worker_module: str,
    slot: AbstractContextManager | None = None,
    logger: logging.Logger | logging.LoggerAdapter | None = None,
) -> LoopResult:
    """Train the job under torchrun (every rank runs `python -m <worker_module>`) and return rank 0's loop result
    (`TrainingInterrupted` if `stop_after` hit). `slot` is held while torchrun runs (the task's GPU slots)."""
    plog = logger or log
    cfg, run_dir = job.config, job.run_folder()
    run_dir.distributed.mkdir(parents=True, exist_ok=True)
    with atomic_file(run_dir.distributed_job) as tmp:
        tmp.write_text(job.model_dump_json(indent=2))
    run_dir.distributed_result.unlink(missing_ok=True)
    cmd = torchrun_command(cfg, run_dir.distributed_job, rdzv_id=run_dir.path.name, worker_module=worker_module)
    printable = " ".join(["torchrun", *cmd[3:]])
    if cfg.nnodes > 1:
        plog.info(
            "multi-node job: run on each of the other %d nodes (from %s): %s", cfg.nnodes - 1, REPO_ROOT, printable
        )
    plog.info("training on %d processes: %s", cfg.world_size, printable)
    with slot if slot is not None else contextlib.nullcontext():
        rc = _run(cmd)
    if rc != 0:
        raise RuntimeError(f"distributed training exited with status {rc} (the ranks' output is above): {printable}")
    if not run_dir.distributed_result.is_file():
        raise RuntimeError(f"distributed training ended without writing {run_dir.distributed_result}")
    record = json.loads(run_dir.distributed_result.read_text())
    if "interrupted" in record:
        raise TrainingInterrupted(record["interrupted"])
    return LoopResult(**record["result"])


def _run(cmd: list[str]) -> int:
    """Run torchrun in the repository root; on an interrupt, stop it (it forwards SIGTERM to its workers)."""
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT)
    try:
        return proc.wait()
    except BaseException:  # an interrupt too: the torchrun child is stopped, then it propagates
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


# ------------------------------------------------------------------------------------------------ one rank
def train_rank(job: DistributedJob, device: torch.device, main_callbacks: MainCallbacks) -> LoopResult:
    """This rank's share of the job: rows, model, Trainer (`cse.training.job.fit`); callbacks (`main_callbacks(job)`)
    and evaluation on rank 0 only."""
    from cse.evaluation.evaluator import Evaluator
    from cse.models.loading import load_tokenizer
    from cse.storage.evaluations import load_sts_input
    from cse.storage.layout import DataRoot
    from cse.storage.settings import get_settings
    from cse.training.job import fit, load_training_rows, rtd_probe

    cfg = job.config
    root = DataRoot(get_settings().data_root)
    tokenizer = load_tokenizer(cfg.backbone)
    rows, nli_rows = load_training_rows(cfg, root, job.tokens, job.corruption, job.nli_tokens, tokenizer.pad_token_id)
    evaluator, log_params, log_metrics, probe = None, (lambda params: None), (lambda metrics, step: None), None
    if distributed.is_main():
        evaluator = Evaluator(load_sts_input(job.sts.key, root).table)
        log_params, log_metrics = main_callbacks(job)
        probe = rtd_probe(cfg, root, job.tokens, job.corruption, tokenizer.pad_token_id)
    return fit(
        cfg,
        rows,
        nli_rows,
        job.run_folder(),
        job.run_id,
        device,
        job.precision,
        evaluator,
        log_params,
        log_metrics,
        stop_after=job.stop_after,
        probe=probe,
    )  # (no slot: the launching task holds the GPU slots)


def init_process_group(cfg: TrainConfig) -> torch.device:
    """Join torchrun's process group: NCCL with GPU `LOCAL_RANK` when training on CUDA, gloo on CPU."""
    from cse.models.loading import pick_device

    device = pick_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", distributed.local_rank())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return device


def rank_main(argv: list[str] | None, main_callbacks: MainCallbacks) -> int:
    """The body of a torchrun entry point: one rank of the job named on the command line; rank 0 records the result."""
    parser = argparse.ArgumentParser(description="one rank of a distributed training job (started by torchrun)")
    parser.add_argument("job", type=Path, help="the job file the train task wrote (<run dir>/distributed/job.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s rank" + os.environ.get("RANK", "?") + " %(levelname)s %(message)s"
    )
    job = DistributedJob.model_validate_json(args.job.read_text())
    if "RANK" not in os.environ:
        raise SystemExit("start this module with torchrun (see training/distributed.py)")
    device = init_process_group(job.config)
    try:
        try:
            record: dict[str, Any] = {"result": dataclasses.asdict(train_rank(job, device, main_callbacks))}
        except TrainingInterrupted as e:
            record = {"interrupted": str(e)}
        if distributed.is_main():
            with atomic_file(job.run_folder().distributed_result) as tmp:
                tmp.write_text(json.dumps(record, indent=2))
        distributed.barrier()
    finally:
        dist.destroy_process_group()
    return 0
