"""What a training process needs of its surroundings, checked or set up in one call each.

- `compile_cache_usable`: torch.compile's inductor writes its generated code into a cache folder
  (`TORCHINDUCTOR_CACHE_DIR`, else `<tmp>/torchinductor_<user>`). A folder it cannot write (a read-only mount) failed
  the first step with a read-only error; the trainer now checks it first and trains eagerly, with a warning that names
  the folder and how to point it elsewhere.
- `hangup_as_termination`: SIGHUP (a closed terminal, `kill -HUP`) ends a process at once by default, without any
  cleanup: a worker died silently and its flow runs' MLflow runs were left FAILED. Handled as SIGTERM instead (Prefect's
  handler: a worker shuts down its flow runs, a flow run ends its job's MLflow run KILLED).

Examples:
    >>> import os, tempfile
    >>> os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
    >>> compile_cache_usable("inductor")
    True
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import uuid

from cse.config.settings import compile_cache_dir

log = logging.getLogger(__name__)

CACHE_BACKENDS = ("inductor",)  # the torch.compile backends that write generated code into the compile cache


def compile_cache_usable(backend: str) -> bool:
    """Whether torch.compile with `backend` can write its cache: a probe file is created and removed in the cache
    folder (made when missing). When it cannot, a warning names the folder, why, and how to point it elsewhere, and
    False is returned (the caller trains eagerly). Backends that write no generated code always can.

    Args:
        backend: the torch.compile backend (`LoopConfig.compile_backend`).
    """
    if backend not in CACHE_BACKENDS:
        return True
    folder = compile_cache_dir()
    probe = folder / f".cse-write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        log.warning(
            "the torch.compile cache %s (TORCHINDUCTOR_CACHE_DIR) cannot be written (%s): training eagerly, "
            "without torch.compile; point TORCHINDUCTOR_CACHE_DIR at a writable folder to compile",
            folder,
            e.strerror or e,
        )
        return False
    return True


_FORWARDING = False  # whether this process's SIGHUP is already forwarded as SIGTERM


def _hangup(signum, frame) -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # whatever SIGTERM does now (Prefect's handler, or the default end)


def hangup_as_termination() -> bool:
    """Handle SIGHUP as SIGTERM in this process from now on: the handler sends the process SIGTERM, so whichever
    SIGTERM handler is in place then (Prefect's worker or flow engine, or the default) acts. Only the main thread can
    set a handler; elsewhere (and on a platform without SIGHUP) nothing is done. A SIGHUP that is ignored (`nohup`)
    stays ignored. Returns whether SIGHUP is now forwarded."""
    global _FORWARDING
    if _FORWARDING:
        return True
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        return False
    signal.signal(signal.SIGHUP, _hangup)
    _FORWARDING = True
    return True
