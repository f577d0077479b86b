"""Resume states written beside training: a snapshot on the training thread, the files on a background thread.

`snapshot_state` copies what a resume needs to host memory (the trainable tensors, the optimizer state, everything
else the trainer records): the only part that waits for the device. `StateWriter.write` hands the snapshot to one
background thread, which serialises it, hashes every file while writing it (the sizes and SHA-256 digests go into
the progress file, so a damaged state is named on resume) and moves the folder into place with
`cse.storage.atomic.atomic_dir`: a kill at any time leaves the previous state or the new one, complete. One write is in
flight at a time; the next snapshot waits for it.

A state read back is checked twice: its files against the sizes and hashes recorded (the loop), and its tensors for
`nan`/`inf` (`require_finite_state`): a state whose files were replaced with their hashes recorded anew, holding inf,
was loaded and every rerun failed with `NonFiniteLoss`, never naming the state.

Examples:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from cse.storage.runs import ResumeState
    >>> state = ResumeState(Path(tempfile.mkdtemp()) / "state")
    >>> writer = StateWriter(state, background=True)
    >>> writer.write(StateSnapshot({"w": torch.ones(2)}, {"optimizer": {}}, {"step": 1}))
    >>> writer.close()
    >>> sorted(p.name for p in state.folder.iterdir())
    ['optimizer.pt', 'trainable.safetensors', 'trainer_state.json']
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import torch
from safetensors.torch import save as safetensors_bytes

from cse.models.finite import listed, nested_tensors, non_finite_tensors
from cse.storage.atomic import atomic_dir
from cse.storage.runs import ResumeState, ResumeStateDamaged

if TYPE_CHECKING:
    from typing_extensions import Buffer


@dataclass
class StateSnapshot:
    """What one resume state holds, in host memory: `tensors` (safetensors), `payload` (torch.save: optimizer,
    scheduler, scaler, RNG states) and `progress` (JSON; the file records are added when written)."""

    tensors: dict[str, torch.Tensor]
    payload: dict[str, Any]
    progress: dict[str, Any]


def host_copy(obj: Any) -> Any:
    """`obj` with every tensor copied to host memory (nested dicts, lists and tuples followed): later in-place updates
    of the originals (the optimizer's next step) cannot reach the copy."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


class _HashingFile(io.RawIOBase):
    """A write-only file that hashes what passes through it (torch.save writes here)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b: Buffer) -> int:
        view = memoryview(b)
        self.sha.update(view)
        self.size += view.nbytes
        return self.f.write(view)


# A write refused for room: a full disk, a quota, a file-size limit (RLIMIT_FSIZE, a file system's largest file)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class StateWriteFailed(OSError):
    """A resume state could not be written for want of room: names the job, the state and its step, the file, how
    much the state needed and what was free, and that the previous state is intact. Its errno is the original one."""


def _tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in `obj` (nested dicts, lists and tuples followed)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _previous_step(state: ResumeState) -> int | None:
    """The step of the resume state in place (None when there is none or its progress file does not read)."""
    try:
        return int(json.loads(state.progress.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def no_room_error(state: ResumeState, snapshot: StateSnapshot, e: OSError) -> StateWriteFailed:
    """`e` (a write refused for room) said in full: which job (the state's folder's parent), which state (its step),
    which file, how much the state needed (its tensors' bytes) and was free, and that the previous state is intact
    (`atomic_dir` removed the temporary folder and left the old state in place).

    Args:
        state: the resume state that was being written.
        snapshot: what was being written.
        e: the error of the write.
    """
    mib = 2**20
    needed = _tensor_bytes(snapshot.tensors) + _tensor_bytes(snapshot.payload)
    try:
        free = f"{shutil.disk_usage(state.folder.parent).free / mib:,.1f} MiB free there"
    except OSError:
        free = "free room unknown"
    step = snapshot.progress.get("step", "?")
    previous = _previous_step(state)
    kept = (
        f"the previous resume state (step {previous}) in {state.folder} is intact: a rerun resumes from it"
        if previous is not None
        else f"no earlier resume state exists in {state.folder}: a rerun starts from step 0"
    )
    return StateWriteFailed(
        e.errno,
        f"{e.strerror or 'no room'} while writing the resume state of step {step} of training job "
        f"{state.folder.parent} ({e.filename or 'a file of the state'}): the state needs about "
        f"{needed / mib:,.1f} MiB ({free}); {kept}; free space there (or raise the file-size limit) and rerun the job",
    )


def write_state(state: ResumeState, snapshot: StateSnapshot) -> None:
    """Write `snapshot` as the resume state `state` (atomically; file sizes and hashes recorded in its progress file).
    A write refused for room (full disk, quota, file-size limit) raises `StateWriteFailed`, naming job, step and size.

    Args:
        state: the resume state's files.
        snapshot: what to write.
    """
    try:
        _write_state(state, snapshot)
    except OSError as e:
        if e.errno not in NO_ROOM:
            raise
        raise no_room_error(state, snapshot, e) from e


def _write_state(state: ResumeState, snapshot: StateSnapshot) -> None:
    with atomic_dir(state.folder) as tmp:
        files = state.within(tmp)
        tensors = safetensors_bytes(snapshot.tensors)
        files.trainable.write_bytes(tensors)
        with open(files.optimizer, "wb") as f:
            sink = _HashingFile(f)
            torch.save(snapshot.payload, cast(BinaryIO, sink))  # (a raw binary file; torch's hint names IO[bytes])
        records = {
            files.trainable.name: {"size": len(tensors), "sha256": hashlib.sha256(tensors).hexdigest()},
            files.optimizer.name: {"size": sink.size, "sha256": sink.sha.hexdigest()},
        }
        files.progress.write_text(json.dumps({"files": records, **snapshot.progress}, indent=2))


class StateWriter:
    """Writes resume states one at a time, on a background thread or inline.

    Args:
        state: the resume state's files.
        background: write on a background thread (the training loop goes on meanwhile); False writes inline.
    """

    def __init__(self, state: ResumeState, background: bool = True):
        self.state = state
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="cse-state") if background else None
        self.pending: Future | None = None
        self.writes = 0
        self.write_s = 0.0  # the writes' own time (on the background thread when there is one)

    def _timed_write(self, snapshot: StateSnapshot) -> None:
        t0 = time.perf_counter()
        write_state(self.state, snapshot)
        self.write_s += time.perf_counter() - t0
        self.writes += 1

    def write(self, snapshot: StateSnapshot) -> None:
        """Write `snapshot` (after the write in flight, if any, is done; its error, if any, is raised here)."""
        self.wait()
        if self.pool is None:
            self._timed_write(snapshot)
        else:
            self.pending = self.pool.submit(self._timed_write, snapshot)

    def wait(self) -> None:
        """Wait for the write in flight; raise its error."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        """Wait for the write in flight and stop the thread."""
        try:
            self.wait()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)


def require_finite_state(state: ResumeState, tensors: dict[str, torch.Tensor], optimizer_state: Any) -> None:
    """Refuse a resume state read back with a `nan`/`inf` tensor: the trainable tensors and every tensor of the
    optimizer file (Adam's moments, the scheduler's and scaler's states).

    Args:
        state: the state's files, for the message.
        tensors: the trainable tensors read from `state.trainable`.
        optimizer_state: what `state.optimizer` holds.

    Raises:
        ResumeStateDamaged: naming the file, each non-finite tensor and its first rows (`prefix (3 of 6 values, rows
            1)`, `optimizer.state.1.exp_avg (…)`); the loop quarantines the state like any damaged one.
    """
    for file, named in ((state.trainable, tensors.items()), (state.optimizer, nested_tensors(optimizer_state, ""))):
        if found := non_finite_tensors(named):
            raise ResumeStateDamaged(file, f"non-finite (nan/inf) tensors: {listed(found)}")
