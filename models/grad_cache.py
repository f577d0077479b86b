"""Exact gradient caching: the papers' contrastive batch sizes in the memory of a few sentences at a time.

A contrastive loss needs every sentence vector of the batch at once (each is a negative of every other), so gradient
accumulation over micro-batches changes the objective: it loses the other micro-batches' negatives. Gradient caching
(Gao, Zhang, Han and Callan, 2021, *Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup*) keeps
the objective and bounds the memory of the encoder passes by the chunk:

1. each chunk of rows is encoded without keeping its activations, and the random state it started from (CPU and
   CUDA generators: dropout, prefix dropout, MLM masking) is recorded;
2. the batch loss runs on the cached sentence vectors, whole-batch parts included (the BatchNorm MLP of
   DiffCSE/D2CSE sees the whole batch, the contrastive logits every in-batch and hard negative, all-gathered over
   ranks as without the cache), and its backward gives the gradient of every cached vector;
3. when a chunk's gradient arrives, the chunk is encoded again with its random state and autocast state replayed
   (so it draws the same dropout masks) and its gradient is back-propagated into the parameters.

`RowChunks.map` does this with PyTorch's non-reentrant activation checkpoint (`torch.utils.checkpoint`, whose
recomputation replays the recorded random and autocast state) applied to each chunk of a per-row function: the
checkpointed chunk outputs are the cache, and autograd runs step 3 for one chunk at a time during the step's single
backward. One backward per step keeps everything else of the trainer as it is: GradScaler, clipping, the gradient
sum over ranks.

What a method chunks is its per-row work: the encoder passes (the sentence vectors), and the per-token losses that
read those rows (D2CSE/DiffCSE's conditional RTD pass reads the rows' `h`, which enters the chunk as an input so its
gradient flows back to the BatchNorm MLP; DCPCSE's MLM term is summed per chunk and divided by the batch's count of
masked tokens). The result is the gradient of the batch loss under the random draws made: the same function as
without the cache when nothing is random, and with dropout a different, identically distributed draw from a
one-pass batch (a `(B, T, d)` mask is not drawn as the concatenation of per-chunk masks). The tests compare with the
same chunks encoded with their graphs kept (`keep_graph`), which computes the batch loss of the same draws.

Examples:
    >>> import torch
    >>> from cse.models.grad_cache import RowChunks
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> rows = torch.arange(12.0).view(4, 3)
    >>> out = RowChunks(chunk_size=2).map(lambda x: torch.tanh(x * w), rows)
    >>> out.shape
    torch.Size([4, 3])
    >>> out.sum().backward()  # each chunk is re-run when its gradient arrives
    >>> w.grad.shape
    torch.Size([3])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class RowChunks:
    """How a training step runs its per-row passes: whole (`chunk_size` None, the default) or in cached chunks.

    Args:
        chunk_size: rows per chunk; None runs every pass on all rows at once (no cache). A pass over at most
            `chunk_size` rows runs whole.
        replay_random_state: replay each chunk's random state when it is re-encoded (always, in training). False
            exists only for the test that shows the gradients are wrong without it.
        keep_graph: encode the chunks with their graphs kept instead of caching (the reference the exactness tests
            compare with: the same chunks, the same random draws, no cache).
    """

    chunk_size: int | None = None
    replay_random_state: bool = True
    keep_graph: bool = False

    def __post_init__(self) -> None:
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or self.chunk_size < 1):
            raise ValueError(f"grad_cache chunk_size must be a positive number of rows, got {self.chunk_size!r}")

    @property
    def enabled(self) -> bool:
        return self.chunk_size is not None

    def map(self, fn: Callable[..., Any], *rows: torch.Tensor | None, **shared: Any) -> Any:
        """`fn(*rows, **shared)` computed chunk by chunk along the rows' first dimension, outputs concatenated.

        Args:
            fn: a per-row function: row `i` of its outputs depends on row `i` of its inputs only (and on the
                parameters and `shared`). It returns a tensor or a tuple of tensors whose first dimension is the rows,
                or 0-dimensional tensors, which are summed over the chunks (per-chunk sums of a loss).
            rows: tensors with the rows along dimension 0 (None passes through).
            shared: passed to every call unchanged.

        Returns:
            What `fn` returns on all rows: row-wise outputs concatenated, scalar outputs summed.
        """
        n = next(r.shape[0] for r in rows if r is not None)
        if self.chunk_size is None or n <= self.chunk_size:
            return fn(*rows, **shared)
        outs = []
        for start in range(0, n, self.chunk_size):
            part = [None if r is None else r[start : start + self.chunk_size] for r in rows]
            if self.keep_graph or not torch.is_grad_enabled():
                outs.append(fn(*part, **shared))
            else:
                outs.append(
                    checkpoint(fn, *part, use_reentrant=False, preserve_rng_state=self.replay_random_state, **shared)
                )
        if isinstance(outs[0], tuple):
            return tuple(_join([o[i] for o in outs]) for i in range(len(outs[0])))
        return _join(outs)


def _join(parts: list[Any]) -> Any:
    """Row-wise chunk outputs concatenated, scalars summed, None kept."""
    if parts[0] is None:
        return None
    if parts[0].dim() == 0:
        return torch.stack(parts).sum()
    return torch.cat(parts)


NO_CHUNKS = RowChunks()
