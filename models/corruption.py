"""Replaced-token corruption with a frozen masked-LM generator (DiffCSE, Chuang et al., 2022; voidism/DiffCSE).

Pure PyTorch + transformers: no Prefect, no MLflow.

1. Masking: non-special, non-pad tokens are selected with probability `mask_ratio`; of the selected,
   80 % become [MASK], 10 % a random id uniform over the vocabulary, 10 % stay unchanged.
2. Replacement: the generator predicts the selected positions, by argmax (the reference code) or by
   sampling from its softmax (the paper text), over every token or, with `hard`, over every token but the original
   (so each predicted position is replaced); or, with no generator (mode "unigram", a cheap contrast), a token
   drawn from the corpus's unigram frequencies replaces each selected position.
3. Labels: 1 where the corrupted id differs from the original (0 on pads).

Difference from the reference: it takes G's argmax at *every* position and then restores position 0
and the pads; by default G's logits are computed here only at the selected positions and every other
position keeps its original id (about 3x cheaper). Both agree on [CLS] and pads; they differ only where
G would rewrite an unselected token (rare for a pretrained G; [SEP] is then never flagged here).
`all_positions=True` (`CorruptConfig.positions = "all"`) does what the reference does.

Every random draw comes from an explicit `torch.Generator` on the CPU, so a seed gives the same
selection on any device. `corrupt_sequences` draws per token in input order, which makes the draws
independent of batch size and of the length sorting (generator numerics may still differ in the
last bits between batch shapes or devices).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Mode = Literal["argmax", "sample", "unigram"]
MASK_SHARE = 0.8  # of the selected tokens: [MASK]
RANDOM_SHARE = 0.1  # of the selected tokens: a random id (the remaining 0.1 stay unchanged)


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids the corruption needs. `special` are never selected; random ids are drawn from [0, vocab_size)."""

    pad: int
    mask: int
    special: tuple[int, ...]
    vocab_size: int

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> SpecialTokens:
        ids = {tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id, *tokenizer.all_special_ids}
        ids.discard(None)
        if tokenizer.mask_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r} has no [MASK] or pad token: it cannot drive an MLM generator"
            )
        return cls(
            pad=tokenizer.pad_token_id,
            mask=tokenizer.mask_token_id,
            special=tuple(sorted(ids)),
            vocab_size=len(tokenizer),
        )


@dataclass
class Noise:
    """Random draws per token position (any shape, all alike).

    select < mask_ratio selects a token; action < 0.8 → [MASK], < 0.9 → random_ids, else unchanged;
    sample (modes "sample" and "unigram") is the uniform of inverse-CDF sampling from G's softmax or the unigram.
    """

    select: torch.Tensor
    action: torch.Tensor
    random_ids: torch.Tensor
    sample: torch.Tensor | None

    @classmethod
    def draw(cls, shape: Sequence[int], vocab_size: int, generator: torch.Generator | None, with_sample: bool) -> Noise:
        shape = tuple(shape)
        select = torch.rand(shape, generator=generator)
        action = torch.rand(shape, generator=generator)
        random_ids = torch.randint(vocab_size, shape, generator=generator)
        sample = torch.rand(shape, generator=generator) if with_sample else None
        return cls(select, action, random_ids, sample)

    def take(self, index: torch.Tensor) -> Noise:
        """Gather the draws of flat positions `index` (any shape) from a 1-D Noise."""
        return Noise(
            self.select[index],
            self.action[index],
            self.random_ids[index],
            None if self.sample is None else self.sample[index],
        )


def candidate_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor, tokens: SpecialTokens) -> torch.Tensor:
    """True where a token may be selected: not padding and not a special token."""
    special = torch.tensor(tokens.special, dtype=input_ids.dtype, device=input_ids.device)
    return attention_mask.bool() & ~torch.isin(input_ids, special)


