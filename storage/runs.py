"""Where a training job keeps its state: resume state, best checkpoint, export, MLflow run id.

    <CSE_HOME>/runs/<method>/<run_key>/
      state/         newest resume state (`ResumeState`: trainable tensors, optimizer + scheduler + RNG, progress)
      best/          best checkpoint on STS-B dev (models.checkpoint format)
      export/        sentence-transformers folder of the best checkpoint (with its model card, README.md)
      peft-adapter/  PEFT prefix-tuning adapter of the best checkpoint (prompt methods; with its model card)
      mlflow_run_id  the MLflow run this job logs to (a resumed job continues the same run)
      mlflow_spool.jsonl  metrics/params the MLflow server did not take yet (storage/spool.py; absent when none)
      distributed/   a torchrun job's hand-over (training/distributed.py): job.json (what every rank trains), result.json
                     (rank 0's loop result)
      result.json    written last, when the job has finished: a rerun returns it instead of training again

`run_key` hashes the resolved training configuration, so rerunning the same deployment after a
crash finds the same folder and resumes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from config.settings import get_settings
from storage.locks import exclusive
from storage.atomic import atomic_file
from storage.paths import check_key, job_folder


class ResumeState:
    """The files of one resume state folder, written whole (atomically) by the training loop (training/loop.py).
    `within(folder)` names the same files in another folder (the temporary one the loop writes before the swap)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def within(self, folder: str | Path) -> ResumeState:
        return ResumeState(folder)

    @property
    def trainable(self) -> Path:
        """The trainable tensors (safetensors)."""
        return self.folder / "trainable.safetensors"

    @property
    def optimizer(self) -> Path:
        """Optimizer, scheduler, grad scaler and RNG states (torch.save)."""
        return self.folder / "optimizer.pt"

    @property
    def progress(self) -> Path:
        """Step, best dev score, phase and schedule signature (JSON)."""
        return self.folder / "trainer_state.json"

    def exists(self) -> bool:
        return self.progress.is_file()


class RunDir:
    def __init__(self, method: str, run_key: str, home: Path | None = None):
        self.path = (home or get_settings().home) / "runs" / check_key(method, "method") / check_key(run_key, "run key")
        self.path.mkdir(parents=True, exist_ok=True)

    def exclusive(self):
        """The job's lock: one process trains (or finishes) a job at a time; a second flow of the same job (a
        rerun started while the first still runs) waits, then resumes or finds the result."""
        return exclusive(self.path.parent / f"{self.path.name}.lock", f"training job {self.path}")

    @classmethod
    def at(cls, path: str | Path) -> RunDir:
        """The existing job folder `path` (= <home>/runs/<method>/<run key>); any other shape is refused, saying what
        was expected (`storage.paths.job_folder`)."""
        home, method, key = job_folder(path)
        return cls(method, key, home=home)

    @property
    def state(self) -> Path:
        return self.path / "state"

    @property
    def resume_state(self) -> ResumeState:
        return ResumeState(self.state)

    @property
    def best(self) -> Path:
        return self.path / "best"

    @property
    def export(self) -> Path:
        return self.path / "export"

    @property
    def peft_adapter(self) -> Path:
        return self.path / "peft-adapter"

    @property
    def _run_id_file(self) -> Path:
        return self.path / "mlflow_run_id"

    def mlflow_run_id(self) -> str | None:
        return self._run_id_file.read_text().strip() if self._run_id_file.is_file() else None

    def set_mlflow_run_id(self, run_id: str) -> None:
        with atomic_file(self._run_id_file) as tmp:
            tmp.write_text(run_id + "\n")

    @property
    def metrics_spool(self) -> Path:
        """The JSONL spool of tracking batches not delivered to MLflow yet (storage/spool.py)."""
        return self.path / "mlflow_spool.jsonl"

    def has_state(self) -> bool:
        return self.resume_state.exists()

    @property
    def distributed(self) -> Path:
        """The hand-over folder of a torchrun job (training/distributed.py)."""
        return self.path / "distributed"

    @property
    def distributed_job(self) -> Path:
        """What every rank trains (`training.distributed.DistributedJob`), written by the launching task."""
        return self.distributed / "job.json"

    @property
    def distributed_result(self) -> Path:
        """Rank 0's loop result (or that `stop_after` interrupted the run), read by the launching task."""
        return self.distributed / "result.json"

    @property
    def _result_file(self) -> Path:
        return self.path / "result.json"

    def result(self) -> dict[str, Any] | None:
        """The finished job's result record, or None while it has not finished."""
        return json.loads(self._result_file.read_text()) if self._result_file.is_file() else None

    def set_result(self, result: dict[str, Any]) -> None:
        with atomic_file(self._result_file) as tmp:
            tmp.write_text(json.dumps(result, indent=2, sort_keys=True))
