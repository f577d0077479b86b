"""Data-parallel training over `torch.distributed` with the objective of the global batch (docs/methods-overview.md).

The batch size of a job is the global batch; each rank trains on its contiguous slice (`shard_bounds`,
`shard_batch`). The convention every helper follows: **every rank computes the value of the global objective
(the single-process loss of the concatenated batch), but its autograd graph reaches only its own slice**:

- `gather_with_local_grad(t)`: the rows of every rank in rank order; the local slice is `t` itself (it keeps its
  graph), the other slices are constants. `cse.models.losses.contrastive_loss` gathers z1/z2/z3 this way and takes
  the `B×B` (`B×2B`) loss of the global batch with global targets on every rank (as SimCSE's DDP code), so the
  backward of rank r gives the full `∂L/∂z_r`;
- `global_mean(total, count)`: a mean over the elements of the global batch (the RTD per-token mean, a
  cross-entropy mean): the value is `Σ_ranks total / Σ_ranks count` on every rank, the gradient the local part
  `∂total_r / Σ count`. Losses built from these two are replicated: the trainer checks that every rank holds
  the same loss value (`check_replicated`), which catches a term still averaged per rank;
- BatchNorm (`convert_batchnorm` → `GlobalBatchNorm1d`): in training, batch statistics over the global batch.
  Their all-reduce sums the statistics' gradients over ranks in the backward, because rank r's graph reaches
  the statistics only through its own rows. (The DiffCSE reference under DDP keeps per-GPU statistics, docs/methods-overview.md;
  here the statistics are those of the single-process run. `torch.nn.SyncBatchNorm` is not used: it refuses
  CPU tensors, so it cannot run under gloo.) Running statistics are updated with the global statistics;
- `all_reduce_gradients(params)`: parameter gradients are SUMMED over ranks (not averaged as DDP does):
  `Σ_r ∂L/∂z_r · ∂z_r/∂θ = ∂L/∂θ`, the gradient of the single-process run on the concatenated batch.

With torch.distributed not initialised (or world size 1) every helper is the identity and nothing changes.
Inside `local_only()` the loss helpers compute per-process values (rank 0 evaluating while the others wait).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

_local_depth = 0
_BUCKET_ELEMENTS = 1 << 24  # gradients are all-reduced in flat buckets of at most this many elements

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


# ------------------------------------------------------------------------------------------------ process group
def initialised() -> bool:
    """Whether a torch.distributed process group is available and initialised.

    Returns:
        True inside an initialised process group.
    """
    return dist.is_available() and dist.is_initialized()


def world() -> int:
    """Number of processes of the job (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if initialised() else 1


def rank() -> int:
    """This process's global rank (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if initialised() else 0


def local_rank() -> int:
    """Rank on this node (torchrun's `LOCAL_RANK`; the global rank otherwise)."""
    return int(os.environ.get("LOCAL_RANK", rank()))


def is_main() -> bool:
    """Whether this process is rank 0 (always true when not distributed).

    Returns:
        True on the main rank.
    """
    return rank() == 0


def is_distributed() -> bool:
    """True when the loss helpers compute the global-batch objective: world > 1 and not inside `local_only()`."""
    return _local_depth == 0 and world() > 1


@contextlib.contextmanager
def local_only() -> Iterator[None]:
    """Per-process losses while active (no collective is issued): for work only some ranks do (evaluation)."""
    global _local_depth
    _local_depth += 1
    try:
        yield
    finally:
        _local_depth -= 1


def barrier() -> None:
    """Wait for all ranks; a no-op with a single process."""
    if world() > 1:
        dist.barrier()


def rank_seed(seed: int, rank_: int, salt: int = 0) -> int:
    """A seed of its own for rank `rank_` > 0 (rank 0 keeps `seed`, so its stream is the single-process one)."""
    if rank_ == 0 and salt == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{rank_}:{salt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _device_of(t: torch.Tensor | None = None) -> torch.device:
    """Where a collective's helper tensors live: CUDA for NCCL, CPU otherwise."""
    if t is not None:
        return t.device
    if initialised() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------------------------------------ batch slicing
def shard_bounds(n: int, rank_: int, world_: int) -> tuple[int, int]:
    """Rows `[start, stop)` of rank `rank_` in a global batch of `n` rows: contiguous, in rank order, sizes
    differing by at most one (the first `n mod world` ranks take one more row), as `torch.tensor_split`."""
    if world_ < 1 or not 0 <= rank_ < world_:
        raise ValueError(f"rank {rank_} of world {world_}")
    q, r = divmod(n, world_)
    start = rank_ * q + min(rank_, r)
    return start, start + q + (1 if rank_ < r else 0)


def shard_batch(batch: T, rank_: int, world_: int) -> T:
    """This rank's contiguous slice of a global batch (a dataclass such as `TrainBatch`): every tensor field
    is cut along dim 0 by `shard_bounds`, a nested batch (`aux`) by its own row count. The padded length `T`
    stays that of the global batch, so per-token means weight every position as the single-process run does."""
    if world_ == 1:
        return batch
    tensors = [getattr(batch, f.name) for f in fields(batch)]
    rows = next(t.shape[0] for t in tensors if isinstance(t, torch.Tensor))
    start, stop = shard_bounds(rows, rank_, world_)
    changes: dict[str, Any] = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            if value.shape[0] != rows:
                raise ValueError(f"{type(batch).__name__}.{f.name} has {value.shape[0]} rows, expected {rows}")
            changes[f.name] = value[start:stop]
        elif value is not None and is_dataclass(value) and not isinstance(value, type):
            changes[f.name] = shard_batch(value, rank_, world_)
    return replace(batch, **changes)


# ------------------------------------------------------------------------------------------------ collectives with autograd
def _row_counts(rows: int, device: torch.device) -> list[int]:
    mine = torch.tensor([rows], dtype=torch.long, device=device)
    counts = [torch.empty_like(mine) for _ in range(world())]
    dist.all_gather(counts, mine)
    return [int(c) for c in counts]


def gather_with_local_grad(t: torch.Tensor) -> torch.Tensor:
    """`t` of every rank concatenated along dim 0 in rank order; the local slice keeps its autograd graph, the
    slices of the other ranks are constants. Ranks may hold different row counts. Identity when not distributed."""
    if not is_distributed():
        return t
    counts = _row_counts(t.shape[0], t.device)
    longest = max(counts)
    buf = t.detach()
    if buf.shape[0] < longest:
        buf = torch.cat([buf, buf.new_zeros((longest - buf.shape[0], *buf.shape[1:]))])
    parts = [torch.empty_like(buf) for _ in counts]
    dist.all_gather(parts, buf.contiguous())
    parts = [p[:n] for p, n in zip(parts, counts)]
    parts[rank()] = t
    return torch.cat(parts)


class _SumLocalGrad(torch.autograd.Function):
    """Σ over ranks in the forward; the backward is the identity (the result feeds a replicated objective)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _SumSumGrad(_SumLocalGrad):
    """Σ over ranks in the forward and in the backward (the result feeds per-rank paths, e.g. BN statistics)."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


def global_mean(total: torch.Tensor, count: torch.Tensor | float) -> torch.Tensor:
    """`Σ_ranks total / max(Σ_ranks count, 1)` on every rank; gradient `∂total / Σ count` on the local graph.
    Not distributed: `total / max(count, 1)`. `total` is a scalar (a local sum), `count` its number of elements."""
    count = torch.as_tensor(count, device=total.device).detach()
    if not is_distributed():
        return total / count.to(total.dtype).clamp_min(1)
    # one all-reduce for both: [Σ total, Σ count] in float64
    summed = _SumLocalGrad.apply(torch.stack([total.to(torch.float64), count.to(torch.float64)]))
    return (summed[0] / summed[1].detach().clamp_min(1)).to(total.dtype)


def global_max(t: torch.Tensor) -> torch.Tensor:
    """The largest value of `t` over the ranks (no gradient); `t` itself when not distributed."""
    if not is_distributed():
        return t
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def global_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """`Σ numerator / max(Σ denominator, 1)` over ranks, without gradient (accuracies)."""
    num, den = numerator.detach().double(), denominator.detach().double()
    if is_distributed():
        both = torch.stack([num, den])
        dist.all_reduce(both)
        num, den = both[0], both[1]
    return (num / den.clamp_min(1)).float()


# ------------------------------------------------------------------------------------------------ BatchNorm
class GlobalBatchNorm1d(nn.BatchNorm1d):
    """`BatchNorm1d` whose training statistics are computed over the global batch of all ranks."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and is_distributed()):
            return super().forward(input)
        self._check_input_dim(input)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        x = input if input.dtype == torch.float64 else input.float()  # statistics in float32 at least
        rows = x.numel() // channels
        sums = _SumSumGrad.apply(torch.cat([x.sum(dims), x.new_tensor([rows])]))
        n = sums[channels].detach()
        shape = [1, channels] + [1] * (input.dim() - 2)
        mean = (sums[:channels] / n).view(shape)
        centred = x - mean
        var = _SumSumGrad.apply((centred * centred).sum(dims)) / n  # biased, used to normalise
        y = centred * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.to(x.dtype).view(shape) + self.bias.to(x.dtype).view(shape)
        if self.track_running_stats:
            tracked, running_mean, running_var = self.num_batches_tracked, self.running_mean, self.running_var
            assert tracked is not None and running_mean is not None and running_var is not None  # tracked: buffers
            with torch.no_grad():
                tracked.add_(1)
                factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
                unbiased = var * (n / (n - 1).clamp_min(1))
                running_mean.mul_(1 - factor).add_(mean.view(-1).to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        return y.to(input.dtype)


def convert_batchnorm(module: nn.Module) -> int:
    """Make every plain `BatchNorm1d` of `module` (the BN-MLP of DiffCSE and D2CSE) a `GlobalBatchNorm1d` in place
    (same parameters, buffers and state-dict keys; the class changes). Outside distributed training the converted
    module computes exactly what it did. Returns the number converted."""
    converted = 0
    for m in module.modules():
        if type(m) is nn.BatchNorm1d:
            m.__class__ = GlobalBatchNorm1d
            converted += 1
    return converted


# ------------------------------------------------------------------------------------------------ gradients, state
def _grad(p: nn.Parameter) -> torch.Tensor:
    """The gradient of a parameter that has one (every live parameter of `all_reduce_gradients`)."""
    assert p.grad is not None
    return p.grad


def all_reduce_gradients(params: Iterable[nn.Parameter]) -> None:
    """SUM every parameter gradient over ranks (in flat buckets). A tensor with a gradient on some rank gets one
    on every rank (zeros where absent); one without a gradient anywhere keeps `grad = None` (AdamW skips it)."""
    if not is_distributed():
        return
    params = list(params)
    if not params:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=_device_of(params[0]))
    dist.all_reduce(has)
    live = []
    for p, flag in zip(params, has.tolist()):
        if flag:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            live.append(p)
    buckets: dict[tuple[torch.device, torch.dtype], list[list[nn.Parameter]]] = {}
    for p in live:
        groups = buckets.setdefault((_grad(p).device, _grad(p).dtype), [[]])
        if groups[-1] and sum(q.numel() for q in groups[-1]) + p.numel() > _BUCKET_ELEMENTS:
            groups.append([])
        groups[-1].append(p)
    for groups in buckets.values():
        for group in groups:
            flat = torch.cat([_grad(p).reshape(-1) for p in group])
            dist.all_reduce(flat)
            offset = 0
            for p in group:
                _grad(p).copy_(flat[offset : offset + p.numel()].view_as(_grad(p)))
                offset += p.numel()


def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Copy every parameter and buffer of rank `src` to the other ranks (identical starting points)."""
    if world() < 2:
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Broadcast a picklable object from rank `src` to all ranks; returned unchanged with a single process.

    Args:
        obj: the object (only the value on `src` matters).
        src: the sending rank.

    Returns:
        The object sent by `src`.
    """
    if world() < 2:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Gather a picklable object from every rank; `[obj]` with a single process.

    Args:
        obj: this rank's object.

    Returns:
        The objects of all ranks, in rank order.
    """
    if world() < 2:
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def check_replicated(value: torch.Tensor, what: str = "loss", rtol: float = 1e-4) -> None:
    """Raise unless every rank holds the same scalar `value` (up to `rtol`): under the global-batch convention
    each loss is the global objective on every rank; a term averaged over the local slice only differs by rank."""
    if world() < 2:
        return
    v = value.detach().double().reshape(1)
    both = torch.cat([v, -v])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = float(both[0]), -float(both[1])
    if abs(high - low) > rtol * max(abs(high), abs(low), 1e-12) and not (math.isnan(high) or math.isnan(low)):
        raise RuntimeError(
            f"the {what} differs across ranks ({low:.8g} … {high:.8g}): some term of the objective is a mean over the "
            "rank's own rows instead of the global batch. Build such terms with cse.models.losses (contrastive_loss, "
            "rtd_loss, cross_entropy_mean) or cse.models.distributed.global_mean so that distributed training computes "
            "the single-process objective (models/distributed.py)"
        )