def mask_tokens(
    input_ids: torch.Tensor, candidates: torch.Tensor, noise: Noise, mask_ratio: float, tokens: SpecialTokens
) -> tuple[torch.Tensor, torch.Tensor]:
    """(generator input, selected): BERT's 80/10/10 masking of the selected candidates."""
    selected = candidates & (noise.select < mask_ratio)
    to_mask = selected & (noise.action < MASK_SHARE)
    to_random = selected & (noise.action >= MASK_SHARE) & (noise.action < MASK_SHARE + RANDOM_SHARE)
    masked = input_ids.masked_fill(to_mask, tokens.mask)
    masked = torch.where(to_random, noise.random_ids.to(masked.dtype), masked)
    return masked, selected


def mlm_head(model: PreTrainedModel) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The head mapping final hidden states to vocabulary logits, or None for an unknown architecture."""
    if all(hasattr(model, n) for n in ("vocab_transform", "activation", "vocab_layer_norm", "vocab_projector")):
        part = model.get_submodule  # DistilBertForMaskedLM: the head is four submodules of the model itself
        return lambda h: part("vocab_projector")(
            part("vocab_layer_norm")(part("activation")(part("vocab_transform")(h)))
        )
    if hasattr(model, "cls") and hasattr(model.cls, "predictions"):  # BertForMaskedLM
        return model.get_submodule("cls")
    if hasattr(model, "lm_head"):  # RobertaForMaskedLM and relatives
        return model.get_submodule("lm_head")
    return None


def logits_at(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, selected: torch.Tensor
) -> torch.Tensor:
    """G's logits at the selected positions only, shape (n_selected, vocab).

    The base model runs on the whole batch; the MLM head only on the selected rows. An unknown head
    falls back to the full forward pass.
    """
    head = mlm_head(model)
    if head is None or model.base_model is model:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[selected]
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask)[0]
    return head(hidden[selected])


def pick_tokens(logits: torch.Tensor, mode: Mode, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Replacement ids: argmax, or a draw from softmax(logits) by inverse CDF with the given uniforms."""
    if mode == "argmax":
        return logits.argmax(-1)
    if uniform is None:
        raise ValueError("mode 'sample' needs uniform draws (Noise.draw(..., with_sample=True))")
    cdf = torch.softmax(logits.float(), dim=-1).cumsum(-1)
    u = (uniform.to(cdf.device, cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(logits.size(-1) - 1)


@dataclass
class CorruptedBatch:
    """Corruption of a padded batch (CPU tensors): ids and labels (B, T); counts (B,)."""

    corrupted: torch.Tensor
    labels: torch.Tensor
    n_masked: torch.Tensor
    n_replaced: torch.Tensor


def unigram_cdf(counts: np.ndarray | Sequence[int], vocab_size: int) -> torch.Tensor:
    """The cumulative distribution (float64, length `vocab_size`) of token frequencies `counts` (special ids 0)."""
    c = torch.as_tensor(np.asarray(counts, dtype=np.float64))
    if c.ndim != 1 or len(c) != vocab_size:
        raise ValueError(f"unigram counts must be one count per token id ({vocab_size}), got shape {tuple(c.shape)}")
    if (c < 0).any() or c.sum() <= 0:
        raise ValueError("unigram counts must be non-negative with a positive total (no non-special token counted?)")
    return c.cumsum(0)


class Corruptor:
    """A frozen MLM generator plus the masking settings; call it on padded CPU batches.

    Mode "unigram" takes no model (`model=None`) but `unigram_counts` (one count per token id): each selected
    position is replaced by a token drawn from those frequencies."""

    def __init__(
        self,
        model: PreTrainedModel | None,
        tokens: SpecialTokens,
        mask_ratio: float,
        mode: Mode = "argmax",
        device: torch.device | str = "cpu",
        bf16: bool = True,
        dropout: bool = False,
        all_positions: bool = False,
        unigram_counts: np.ndarray | Sequence[int] | None = None,
        hard: bool = False,
    ):
        if not 0.0 < mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must lie in (0, 1), got {mask_ratio}")
        if mode not in ("argmax", "sample", "unigram"):
            raise ValueError(f"mode must be 'argmax', 'sample' or 'unigram', got {mode!r}")
        self.device = torch.device(device)
        self.unigram: torch.Tensor | None = None
        if mode == "unigram":
            if model is not None or unigram_counts is None or all_positions:
                raise ValueError(
                    "mode 'unigram' takes unigram_counts and no generator model, and only the masked positions"
                )
            if hard:
                raise ValueError(
                    "hard corruption removes the generator's original-token logit: mode 'unigram' has none"
                )
            self.unigram = unigram_cdf(unigram_counts, tokens.vocab_size)
            self.model: PreTrainedModel | None = None
        else:
            if model is None:
                raise ValueError(f"mode {mode!r} needs a generator model")
            vocab = model.config.vocab_size
            if vocab < tokens.vocab_size:
                raise ValueError(
                    f"generator vocabulary ({vocab}) is smaller than the tokenizer's ({tokens.vocab_size})"
                )
            self.model = model.to(self.device).train(dropout)  # type: ignore[arg-type]  # PreTrainedModel.to is a functools.wraps wrapper: its stub binds no self
        self.tokens, self.mask_ratio, self.mode = tokens, mask_ratio, mode
        self.autocast = self.device.type == "cuda" and bf16
        self.all_positions = all_positions  # the reference: G rewrites every real position but 0 (see the module doc)
        self.hard = hard  # the generator's best token other than the original (CorruptConfig.hard)

    def draw_noise(self, shape: Sequence[int], generator: torch.Generator | None) -> Noise:
        return Noise.draw(shape, self.tokens.vocab_size, generator, with_sample=self.mode in ("sample", "unigram"))

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        noise: Noise | None = None,
        generator: torch.Generator | None = None,
    ) -> CorruptedBatch:
        """Corrupt a padded (B, T) batch. `noise` defaults to fresh draws from `generator`."""
        if noise is None:
            noise = self.draw_noise(input_ids.shape, generator)
        candidates = candidate_mask(input_ids, attention_mask, self.tokens)
        masked, selected = mask_tokens(input_ids, candidates, noise, self.mask_ratio, self.tokens)
        corrupted = input_ids.clone()
        predict = selected
        if self.all_positions:  # every real token but position 0 ([CLS] is restored, pads stay pads)
            predict = attention_mask.bool().clone()
            predict[:, 0] = False
        if self.unigram is not None:
            if predict.any():
                assert noise.sample is not None  # the unigram mode draws its noise with a sample (draw_noise)
                u = noise.sample[predict].to(torch.float64) * self.unigram[-1]
                drawn = torch.searchsorted(self.unigram, u, right=True)
                corrupted[predict] = drawn.clamp_max(len(self.unigram) - 1).to(corrupted.dtype)
        elif predict.any():
            dev_sel = predict.to(self.device, non_blocking=True)
            assert self.model is not None  # every mode but "unigram" has its generator
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                logits = logits_at(
                    self.model,
                    masked.to(self.device, non_blocking=True),
                    attention_mask.to(self.device, non_blocking=True),
                    dev_sel,
                )
            logits = logits[:, : self.tokens.vocab_size]
            if self.hard:  # never the original token: its logit removed before the pick
                original = input_ids[predict].to(logits.device)
                logits = logits.scatter(1, original.unsqueeze(1), float("-inf"))
            uniform = None if noise.sample is None else noise.sample[predict]
            corrupted[predict] = pick_tokens(logits, self.mode, uniform).cpu().to(corrupted.dtype)
        labels = (corrupted != input_ids) & attention_mask.bool()
        return CorruptedBatch(
            corrupted=corrupted, labels=labels.to(torch.int8), n_masked=selected.sum(1), n_replaced=labels.sum(1)
        )


@dataclass
class SequenceCorruption:
    """Corruption of variable-length sequences, flat in input order (same offsets as the input)."""

    corrupted: np.ndarray  # int64, concatenated sequences
    labels: np.ndarray  # int8
    n_masked: np.ndarray  # per sequence
    n_replaced: np.ndarray


def pad_batch(
    flat_ids: torch.Tensor, offsets: np.ndarray, rows: np.ndarray, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded (B, T) ids of the given rows, their attention mask, and the flat index of each cell (0 on pads)."""
    lengths = offsets[rows + 1] - offsets[rows]
    width = int(lengths.max()) if len(rows) else 0
    steps = np.arange(width)
    valid = steps[None, :] < lengths[:, None]
    index = torch.from_numpy(np.where(valid, offsets[rows][:, None] + steps[None, :], 0))
    valid_t = torch.from_numpy(valid)
    return flat_ids[index].masked_fill(~valid_t, pad_id), valid_t.long(), index


def corrupt_sequences(
    corruptor: Corruptor,
    flat_ids: np.ndarray,
    offsets: np.ndarray,
    generator: torch.Generator,
    batch_size: int,
    on_batch: Callable[[int], None] | None = None,
) -> SequenceCorruption:
    """Corrupt sequences given flat (concatenated ids, offsets of length n+1).

    Noise is drawn for every token in input order first; batches of `batch_size` sequences sorted by
    length (longest first) are padded to their own maximum; results come back in input order.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    flat = torch.from_numpy(np.ascontiguousarray(flat_ids, dtype=np.int64))
    n = len(offsets) - 1
    noise = corruptor.draw_noise((len(flat),), generator)
    order = np.argsort(-np.diff(offsets), kind="stable")
    out = SequenceCorruption(
        corrupted=flat.numpy().copy(),
        labels=np.zeros(len(flat), np.int8),
        n_masked=np.zeros(n, np.int64),
        n_replaced=np.zeros(n, np.int64),
    )
    for start in range(0, n, batch_size):
        rows = order[start : start + batch_size]
        input_ids, attention, index = pad_batch(flat, offsets, rows, corruptor.tokens.pad)
        batch = corruptor(input_ids, attention, noise=noise.take(index))
        valid = attention.bool()
        positions = index[valid].numpy()
        out.corrupted[positions] = batch.corrupted[valid].numpy()
        out.labels[positions] = batch.labels[valid].numpy()
        out.n_masked[rows] = batch.n_masked.numpy()
        out.n_replaced[rows] = batch.n_replaced.numpy()
        if on_batch is not None:
            on_batch(len(rows))
    return out


@contextmanager
def _seeded_dropout(seed: int, device: torch.device, enabled: bool) -> Iterator[None]:
    """Seed torch's global RNG (the generator's dropout) for one variant, restoring it afterwards."""
    if not enabled:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def corrupt_variants(
    corruptor: Corruptor,
    flat_ids: np.ndarray,
    offsets: np.ndarray,
    seeds: Sequence[int],
    batch_size: int,
    seeded_dropout: bool = False,
    on_batch: Callable[[int], None] | None = None,
) -> list[SequenceCorruption]:
    """Several independent corruptions (variants) of the same sequences, one per seed: `corrupt_sequences` with
    draws from `torch.Generator().manual_seed(seed)`.

    Args:
        corruptor: the generator and masking settings.
        flat_ids: the concatenated token ids of the sequences.
        offsets: where each sequence starts in `flat_ids` (length n + 1).
        seeds: one seed per variant (the variant's bytes depend only on its seed).
        batch_size: sequences per generator batch.
        seeded_dropout: also seed torch's global RNG with the variant's seed while it runs (a generator run with
            dropout on), restoring it afterwards.
        on_batch: called with the number of sequences of each batch done (a progress bar).
    """
    out = []
    for seed in seeds:
        with _seeded_dropout(seed, corruptor.device, seeded_dropout):
            out.append(
                corrupt_sequences(
                    corruptor, flat_ids, offsets, torch.Generator().manual_seed(seed), batch_size, on_batch=on_batch
                )
            )
    return out
