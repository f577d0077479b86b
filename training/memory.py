"""Peak memory of a region of a training run: CUDA allocations on a GPU, the process's resident set on a CPU.

A region starts with `reset()` and `peak_gb()` reads its peak so far:

- CUDA: `torch.cuda.max_memory_allocated` after `torch.cuda.reset_peak_memory_stats` (the tensors' memory, not
  the allocator's reserve);
- CPU (Linux): VmHWM of /proc/self/status after writing 5 to /proc/self/clear_refs, which resets the high-water
  mark to the current resident set; where that is not allowed, the process's peak since it started
  (`resource.getrusage`), which can only grow.

Examples:
    >>> import torch
    >>> from cse.training.memory import PeakMemory
    >>> probe = PeakMemory(torch.device("cpu"))
    >>> probe.reset()
    >>> probe.peak_gb() > 0
    True
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")


def _can_reset_high_water_mark() -> bool:
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """The peak memory of the region since the last `reset()`, in GiB (see the module docstring for what it counts).

    Args:
        device: the training device; CUDA counts its allocations, every other device the process's resident set.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.resettable = self.cuda or _can_reset_high_water_mark()

    def reset(self) -> None:
        """Start a new region."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            CLEAR_REFS.write_text("5")

    def peak_gb(self) -> float:
        """The region's peak so far, GiB."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.resettable:
            for line in STATUS.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20  # kB
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
        return peak / (2**30 if sys.platform == "darwin" else 2**20)
