"""storage/locks.py: `exclusive` admits one holder (threads and processes alike), a dead holder frees the lock,
`try_exclusive` never waits."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cse.storage.locks import exclusive, try_exclusive
from cse.storage.settings import REPO_ROOT

HOLDER = """
import sys, time
from pathlib import Path
from cse.storage.locks import exclusive
with exclusive(Path(sys.argv[1]), "test lock"):
    print("held", flush=True)
    sys.stdin.readline()  # hold until told (or killed)
    print("released", flush=True)
"""


@pytest.fixture
def holder(tmp_path):
    """Start another process holding `exclusive` on a lock file; yields (process, lock path)."""
    lock = tmp_path / "locks" / "x.lock"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock)],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc, lock
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_a_lock_held_by_another_process_is_not_free(holder):
    proc, lock = holder
    with try_exclusive(lock) as free:
        assert free is False
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "released"
    proc.wait(10)
    with try_exclusive(lock) as free:
        assert free is True


def test_a_waiter_enters_when_the_holding_process_is_killed(holder, caplog):
    proc, lock = holder
    entered = threading.Event()

    def waiter():
        with exclusive(lock, "dataset tokens/k"):
            entered.set()

    with caplog.at_level(logging.INFO, logger="cse.storage.locks"):
        t = threading.Thread(target=waiter)
        t.start()
        assert not entered.wait(0.5)  # waits while the other process holds it
        os.kill(proc.pid, signal.SIGKILL)  # the kernel releases a dead holder's flock
        assert entered.wait(10)
        t.join(10)
    assert "dataset tokens/k is in use by another process; waiting for it" in caplog.text
    assert "dataset tokens/k: waited" in caplog.text


def test_exclusive_serialises_threads(tmp_path):
    lock = tmp_path / "a" / "b" / "job.lock"  # parent folders are created
    inside, overlaps, order = [0], [], []
    guard = threading.Lock()

    def worker(i: int):
        with exclusive(lock, "job"):
            with guard:
                inside[0] += 1
                overlaps.append(inside[0])
            order.append(i)
            time.sleep(0.05)
            with guard:
                inside[0] -= 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(order) == [0, 1, 2, 3] and overlaps == [1, 1, 1, 1]
    assert lock.is_file()


def test_try_exclusive_on_a_missing_file_does_not_create_it(tmp_path):
    lock = tmp_path / "none.lock"
    with try_exclusive(lock) as free:
        assert free is True
    assert not lock.exists()


def test_try_exclusive_does_not_wait_for_a_holder_in_this_process(tmp_path):
    lock = tmp_path / "k.lock"
    with exclusive(lock, "k"):
        t0 = time.monotonic()
        with try_exclusive(lock) as free:
            assert free is False
        assert time.monotonic() - t0 < 1
        with try_exclusive(tmp_path / "other.lock") as free:  # another lock file is independent
            assert free is True
    with try_exclusive(lock) as free:
        assert free is True


def test_the_lock_is_released_when_the_block_raises(tmp_path):
    lock = Path(tmp_path / "r.lock")
    with pytest.raises(RuntimeError, match="stage failed"):
        with exclusive(lock, "r"):
            raise RuntimeError("stage failed")
    with try_exclusive(lock) as free:
        assert free is True
