"""The corruption generator of this process, loaded once and shared by the corruption shards that run here.

Loading a masked LM costs seconds; a process (the flow's, or a Dask worker) runs many shards of one corruption, so
the `Corruptor` is kept between them. One at a time: other settings replace it, and `release_generators` frees it
when the corruption is published. Safe to call from several threads.

A generator with a `nan`/`inf` weight is refused as it is loaded, before any shard is corrupted, naming the tensors
and rows (`cse.models.finite`): its logits turn NaN and their argmax is token 0, so a corruption replaced tokens by
`[PAD]` and was published with ordinary-looking statistics.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from cse.models.corruption import Corruptor, Mode, SpecialTokens
from cse.models.finite import require_finite_model
from cse.models.loading import load_masked_lm, load_tokenizer

_CORRUPTORS: dict[tuple, Corruptor] = {}
_LOCK = threading.Lock()


def shared_corruptor(
    generator: str,
    tokenizer: str,
    device: str,
    mask_ratio: float,
    mode: Mode,
    bf16: bool,
    dropout: bool,
    all_positions: bool,
    unigram_counts: Sequence[int] | None = None,
    unigram_source: str | None = None,
    hard: bool = False,
) -> Corruptor:
    """The `Corruptor` of these settings, built on the first call in this process and kept for the next ones.

    Args:
        generator: what loads the masked LM (an HF id, a folder; unused with mode unigram).
        tokenizer: the tokenizer whose special tokens are never corrupted.
        device: where the generator runs.
        mask_ratio, mode, bf16, dropout, all_positions: the `Corruptor`'s settings.
        unigram_counts: mode unigram: the token counts drawn from.
        unigram_source: mode unigram: what the counts were counted on (the tokens' content hash), so that other
            counts build another corruptor.
        hard: the generator's best token other than the original (`CorruptConfig.hard`).

    Raises:
        NonFiniteWeights: the generator holds a `nan`/`inf` weight (named with its rows).
    """
    cache_key = (
        generator,
        tokenizer,
        device,
        mask_ratio,
        mode,
        bf16,
        dropout,
        all_positions,
        unigram_source if mode == "unigram" else None,
        hard,
    )
    with _LOCK:
        if cache_key not in _CORRUPTORS:
            _CORRUPTORS.clear()
            tokens = SpecialTokens.from_tokenizer(load_tokenizer(tokenizer))
            model = None if mode == "unigram" else load_masked_lm(generator)
            if model is not None:
                require_finite_model(
                    model,
                    f"generator {generator!r}",
                    "Refused before corrupting (NaN logits pick token 0, [PAD], as every replacement): check or "
                    "replace the generator's weights",
                )
            _CORRUPTORS[cache_key] = Corruptor(
                model,
                tokens,
                mask_ratio,
                mode,
                device=device,
                bf16=bf16,
                dropout=dropout,
                all_positions=all_positions,
                unigram_counts=unigram_counts,
                hard=hard,
            )
        return _CORRUPTORS[cache_key]


def release_generators() -> None:
    """Drop the kept generator (frees its memory)."""
    with _LOCK:
        _CORRUPTORS.clear()
