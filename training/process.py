"""What a training process needs of its surroundings: `compile_cache_usable`.

torch.compile's inductor writes its generated code into a cache folder (`TORCHINDUCTOR_CACHE_DIR`, else
`<tmp>/torchinductor_<user>`). A folder it cannot write (a read-only mount) failed the first step with a read-only
error; the trainer checks it first and trains eagerly, with a warning that names the folder and how to point it
elsewhere.

Examples:
    >>> compile_cache_usable("aot_eager")  # a backend that writes no generated code
    True
"""

from __future__ import annotations

import logging
import os
import uuid

from cse.storage.settings import compile_cache_dir

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
