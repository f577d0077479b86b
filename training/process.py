"""What a training process needs of its surroundings: `use_compile_cache`.

torch.compile keeps persistent caches (inductor's FX-graph cache, AOTAutograd's cache, autotuning results, Triton
kernels) in one folder, `cse.storage.settings.compile_cache_dir()`: `TORCHINDUCTOR_CACHE_DIR`, else
`$CSE_HOME/compile-cache`. The trainer exports that folder to torch and turns both graph caches on (unless their own
variables say otherwise), so the warm-up of a preset is paid once per node: a second run of it loads the compiled
graphs instead of generating them. A folder it cannot write (a read-only mount) failed the first step with a read-only
error; the trainer checks it first and trains eagerly, with a warning that names the folder and how to point it
elsewhere.

Examples:
    >>> use_compile_cache("aot_eager")  # a backend that writes no generated code
    True
"""

from __future__ import annotations

import logging
import os
import uuid

from cse.storage.settings import compile_cache_dir

log = logging.getLogger(__name__)

CACHE_BACKENDS = ("inductor",)  # the torch.compile backends that write generated code into the compile cache
# torch's switches of its two persistent graph caches: (environment variable, config module, attribute)
GRAPH_CACHES = (
    ("TORCHINDUCTOR_FX_GRAPH_CACHE", "torch._inductor.config", "fx_graph_cache"),
    ("TORCHINDUCTOR_AUTOGRAD_CACHE", "torch._functorch.config", "enable_autograd_cache"),
)


def use_compile_cache(backend: str) -> bool:
    """Prepare torch.compile's persistent cache for `backend`: a probe file is created and removed in the cache folder
    (made when missing); when that works, the folder is exported as `TORCHINDUCTOR_CACHE_DIR` and the FX-graph and
    AOTAutograd caches are turned on (where their variables are unset). When it cannot be written, a warning names
    the folder, why, and how to point it elsewhere, and False is returned (the caller trains eagerly). Backends that
    write no generated code always can.

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
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)  # (inductor reads the variable whenever it opens its cache)
    import importlib

    for variable, module, name in GRAPH_CACHES:
        if not os.environ.get(variable):
            setattr(importlib.import_module(module), name, True)
    return True
