"""Embedding a list of sentences once: length-sorted batches, inference mode, fp32 unless TF32 matmuls or bf16 autocast
are asked for.

The embedder's module modes (train/eval of every submodule) are restored afterwards, so a training
loop can call this on its live model.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from cse.models.batching import pad_sequences
from cse.models.embedder import SentenceEmbedder

PRECISIONS = ("auto", "fp32", "tf32", "bf16")


class NonFiniteEmbeddings(ValueError):
    """A model gave `nan`/`inf` embeddings: the evaluation is refused rather than scoring them (a cosine of a non-finite
    vector would silently become 0). `rows` are the indices of the sentences affected."""

    def __init__(self, rows: Sequence[int], total: int, sentences: Sequence[str] | None = None, what: str = ""):
        self.rows, self.total = list(rows), total
        shown = ", ".join(
            f"#{i} {_cut(sentences[i])!r}" if sentences is not None else f"#{i}" for i in self.rows[:EXAMPLES]
        )
        super().__init__(
            f"{len(self.rows):,d} of {total:,d} sentences{f' of {what}' if what else ''} have non-finite (nan/inf) "
            f"embeddings (first: {shown}): the evaluation is refused, not scored as cosine 0. A weight of the model "
            "is non-finite (e.g. an embedding row of a token the training rows never hold) or it diverged"
        )


EXAMPLES = 3  # sentences a `NonFiniteEmbeddings` message shows


def _cut(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[:limit]}…"


@dataclass
class EncodeStats:
    """What one embedding pass did: sentences, tokens, batches and wall seconds."""

    sentences: int
    tokens: int
    batches: int
    seconds: float

    @property
    def sentences_per_s(self) -> float:
        """Throughput of the pass."""
        return self.sentences / max(self.seconds, 1e-9)


def autocast_context(device: torch.device, precision: str) -> contextlib.AbstractContextManager[object]:
    """The arithmetic of an evaluation precision, for the duration of the context.

    `fp32` (the default everywhere, as the reference code evaluates): no autocast; `tf32`: fp32 tensors, matmuls and
    convolutions on TF32 tensor cores (`torch.backends.{cuda.matmul,cudnn}.allow_tf32`; no effect on a CPU); `bf16`
    forces autocast; `auto`: bf16 on CUDA. `benchmarks/gpu_speed.py` checks on a GPU whether tf32 and bf16 keep the
    seven STS scores within ±0.01 of fp32's.

    Args:
        device: the device the embedder runs on.
        precision: one of `PRECISIONS`.

    Raises:
        ValueError: an unknown precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "tf32":
        return _tf32()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _tf32() -> Iterator[None]:
    """TF32 matmuls and convolutions while active; the previous settings after."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length, longest first (memory errors surface early).

    Args:
        lengths: the token count of every sentence.
        batch_size: sentences per batch.

    Examples:
        >>> from cse.evaluation.encode import length_sorted_batches
        >>> length_sorted_batches([3, 9, 5, 9], batch_size=2)
        [[1, 3], [2, 0]]
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def pad_batch(ids: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded `input_ids` and `attention_mask` (int64) for one batch.

    Args:
        ids: the token ids of each sentence.
        pad_id: the tokenizer's pad id.

    Examples:
        >>> from cse.evaluation.encode import pad_batch
        >>> ids, mask = pad_batch([[101, 7, 102], [101, 102]], pad_id=0)
        >>> ids.tolist(), mask.tolist()
        ([[101, 7, 102], [101, 102, 0]], [[1, 1, 1], [1, 1, 0]])
    """
    return pad_sequences(ids, pad_id)


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Switch every submodule to `eval()` and restore each one's previous mode afterwards.

    Args:
        module: the model; a training loop can pass its live model.
    """
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, was in modes:
            m.train(was)


class DeviceBatches:
    """Padded batches kept on the device between calls: a dev set evaluated every few hundred training steps is
    padded and copied once, not at every evaluation (`Evaluator` keeps one per embedder).

    Entries are keyed by the token-id list object, the batch size and the device; an entry remembers its list, so a
    new list that happens to reuse a freed list's id is never served the old batches.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[Sequence, list[tuple[list[int], Tensor, Tensor]]]] = {}

    def batches(
        self, token_ids: Sequence[Sequence[int]], batch_size: int, pad_id: int, device: torch.device
    ) -> list[tuple[list[int], Tensor, Tensor]]:
        """(indices, ids, mask) of each length-sorted batch of `token_ids`, on `device` (built on the first call)."""
        key = (id(token_ids), batch_size, pad_id, str(device))
        hit = self._entries.get(key)
        if hit is not None and hit[0] is token_ids:
            return hit[1]
        built = []
        for idx in length_sorted_batches([len(x) for x in token_ids], batch_size):
            ids, mask = pad_batch([token_ids[i] for i in idx], pad_id)
            built.append((idx, ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)))
        self._entries[key] = (token_ids, built)
        return built


def check_run(embedder: object, precision: str) -> None:
    """The checks of an evaluator's run: a `SentenceEmbedder` and one of `PRECISIONS`.

    Args:
        embedder: what the run was given to score.
        precision: the precision it was asked for.

    Raises:
        TypeError: `embedder` is not a `SentenceEmbedder`.
        ValueError: an unknown precision.
    """
    if not isinstance(embedder, SentenceEmbedder):
        raise TypeError(f"expected a cse.models.embedder.SentenceEmbedder, got {type(embedder).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")


