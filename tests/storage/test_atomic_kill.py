"""The one atomic write (`cse.storage.atomic`): a process killed (SIGKILL) at any step of `atomic_dir` or
`atomic_file` leaves the old folder or file or the new one, complete, never a mix or a half-written one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cse.storage.atomic import PREVIOUS_SUFFIX, TMP_PREFIX, atomic_dir, atomic_file, recover_dir

OLD = {"a.txt": "old a", "b.txt": "old b"}
NEW = {"a.txt": "new a", "c.txt": "new c" * 1000}

# The child replaces `final` by NEW and kills itself (SIGKILL: no cleanup runs) at its `kill_at`-th call of
# os.rename/os.replace, or while writing the files when `kill_at` is 0.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path

    from cse.storage import atomic

    final, kill_at, files = Path(sys.argv[1]), int(sys.argv[2]), eval(sys.argv[3])
    calls = [0]

    def killing(real):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return call

    atomic.os.rename = killing(os.rename)
    atomic.os.replace = killing(os.replace)
    if sys.argv[4] == "dir":
        with atomic.atomic_dir(final) as tmp:
            for i, (name, text) in enumerate(files.items()):
                (tmp / name).write_text(text)
                if kill_at == 0 and i == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
        previous_gone = not final.with_name(final.name + ".previous").exists()
        print("done", previous_gone)
    else:
        with atomic.atomic_file(final) as tmp:
            tmp.write_text(files["a.txt"][:2])
            if kill_at == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            tmp.write_text(files["a.txt"])
        print("done")
    """
)


def _run(final: Path, kill_at: int, kind: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(final), str(kill_at), repr(NEW), kind], capture_output=True, text=True
    )


def _contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


@pytest.mark.parametrize(
    "kill_at, expect",
    [
        (0, OLD),  # while the new files are written
        (1, OLD),  # before the old folder is moved aside (`<final>.previous`)
        (2, OLD),  # between the two renames: only `<final>.previous` holds a folder, put back by recover_dir
        (3, NEW),  # never reached (two renames): the write completes
    ],
)
def test_a_kill_at_any_step_of_atomic_dir_leaves_the_old_folder_or_the_new(tmp_path, kill_at, expect):
    final = tmp_path / "export"
    final.mkdir()
    for name, text in OLD.items():
        (final / name).write_text(text)
    done = _run(final, kill_at, "dir")
    if kill_at < 3:
        assert done.returncode == -signal.SIGKILL, done.stderr
    else:
        assert done.returncode == 0 and done.stdout.split() == ["done", "True"], done.stderr
    if kill_at == 2:
        assert not final.exists() and final.with_name(final.name + PREVIOUS_SUFFIX).is_dir()
    recover_dir(final)  # what the next writer (atomic_dir) or reader (ResumeState) does first
    assert _contents(final) == expect
    assert not final.with_name(final.name + PREVIOUS_SUFFIX).exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]
    assert len(leftovers) == (1 if kill_at < 3 else 0)  # a killed writer's `.tmp-*` (clean_temporaries removes it)


def test_the_next_atomic_dir_after_a_kill_between_the_renames_starts_from_the_old_folder(tmp_path):
    final = tmp_path / "state"
    final.mkdir()
    (final / "a.txt").write_text("old a")
    assert _run(final, 2, "dir").returncode == -signal.SIGKILL
    with atomic_dir(final) as tmp:
        assert (final / "a.txt").read_text() == "old a"  # put back before the new write starts
        (tmp / "a.txt").write_text("newer a")
    assert _contents(final) == {"a.txt": "newer a"}
    assert not final.with_name(final.name + PREVIOUS_SUFFIX).exists()


@pytest.mark.parametrize("kill_at, expect", [(0, "old a"), (1, "old a"), (2, "new a")])
def test_a_kill_during_atomic_file_leaves_the_old_file_or_the_new(tmp_path, kill_at, expect):
    final = tmp_path / "meta.json"
    final.write_text("old a")
    done = _run(final, kill_at, "file")
    assert done.returncode == (0 if kill_at == 2 else -signal.SIGKILL), done.stderr
    assert final.read_text() == expect


def test_an_error_inside_atomic_dir_keeps_the_old_folder_and_removes_the_new(tmp_path):
    final = tmp_path / "export"
    final.mkdir()
    (final / "a.txt").write_text("old a")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(final) as tmp:
            (tmp / "a.txt").write_text("half")
            raise KeyboardInterrupt
    assert _contents(final) == {"a.txt": "old a"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_atomic_file_fsyncs_the_file_and_its_folder(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if Path("/proc/self/fd").is_dir() else str(fd))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with atomic_file(tmp_path / "x.txt") as tmp:
        tmp.write_text("x")
    assert len(synced) == 2
    if Path("/proc/self/fd").is_dir():
        assert Path(synced[0]).name.startswith(TMP_PREFIX) and synced[1] == str(tmp_path)
