"""training/distributed.py without a real launch: the torchrun command line, the job/result hand-over in the job
folder (`RunDir.distributed_job` / `distributed_result`) and how `launch` reads rank 0's record."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import cse.training.distributed as td
from cse.config.training import TrainConfig
from cse.storage.datasets import DatasetRef
from cse.storage.runs import RunDir
from cse.training.loop import LoopResult, TrainingInterrupted

REF = DatasetRef(kind="tokens", key="k", path="p", rows=1, content_hash="h")


def test_single_node_command_is_standalone_and_runs_the_worker_module():
    cmd = td.torchrun_command(TrainConfig(nproc_per_node=2), Path("/runs/x/job.json"), "x", worker_module="pkg.worker")
    args = "-m torch.distributed.run --nproc-per-node 2 --standalone -m pkg.worker /runs/x/job.json"
    assert cmd == [sys.executable, *args.split()]


def test_multi_node_command_uses_the_rendezvous_endpoint(monkeypatch):
    two = TrainConfig(nproc_per_node=2, nnodes=3)
    monkeypatch.delenv("CSE_RDZV_ENDPOINT", raising=False)
    with pytest.raises(ValueError, match="CSE_RDZV_ENDPOINT"):
        td.torchrun_command(two, Path("job.json"), "key", worker_module="pkg.worker")
    monkeypatch.setenv("CSE_RDZV_ENDPOINT", "node0:29400")
    cmd = td.torchrun_command(two, Path("job.json"), "key", worker_module="pkg.worker")
    assert "--standalone" not in cmd
    rendezvous = "--rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id key"
    assert cmd[3:] == f"--nproc-per-node 2 --nnodes 3 {rendezvous} -m pkg.worker job.json".split()


def _job(tmp_path, stop_after=None) -> td.DistributedJob:
    run_dir = RunDir("d2cse", "runkey", home=tmp_path)
    return td.DistributedJob(
        config=TrainConfig(nproc_per_node=2),
        tokens=REF,
        sts=REF,
        run_dir=str(run_dir.path),
        run_id="r1",
        precision="fp32",
        stop_after=stop_after,
    )


@pytest.mark.parametrize(
    "record",
    [
        {
            "result": {
                "steps": 8,
                "best_score": 1.5,
                "best_step": 4,
                "resumed_from": None,
                "seconds": 2.0,
                "sentences_per_s": 3.0,
            }
        },
        {"interrupted": "stopped after step 6 (stop_after)"},
    ],
)
def test_launch_hands_over_through_the_job_folder(tmp_path, monkeypatch, record):
    job = _job(tmp_path)
    folder = job.run_folder()
    assert folder.path == Path(job.run_dir).resolve()
    folder.distributed.mkdir()
    folder.distributed_result.write_text("stale")
    ran, held = [], []

    def fake_run(cmd):  # what rank 0 leaves behind; the stale result of an earlier launch is gone by now
        assert not folder.distributed_result.exists()
        ran.append(cmd)
        folder.distributed_result.write_text(json.dumps(record))
        return 0

    class Slot:
        def __enter__(self):
            held.append("in")

        def __exit__(self, *exc):
            held.append("out")

    monkeypatch.setattr(td, "_run", fake_run)
    if "interrupted" in record:
        with pytest.raises(TrainingInterrupted, match="step 6"):
            td.launch(job, "pkg.worker", slot=Slot())
    else:
        assert td.launch(job, "pkg.worker", slot=Slot()) == LoopResult(**record["result"])
    assert held == ["in", "out"]
    assert ran[0][-3:] == ["-m", "pkg.worker", str(folder.distributed_job)]
    assert td.DistributedJob.model_validate_json(folder.distributed_job.read_text()) == job


def test_launch_fails_when_torchrun_fails_or_writes_no_result(tmp_path, monkeypatch):
    job = _job(tmp_path)
    monkeypatch.setattr(td, "_run", lambda cmd: 3)
    with pytest.raises(RuntimeError, match="exited with status 3"):
        td.launch(job, "pkg.worker")
    monkeypatch.setattr(td, "_run", lambda cmd: 0)
    with pytest.raises(RuntimeError, match="without writing"):
        td.launch(job, "pkg.worker")
