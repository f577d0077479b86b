"""models/corruption.py on real Wiki1M sentences with the tiny random DistilBERT generator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cse.models.corruption import (
    Corruptor,
    Noise,
    SpecialTokens,
    candidate_mask,
    corrupt_sequences,
    logits_at,
    mask_tokens,
    mlm_head,
    pad_batch,
    pick_tokens,
)
from cse.models.loading import load_masked_lm


@pytest.fixture(scope="module")
def wiki_ids(tokenizer, shared_data) -> list[list[int]]:
    lines = (shared_data / "wiki1m_head.txt").read_text(encoding="utf-8").splitlines()[:2000]
    return tokenizer(lines, truncation=True, max_length=32)["input_ids"]


@pytest.fixture(scope="module")
def special(tokenizer) -> SpecialTokens:
    return SpecialTokens.from_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def generator(tiny_generator_dir):
    return load_masked_lm(str(tiny_generator_dir)).eval()


def _flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    return np.concatenate(seqs).astype(np.int64), offsets


def _padded(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat, offsets = _flat(seqs)
    ids, attention, _ = pad_batch(torch.from_numpy(flat), offsets, np.arange(len(seqs)), pad)
    return ids, attention


def test_special_tokens_and_pads_are_never_replaced(generator, special, wiki_ids, tokenizer):
    # a row holding [UNK] and [MASK] in its text: special ids beyond CLS/SEP/PAD stay too
    t = tokenizer
    seqs = wiki_ids[:63] + [[t.cls_token_id, t.unk_token_id, t.mask_token_id, 2003, t.sep_token_id]]
    ids, attention = _padded(seqs, special.pad)
    out = Corruptor(generator, special, mask_ratio=0.9)(ids, attention, generator=torch.Generator().manual_seed(0))

    is_special = torch.isin(ids, torch.tensor(special.special))
    assert torch.equal(out.corrupted[is_special], ids[is_special])
    assert (out.corrupted[:, 0] == tokenizer.cls_token_id).all()
    assert (out.corrupted[attention == 0] == special.pad).all()
    assert torch.equal(out.labels.bool(), (out.corrupted != ids) & attention.bool())
    assert (out.labels[attention == 0] == 0).all() and out.labels.dtype == torch.int8
    assert torch.equal(out.n_replaced, out.labels.sum(1).long())
    assert (out.n_replaced <= out.n_masked).all() and out.n_replaced.sum() > 0
    assert out.n_masked[-1] == 1  # only the plain token of the special-laden row can be selected


def test_masking_ratio_and_80_10_10_split_on_wiki(special, wiki_ids):
    ids, attention = _padded(wiki_ids, special.pad)
    candidates = candidate_mask(ids, attention, special)
    noise = Noise.draw(ids.shape, special.vocab_size, torch.Generator().manual_seed(1), with_sample=False)
    masked, selected = mask_tokens(ids, candidates, noise, 0.3, special)

    assert not (selected & ~candidates).any()
    assert abs(selected.sum().item() / candidates.sum().item() - 0.3) < 0.01
    n = selected.sum().item()
    as_mask = (masked[selected] == special.mask).sum().item() / n
    unchanged = (masked[selected] == ids[selected]).sum().item() / n
    assert abs(as_mask - 0.8) < 0.02 and abs(unchanged - 0.1) < 0.02 and abs(1 - as_mask - unchanged - 0.1) < 0.02
    assert torch.equal(masked[~selected], ids[~selected])


@pytest.mark.parametrize("arch", ["distilbert", "bert"])
def test_logits_only_at_selected_positions_equal_the_full_forward(arch, generator, special, wiki_ids, tokenizer):
    if arch == "distilbert":
        model = generator
    else:
        from transformers import BertConfig, BertForMaskedLM

        torch.manual_seed(0)
        model = BertForMaskedLM(
            BertConfig(
                vocab_size=len(tokenizer),
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
            )
        ).eval()
    ids, attention = _padded(wiki_ids[:32], special.pad)
    selected = candidate_mask(ids, attention, special) & (
        torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) < 0.3
    )
    assert mlm_head(model) is not None
    with torch.inference_mode():
        partial = logits_at(model, ids, attention, selected)
        full = model(input_ids=ids, attention_mask=attention).logits[selected]
    assert partial.shape == (selected.sum().item(), len(tokenizer))
    torch.testing.assert_close(partial, full, rtol=1e-5, atol=1e-5)


def test_unknown_head_falls_back_to_full_logits(generator, special, wiki_ids):
    class Wrapped(torch.nn.Module):  # no known head attributes, no base_model
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        @property
        def base_model(self):
            return self

        def forward(self, **kw):
            return self.inner(**kw)

    wrapped = Wrapped(generator)
    assert mlm_head(wrapped) is None
    ids, attention = _padded(wiki_ids[:8], special.pad)
    selected = candidate_mask(ids, attention, special)
    with torch.inference_mode():
        torch.testing.assert_close(
            logits_at(wrapped, ids, attention, selected), logits_at(generator, ids, attention, selected)
        )


def test_same_seed_same_corruption_other_seed_differs(generator, special, wiki_ids):
    flat, offsets = _flat(wiki_ids[:200])
    corruptor = Corruptor(generator, special, mask_ratio=0.3)
    a = corrupt_sequences(corruptor, flat, offsets, torch.Generator().manual_seed(7), batch_size=32)
    b = corrupt_sequences(corruptor, flat, offsets, torch.Generator().manual_seed(7), batch_size=32)
    c = corrupt_sequences(corruptor, flat, offsets, torch.Generator().manual_seed(8), batch_size=32)
    assert np.array_equal(a.corrupted, b.corrupted) and np.array_equal(a.n_masked, b.n_masked)
    assert not np.array_equal(a.corrupted, c.corrupted)


def test_results_do_not_depend_on_batch_size(generator, special, wiki_ids):
    flat, offsets = _flat(wiki_ids[:150])
    corruptor = Corruptor(generator, special, mask_ratio=0.3)
    small = corrupt_sequences(corruptor, flat, offsets, torch.Generator().manual_seed(3), batch_size=9)
    large = corrupt_sequences(corruptor, flat, offsets, torch.Generator().manual_seed(3), batch_size=128)
    assert np.array_equal(small.n_masked, large.n_masked)
    assert np.array_equal(small.corrupted, large.corrupted) and np.array_equal(small.labels, large.labels)
    assert np.array_equal(small.labels.astype(bool), small.corrupted != flat)
    starts = offsets[:-1]
    assert np.array_equal(small.corrupted[starts], flat[starts])  # [CLS] kept


def test_sampling_follows_the_softmax():
    peaked = torch.tensor([[0.0, 50.0, 0.0, 0.0]]).repeat(100, 1)
    assert (pick_tokens(peaked, "sample", torch.rand(100)) == 1).all()
    flat_logits = torch.zeros(20000, 4)
    picks = pick_tokens(flat_logits, "sample", torch.rand(20000, generator=torch.Generator().manual_seed(4)))
    shares = torch.bincount(picks, minlength=4).float() / 20000
    assert torch.allclose(shares, torch.full((4,), 0.25), atol=0.02)
    with pytest.raises(ValueError, match="uniform"):
        pick_tokens(flat_logits, "sample")


def test_sample_mode_differs_from_argmax(generator, special, wiki_ids):
    flat, offsets = _flat(wiki_ids[:100])
    greedy = corrupt_sequences(
        Corruptor(generator, special, 0.3, "argmax"), flat, offsets, torch.Generator().manual_seed(5), 32
    )
    sampled = corrupt_sequences(
        Corruptor(generator, special, 0.3, "sample"), flat, offsets, torch.Generator().manual_seed(5), 32
    )
    assert np.array_equal(greedy.n_masked, sampled.n_masked)  # same selection, other replacements
    assert not np.array_equal(greedy.corrupted, sampled.corrupted)
    assert np.array_equal(sampled.labels.astype(bool), sampled.corrupted != flat)


def test_dropout_only_when_asked_and_bad_settings_refused(generator, special):
    assert not Corruptor(generator, special, 0.3).model.training
    assert Corruptor(generator, special, 0.3, dropout=True).model.training
    generator.eval()
    with pytest.raises(ValueError, match="mask_ratio"):
        Corruptor(generator, special, 0.0)
    with pytest.raises(ValueError, match="mode"):
        Corruptor(generator, special, 0.3, mode="beam")


def test_all_positions_is_the_reference_full_argmax(generator, special, wiki_ids, tokenizer):
    """`all_positions`: G's argmax at every real position, then [CLS] restored and pads kept (voidism/DiffCSE);
    the default touches the selected positions only, and the two agree there."""
    generator.eval()
    seqs = wiki_ids[:48]
    ids, attention = _padded(seqs, special.pad)
    noise = Noise.draw(ids.shape, special.vocab_size, torch.Generator().manual_seed(3), with_sample=False)
    full = Corruptor(generator, special, 0.3, all_positions=True)(ids, attention, noise=noise)
    only = Corruptor(generator, special, 0.3)(ids, attention, noise=noise)
    masked, selected = mask_tokens(ids, candidate_mask(ids, attention, special), noise, 0.3, special)
    with torch.no_grad():
        reference = generator(input_ids=masked, attention_mask=attention).logits[..., : special.vocab_size].argmax(-1)
    reference[:, 0] = tokenizer.cls_token_id
    reference = torch.where(attention.bool(), reference, ids)
    assert torch.equal(full.corrupted, reference)
    assert torch.equal(full.corrupted[selected], only.corrupted[selected])
    unselected = attention.bool() & ~selected
    assert torch.equal(only.corrupted[unselected], ids[unselected])
    assert (full.corrupted[unselected] != ids[unselected]).any()  # a random G rewrites unmasked tokens too
    assert torch.equal(full.labels.bool(), (full.corrupted != ids) & attention.bool())


@pytest.mark.parametrize("mode", ["argmax", "sample"])
def test_hard_corruption_replaces_every_selected_token_by_the_best_other_one(
    generator, special, wiki_ids, mode, monkeypatch
):
    """`hard` (CorruptConfig.hard): the same selection, every selected position replaced, even by a generator that
    prefers the original token; by argmax the token is the one it would pick without the original (the original's
    logit is all `hard` removes)."""
    import cse.models.corruption as corruption

    generator.eval()
    ids, attention = _padded(wiki_ids[:120], special.pad)
    noise = Noise.draw(ids.shape, special.vocab_size, torch.Generator().manual_seed(9), with_sample=mode == "sample")
    plain = Corruptor(generator, special, 0.3, mode)(ids, attention, noise=noise)
    real = corruption.logits_at

    def prefers_the_original(model, masked, mask, selected):  # the original token's logit raised far above the rest
        logits = real(model, masked, mask, selected)
        return logits.scatter_add(1, ids[selected].unsqueeze(1), torch.full((len(logits), 1), 1e4))

    monkeypatch.setattr(corruption, "logits_at", prefers_the_original)
    soft = Corruptor(generator, special, 0.3, mode)(ids, attention, noise=noise)
    hard = Corruptor(generator, special, 0.3, mode, hard=True)(ids, attention, noise=noise)
    assert torch.equal(soft.n_masked, hard.n_masked) and int(soft.n_replaced.sum()) == 0  # the original, always
    assert torch.equal(hard.n_replaced, hard.n_masked) and torch.equal(hard.labels.bool(), hard.corrupted != ids)
    if mode == "argmax":
        assert torch.equal(hard.corrupted[plain.labels.bool()], plain.corrupted[plain.labels.bool()])
    with pytest.raises(ValueError, match="unigram"):
        Corruptor(None, special, 0.3, "unigram", unigram_counts=np.ones(special.vocab_size), hard=True)
