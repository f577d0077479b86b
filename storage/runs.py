"""Where a training job keeps its state: resume state, best checkpoint, export, MLflow run id.

    <CSE_HOME>/runs/<method>/<run_key>/
      state/         newest resume state (`ResumeState`: trainable tensors, optimizer + scheduler + RNG, progress)
      best/          best checkpoint on STS-B dev (cse.models.checkpoint format)
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

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cse.storage.atomic import atomic_file, recover_dir, remove_dead_temporaries, write_json
from cse.storage.hashing import sha256_file
from cse.storage.locks import exclusive
from cse.storage.paths import check_key, job_folder, no_links_below
from cse.storage.settings import get_settings

log = logging.getLogger(__name__)

QUARANTINE = "quarantine"  # <home>/quarantine/runs/<method>/<key>-<time>/, <job>/quarantine/<what>-<time>/


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")


def file_records(folder: Path) -> dict[str, dict[str, Any]]:
    """`{relative name: {"size", "sha256"}}` of every file under `folder` (recorded when a result is saved)."""
    return {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def check_file_records(folder: Path, records: dict[str, dict[str, Any]]) -> list[str]:
    """What differs between the files under `folder` and `records` (`file_records`): missing, size, hash."""
    problems = []
    for name, rec in records.items():
        p = folder / name
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif (size := p.stat().st_size) != rec["size"]:
            problems.append(f"{p}: {size} bytes, {rec['size']} recorded at save (truncated or overwritten)")
        elif sha256_file(p) != rec["sha256"]:
            problems.append(f"{p}: content hash differs from the one recorded at save")
    return problems


def move_aside(src: Path, dest: Path, reason: str | list[str]) -> Path:
    """Move `src` (a file or folder) to the quarantine folder `dest` (created; nothing deleted) with a
    `quarantine.json` saying what was wrong; returns `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    os.rename(src, dest / src.name)
    write_json(
        {
            "from": str(src),
            "problems": [reason] if isinstance(reason, str) else list(reason),
            "when": datetime.now(UTC).isoformat(),
            "pid": os.getpid(),
        },
        dest / "quarantine.json",
    )
    return dest


class ResumeStateDamaged(RuntimeError):
    """A file of a resume state is unreadable or differs from what was recorded when it was written; names it."""

    def __init__(self, file: Path, reason: str):
        self.file, self.reason = Path(file), reason
        super().__init__(f"resume state file {file} is damaged: {reason}")


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
        """Whether a state was written (a state a kill left moved aside by `atomic_dir` is put back first)."""
        recover_dir(self.folder)
        return self.progress.is_file()

    def quarantine(self, reason: str) -> Path:
        """Move the damaged state folder to `<its parent>/quarantine/state-<time>/` (nothing deleted); the job then
        restarts from its first step (only one state is kept: there is no older good one)."""
        return move_aside(self.folder, self.folder.parent / QUARANTINE / f"{self.folder.name}-{_stamp()}", reason)


class RunDir:
    """The folder of a training job (`<home>/runs/<method>/<run key>`): its state, checkpoints and lock."""

    def __init__(self, method: str, run_key: str, home: Path | None = None):
        parts = ("runs", check_key(method, "method"), check_key(run_key, "run key"))
        # a link on the way would send the job's writes outside the home: refused before the folder is made
        self.path = no_links_below(home or get_settings().home, parts, "training job folder")
        self.path.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The job's lock: one process trains (or finishes) a job at a time; a second flow of the same job (a
        rerun started while the first still runs) waits, then resumes or finds the result. Once held, the
        temporaries of killed writers of the job (`.tmp-state-<pid>-*` of a killed state write, ...) are removed."""
        with exclusive(self.path.parent / f"{self.path.name}.lock", f"training job {self.path}"):
            if removed := remove_dead_temporaries(self.path):
                log.warning("removed %d temporaries of killed writers of %s: %s", len(removed), self.path, removed)
            yield

    @classmethod
    def at(cls, path: str | Path, home: str | Path | None = None) -> RunDir:
        """The existing job folder `path` (= <home>/runs/<method>/<run key>); any other shape, or a folder outside
        `home` when given, is refused, saying what was expected (`cse.storage.paths.job_folder`)."""
        home, method, key = job_folder(path, home)
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
        """What every rank trains (`cse.training.distributed.DistributedJob`), written by the launching task."""
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
        """Record the finished job's result, with the size and sha256 of every file of its best checkpoint
        (`best_files`), so that a later cache hit can check what it returns (`verify_result`)."""
        record = {**result, "best_files": file_records(self.best)} if self.best.is_dir() else dict(result)
        with atomic_file(self._result_file) as tmp:
            tmp.write_text(json.dumps(record, indent=2, sort_keys=True))

    def verify_result(self, required: tuple[str, ...] = ("run_id",)) -> ResultCheck:
        """The finished job's result checked before a cache hit returns it: the record reads (JSON with `required`
        keys) and the best checkpoint's files match the sizes and hashes recorded at save."""
        if not self._result_file.is_file():
            return ResultCheck(None)
        try:
            record = json.loads(self._result_file.read_text())
            if not isinstance(record, dict) or (missing := [k for k in required if k not in record]):
                raise ValueError(f"missing {missing if isinstance(record, dict) else 'everything'}")
        except (ValueError, OSError) as e:
            return ResultCheck(None, result_problems=[f"{self._result_file}: unreadable ({e})"])
        return ResultCheck(record, checkpoint_problems=check_file_records(self.best, record.get("best_files", {})))

    def quarantine(self, reason: str | list[str]) -> Path:
        """Move the whole job folder to `<home>/quarantine/runs/<method>/<key>-<time>/` (nothing deleted) and
        start an empty one in its place (the job is trained again)."""
        home = self.path.parents[2]
        dest = move_aside(
            self.path, home / QUARANTINE / "runs" / self.path.parent.name / f"{self.path.name}-{_stamp()}", reason
        )
        self.path.mkdir(parents=True, exist_ok=True)
        return dest

    def quarantine_result(self, reason: str | list[str]) -> Path:
        """Move only the recorded result aside (to `<job>/quarantine/result-<time>/`): the job's training is intact,
        so the next run resumes at its last step and evaluates and records it again."""
        return move_aside(self._result_file, self.path / QUARANTINE / f"result-{_stamp()}", reason)


@dataclass
class ResultCheck:
    """What `RunDir.verify_result` found: the record (None when there is none or it is unreadable) and the problems
    of the record itself and of the best checkpoint."""

    record: dict[str, Any] | None
    result_problems: list[str] = field(default_factory=list)
    checkpoint_problems: list[str] = field(default_factory=list)


def checkpoint_job_run_id(folder: str | Path) -> str | None:
    """The MLflow run of the training job whose `best/` checkpoint `folder` is (`<home>/runs/<method>/<key>/best`,
    the id in its job folder's `mlflow_run_id`); None for a checkpoint folder anywhere else.

    Args:
        folder: a checkpoint folder as given to the evaluation stage.
    """
    resolved = Path(folder).expanduser().resolve()
    job = resolved.parent
    if resolved.name != "best" or job.parent.parent.name != "runs" or not (job / "mlflow_run_id").is_file():
        return None
    return (job / "mlflow_run_id").read_text().strip() or None
