"""What the benchmarks record about the machine, the offline environment they run in, and the small helpers they
share (timing on a device, returning freed heap, the STS evaluator over the local data mirror)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# The local mirror of the canonical sources (as `cse.storage.settings` reads it: CSE_SHARED_DATA, else ../shared/data).
SHARED_DATA = Path(os.environ.get("CSE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data")).resolve()

OFFLINE_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
}


def set_offline_environment() -> None:
    """No hub downloads, no analytics, no tokenizer threads, no system metrics (values already set are kept)."""
    for key, value in OFFLINE_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def sync(device) -> None:
    """Wait for the device's queued work (CUDA; a no-op elsewhere), so that a wall time covers it."""
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def timed(fn, device=None) -> float:
    """Wall seconds of `fn()`, synchronised with `device` before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def quiet_trainer(model, data, loop, device, state: Path, hooks=()):
    """The real `cse.training.loop.Trainer` keeping no best checkpoint, scoring dev 0.0 and logging nothing."""
    from cse.training.loop import Trainer

    return Trainer(model, data, loop, device, state, lambda *a: None, lambda m: 0.0, lambda *a: None, hooks=hooks)


def release_freed_heap() -> None:
    """Collect garbage and return the heap glibc keeps resident after frees (`malloc_trim(0)`; no-op without glibc)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def sts_evaluator():
    """An `Evaluator` over the STS tasks, ingested from the local data mirror into the data root of CSE_HOME."""
    from cse.config.stages import local_mirror_ingest
    from cse.evaluation.evaluator import Evaluator
    from cse.storage.evaluations import load_sts_input
    from cse.storage.layout import DataRoot
    from cse.storage.settings import get_settings
    from cse.tasks.ingest import ingest_dataset

    sts = ingest_dataset.fn("sts", local_mirror_ingest(SHARED_DATA))
    return Evaluator(load_sts_input(sts.key, DataRoot(get_settings().data_root)).table)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else platform's processor string)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def cpu_environment(**extra: Any) -> dict[str, Any]:
    """Library versions, torch's thread counts and the CPU of a benchmark run on CPU, plus `extra`."""
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": "cpu",
        "platform": platform.platform(),
        **extra,
    }


def subject_method(benchmark: str):
    """The registered method a single-method benchmark measures: the one whose `benchmark_subject_of`
    (benchmarks/facts.py) lists `benchmark`.

    Args:
        benchmark: the benchmark's module name, e.g. "training_throughput".
    """
    from benchmarks.facts import facts
    from cse.config.methods import REGISTRY

    found = [s for s in REGISTRY.values() if benchmark in facts(s.name).benchmark_subject_of]
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} registered methods name {benchmark!r} in benchmark_subject_of; expected one")
    return found[0]


def _portable(arg: str) -> str:
    """`arg` (or the value of `--opt=arg`) with a path under the checkout or the shared data written relative to the
    checkout (`benchmarks/results/x.json`, `../shared/data/senteval`): a recorded command names no path of the machine
    it ran on that a reader's checkout has elsewhere."""
    opt, eq, value = arg.partition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
    path = Path(value)
    if path.is_absolute():
        # each root resolved on its own: ../shared may be a link to a folder elsewhere (still `../shared/...`)
        for root, shown in ((REPO_ROOT, Path()), (REPO_ROOT.parent / "shared", Path("..", "shared"))):
            if path.resolve().is_relative_to(root.resolve()):
                value = str(shown / path.resolve().relative_to(root.resolve()))
                break
    return f"{opt}{eq}{value}"


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command a benchmark records: `python -m <module>` and its arguments (`argv`, else this process's), paths
    inside the checkout or the shared data relative to the checkout.

    Example:
        >>> command_line("benchmarks.learning", ["--out", str(REPO_ROOT / "benchmarks" / "results" / "l.json")])
        'python -m benchmarks.learning --out benchmarks/results/l.json'
    """
    args = sys.argv[1:] if argv is None else argv
    return " ".join([f"python -m {module}", *(_portable(a) for a in args)])
