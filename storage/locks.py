"""Advisory file locks (`flock`) for work that concurrent flows must not do twice at once."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


@contextlib.contextmanager
def exclusive(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing) while the block runs; a second holder waits,
    saying so in the log. The kernel releases the lock when its holder dies, so a killed process never leaves
    it held. The folder must be on a filesystem with working flock (local disks, NFSv4, most cluster
    filesystems)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            t0 = time.monotonic()
            log.info("%s is in use by another process; waiting for it", what)
            fcntl.flock(fd, fcntl.LOCK_EX)
            log.info("%s: waited %.1fs", what, time.monotonic() - t0)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def try_exclusive(path: Path) -> Iterator[bool]:
    """Try to take the exclusive `flock` on `path` without waiting: yields True while held, False when another
    process (or another descriptor of this one) holds it. A missing lock file is not created: yields True."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
