"""What the CPU benchmarks record about the machine, and the offline environment they run in (shared by them)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

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