def cached_token_ids(
    cache: weakref.WeakKeyDictionary, embedder: SentenceEmbedder, key: tuple, sentences: list[str]
) -> list[list[int]]:
    """`embedder.token_ids(sentences)`, kept in `cache` (embedder → {key: ids}) under the key of the evaluator's plan:
    an evaluator run again on the same model (a dev set every few hundred training steps) tokenises nothing."""
    per = cache.setdefault(embedder, {})
    if key not in per:
        per[key] = embedder.token_ids(sentences)
    return per[key]


def embed_token_ids(
    embedder: SentenceEmbedder,
    token_ids: Sequence[Sequence[int]],
    *,
    batch_size: int = 128,
    precision: str = "fp32",
    progress: bool = False,
    desc: str = "embedding",
    device_cache: DeviceBatches | None = None,
    sentences: Sequence[str] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[Tensor, EncodeStats]:
    """`[N, d]` float32 CPU embeddings of pre-tokenised sentences, in input order; every value finite.

    Args:
        embedder: the model (any `cse.models.embedder.SentenceEmbedder`).
        token_ids: the token ids of each sentence (none may be empty).
        batch_size: sentences per batch.
        precision: one of `PRECISIONS`.
        progress: show a progress bar.
        desc: the progress bar's label.
        device_cache: keep the padded batches on the device for the next call with the same `token_ids` list.
        sentences: the sentences `token_ids` came from, quoted by a `NonFiniteEmbeddings` error.
        on_progress: called after each batch with (sentences embedded so far, all sentences).

    Returns:
        The embeddings and the pass's `EncodeStats`.

    Raises:
        ValueError: no sentences, an empty one, or an embedding of the wrong shape.
        NonFiniteEmbeddings: an embedding holds `nan` or `inf` (naming how many and the first sentences).
    """
    n = _count(token_ids)
    device = embedder.device
    pad_id = embedder.pad_token_id
    t0 = time.perf_counter()
    batches: list[tuple[list[int], Tensor | None, Tensor | None]]
    if device_cache is not None:
        batches = list(device_cache.batches(token_ids, batch_size, pad_id, device))
    else:
        batches = [(idx, None, None) for idx in length_sorted_batches([len(x) for x in token_ids], batch_size)]
    with (
        eval_mode(embedder),
        torch.inference_mode(),
        autocast_context(device, precision),
        tqdm(total=n, desc=desc, unit="sent", disable=not progress, mininterval=1.0) as bar,
    ):
        parts, done = [], 0
        for idx, input_ids, mask in batches:
            parts.append((idx, _embed_batch(embedder, token_ids, idx, input_ids, mask)))
            bar.update(len(idx))
            done += len(idx)
            if on_progress is not None:
                on_progress(done, n)
        out = _in_input_order(parts, n)
    if not bool(torch.isfinite(out).all()):
        bad = (~torch.isfinite(out)).any(dim=1).nonzero().flatten().tolist()
        raise NonFiniteEmbeddings(bad, n, sentences, desc)
    seconds = time.perf_counter() - t0
    return out, EncodeStats(sentences=n, tokens=sum(len(x) for x in token_ids), batches=len(batches), seconds=seconds)


def _count(token_ids: Sequence[Sequence[int]]) -> int:
    """How many sentences `token_ids` holds; refused when none, or when one is empty."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("nothing to embed: no sentences")
    empty = [i for i, x in enumerate(token_ids) if len(x) == 0]
    if empty:
        raise ValueError(f"{len(empty)} sentences tokenised to zero tokens (first index {empty[0]})")
    return n


def _embed_batch(
    embedder: SentenceEmbedder,
    token_ids: Sequence[Sequence[int]],
    idx: list[int],
    input_ids: Tensor | None,
    mask: Tensor | None,
) -> Tensor:
    """One batch's float embeddings, still on the device (padded here unless the batch came padded).

    Args:
        embedder: the model.
        token_ids: every sentence's token ids.
        idx: the batch's sentence indices.
        input_ids: the batch's padded ids, or None to pad them here.
        mask: its attention mask (None with `input_ids`).
    """
    if input_ids is None or mask is None:
        input_ids, mask = pad_batch([token_ids[i] for i in idx], embedder.pad_token_id)
    device = embedder.device
    emb = embedder.embed(input_ids.to(device, non_blocking=True), mask.to(device, non_blocking=True))
    if emb.dim() != 2 or emb.shape[0] != len(idx):
        raise ValueError(f"{type(embedder).__name__}.embed returned shape {tuple(emb.shape)}, expected [{len(idx)}, d]")
    return emb.float()  # (copied to the host at the end: one wait, not one per batch)


def _in_input_order(parts: list[tuple[list[int], Tensor]], n: int) -> Tensor:
    """`[n, d]` float32 CPU embeddings from each batch's (indices, embeddings).

    Args:
        parts: the batches' sentence indices and embeddings.
        n: the number of sentences.
    """
    out = torch.empty((n, parts[0][1].shape[1]), dtype=torch.float32)
    for idx, emb in parts:
        out[torch.as_tensor(idx)] = emb.cpu()
    return out


def embed_sentences(
    embedder: SentenceEmbedder,
    sentences: Sequence[str],
    **kwargs: Any,
) -> tuple[Tensor, EncodeStats]:
    """Tokenise with the embedder's own `token_ids`, then `embed_token_ids`.

    Args:
        embedder: the model.
        sentences: the sentences to embed.
        **kwargs: passed to `embed_token_ids`.

    Examples:
        ```python
        from cse.evaluation.encode import embed_sentences
        from cse.models.embedder import PooledEncoder

        encoder = PooledEncoder.from_pretrained("packaged:minilm", "avg")
        emb, stats = embed_sentences(encoder, ["a man is playing a guitar ."])   # emb: [1, 384]
        ```
    """
    sentences = list(sentences)
    return embed_token_ids(embedder, embedder.token_ids(sentences), sentences=sentences, **kwargs)
