"""Distributed training job: what the `train` task launches when `nproc_per_node × nnodes` > 1, and the entry
point of each rank that torchrun starts.

The task (`launch`) writes `<run dir>/distributed/job.json` — the resolved TrainConfig, the dataset refs, the
MLflow run id, the resolved precision and `stop_after` — and runs, on its own node,

    python -m torch.distributed.run --standalone --nproc-per-node N -m tasks.distributed_train <run dir>/distributed/job.json

(`torchrun --standalone --nproc-per-node N -m tasks.distributed_train <job.json>` is the same command). A multi-node
job (`nnodes` > 1) uses a c10d rendezvous at `$CSE_RDZV_ENDPOINT` (host:port, reachable from every node) instead
of `--standalone`:

    torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id <run key> \\
        -m tasks.distributed_train <run dir>/distributed/job.json

The task starts it on its node and logs the command; the other nodes must run the same command (the data root
and `CSE_HOME` must be on a filesystem every node sees: the ranks read the rows and the resume state there).

Every rank (`main`) joins the process group (NCCL on GPU, one GPU per rank = `LOCAL_RANK`; gloo on CPU), loads
the rows, builds the model and runs `tasks.train.fit`, i.e. the Trainer on its slice of each global batch
(models/distributed.py: the step equals the single-process step on the whole batch). Rank 0 alone evaluates on
STS-B dev, saves the best checkpoint and the resume state, and logs params/metrics into the job's MLflow run
through the client (the run stays open in, and is ended by, the launching task). At the end rank 0 writes
`<run dir>/distributed/result.json` (the loop result, or that `stop_after` interrupted the run); the task reads
it and goes on with test evaluation, artifacts and export as for a single-process job.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import BaseModel

from config.settings import REPO_ROOT
from config.training import TrainConfig
from models import distributed
from storage.atomic import atomic_file
from storage.datasets import DatasetRef
from storage.runs import RunDir
from tasks.trainer import LoopResult, TrainingInterrupted

log = logging.getLogger(__name__)

JOB_FILE = "job.json"
RESULT_FILE = "result.json"


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
        path = Path(self.run_dir)
        return RunDir(self.config.method, path.name, home=path.parents[2])  # <home>/runs/<method>/<run key>

    @property
    def result_file(self) -> Path:
        return Path(self.run_dir) / "distributed" / RESULT_FILE


# ------------------------------------------------------------------------------------------------ launching (the task)
def torchrun_command(cfg: TrainConfig, job_file: Path, rdzv_id: str) -> list[str]:
    """The torchrun command line of this node (`python -m torch.distributed.run` = `torchrun`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.nproc_per_node)]
    if cfg.nnodes == 1:
        cmd.append("--standalone")  # a free local port; several jobs may run side by side
    else:
        endpoint = os.environ.get("CSE_RDZV_ENDPOINT")
        if not endpoint:
            raise ValueError(f"a job on {cfg.nnodes} nodes needs $CSE_RDZV_ENDPOINT=host:port (the c10d rendezvous, "
                             "reachable from every node)")
        cmd += ["--nnodes", str(cfg.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
    return [*cmd, "-m", "tasks.distributed_train", str(job_file)]


def launch(cfg: TrainConfig, tokens: DatasetRef, corruption: DatasetRef | None, nli_tokens: DatasetRef | None,
           sts: DatasetRef, run_dir: RunDir, run_id: str, device: torch.device, precision: str,
           stop_after: int | None = None) -> LoopResult:
    """Train the job under torchrun and return rank 0's loop result (`TrainingInterrupted` if `stop_after` hit)."""
    from tasks.ingest import _logger
    from tasks.train import gpu_slot

    plog = _logger()
    folder = run_dir.path / "distributed"
    folder.mkdir(parents=True, exist_ok=True)
    job = DistributedJob(config=cfg, tokens=tokens, corruption=corruption, nli_tokens=nli_tokens, sts=sts,
                         run_dir=str(run_dir.path), run_id=run_id, precision=precision, stop_after=stop_after)
    job_file = folder / JOB_FILE
    with atomic_file(job_file) as tmp:
        tmp.write_text(job.model_dump_json(indent=2))
    job.result_file.unlink(missing_ok=True)
    cmd = torchrun_command(cfg, job_file, rdzv_id=run_dir.path.name)
    printable = " ".join(["torchrun", *cmd[3:]])
    if cfg.nnodes > 1:
        plog.info("multi-node job: run on each of the other %d nodes (from %s): %s", cfg.nnodes - 1, REPO_ROOT, printable)
    plog.info("training on %d processes: %s", cfg.world_size, printable)
    with gpu_slot(device, occupy=cfg.nproc_per_node):
        rc = _run(cmd)
    if rc != 0:
        raise RuntimeError(f"distributed training exited with status {rc} (the ranks' output is above): {printable}")
    if not job.result_file.is_file():
        raise RuntimeError(f"distributed training ended without writing {job.result_file}")
    record = json.loads(job.result_file.read_text())
    if "interrupted" in record:
        raise TrainingInterrupted(record["interrupted"])
    return LoopResult(**record["result"])


def _run(cmd: list[str]) -> int:
    """Run torchrun in the repository root; on an interrupt, stop it (it forwards SIGTERM to its workers)."""
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT)
    try:
        return proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


# ------------------------------------------------------------------------------------------------ one rank
def _mlflow_callbacks(run_id: str, run_dir: RunDir):
    """Rank 0's `log_params` / `log_metrics`: into the job's run through the client (the run's status is left alone),
    via `ResilientMetricLogger` (an unreachable server spools into the job's folder; the launching task flushes)."""
    import mlflow

    from tasks.tracking import ResilientMetricLogger, configure_mlflow

    configure_mlflow()
    client = mlflow.tracking.MlflowClient()
    client.set_tag(run_id, "world_size", str(distributed.world()))
    metrics_log = ResilientMetricLogger(run_id, run_dir, client=client)

    def log_params(params: dict) -> None:
        try:
            metrics_log.log_params(params)
        except mlflow.exceptions.MlflowException as e:  # a resumed run that logged other values before
            log.warning("params not logged (%s): %s", e, params)

    return log_params, metrics_log.log_metrics


def train_rank(job: DistributedJob, device: torch.device) -> LoopResult:
    """This rank's share of the job: rows, model, Trainer (`tasks.train.fit`); callbacks and evaluation on rank 0."""
    from config.settings import get_settings
    from evaluation.evaluator import Evaluator
    from models.loading import load_tokenizer
    from storage.evaluations import load_sts_input
    from storage.layout import DataRoot
    from tasks.train import fit, load_training_rows

    cfg = job.config
    root = DataRoot(get_settings().data_root)
    tokenizer = load_tokenizer(cfg.backbone)
    rows, nli_rows = load_training_rows(cfg, root, job.tokens, job.corruption, job.nli_tokens, tokenizer.pad_token_id)
    evaluator, log_params, log_metrics = None, (lambda params: None), (lambda metrics, step: None)
    if distributed.is_main():
        evaluator = Evaluator(load_sts_input(job.sts.key, root).table)
        log_params, log_metrics = _mlflow_callbacks(job.run_id, job.run_folder())
    return fit(cfg, rows, nli_rows, job.run_folder(), job.run_id, device, job.precision, evaluator, log_params, log_metrics,
               stop_after=job.stop_after, hold_gpu_slot=False)  # the launching task holds the GPU slots


def init_process_group(cfg: TrainConfig) -> torch.device:
    """Join torchrun's process group: NCCL with GPU `LOCAL_RANK` when training on CUDA, gloo on CPU."""
    from models.loading import pick_device

    device = pick_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", distributed.local_rank())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of a distributed training job (started by torchrun)")
    parser.add_argument("job", type=Path, help="the job file the train task wrote (<run dir>/distributed/job.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank" + os.environ.get("RANK", "?") + " %(levelname)s %(message)s")
    job = DistributedJob.model_validate_json(args.job.read_text())
    if "RANK" not in os.environ:
        raise SystemExit("start this module with torchrun (see the module docstring)")
    device = init_process_group(job.config)
    try:
        try:
            record = {"result": dataclasses.asdict(train_rank(job, device))}
        except TrainingInterrupted as e:
            record = {"interrupted": str(e)}
        if distributed.is_main():
            with atomic_file(job.result_file) as tmp:
                tmp.write_text(json.dumps(record, indent=2))
        distributed.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
