"""models/generator.py (a masked-LM head fitted on a frozen encoder) and corruption mode unigram, on tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cse.models.corruption import Corruptor, SpecialTokens, corrupt_sequences
from cse.models.generator import (
    HeadFitter,
    freeze_backbone,
    init_bias_from_counts,
    mask_batch,
    token_counts,
    unigram_accuracies,
)
from cse.models.loading import load_masked_lm


@pytest.fixture(scope="module")
def special(tokenizer) -> SpecialTokens:
    return SpecialTokens.from_tokenizer(tokenizer)


def test_only_the_head_learns_and_the_decoder_stays_tied(tiny_bert_dir, special):
    torch.manual_seed(0)
    model = load_masked_lm(str(tiny_bert_dir))
    encoder = {k: v.clone() for k, v in model.base_model.state_dict().items()}
    counts = np.zeros(special.vocab_size, np.int64)
    counts[[2000, 2001]] = [30, 10]
    init_bias_from_counts(model, counts)
    bias = model.get_output_embeddings().bias.detach()
    assert bias[2000] > bias[2001] > bias[5] and abs(float(bias[: special.vocab_size].mean())) < 1e-3
    head = HeadFitter(model, special.vocab_size, lr=1e-2, weight_decay=0.01, total_steps=3, warmup_steps=0)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == {
        "cls.predictions.bias",
        "cls.predictions.transform.dense.weight",
        "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.LayerNorm.weight",
        "cls.predictions.transform.LayerNorm.bias",
    }
    head_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    flat = torch.tensor([101, 2000, 2001, 2000, 2001, 2000, 102] * 8)
    offsets = np.arange(0, len(flat) + 1, 7)
    g = torch.Generator().manual_seed(0)
    batch = mask_batch(flat, offsets, np.arange(8), special, 0.5, g)
    assert len(batch.targets) and not np.isin(batch.targets.numpy(), [101, 102]).any()
    for _ in range(3):
        head.step(head.features(batch), batch.targets)
    assert all(torch.equal(encoder[k], v) for k, v in model.base_model.state_dict().items())  # frozen
    assert all(not torch.equal(head_before[n], p) for n, p in model.named_parameters() if p.requires_grad)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_an_untied_decoder_is_refused(tiny_bert_dir):
    from transformers import AutoConfig, AutoModelForMaskedLM

    cfg = AutoConfig.from_pretrained(tiny_bert_dir, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="not tied"):
        freeze_backbone(AutoModelForMaskedLM.from_config(cfg))


def test_unigram_baselines_are_what_they_say():
    counts = np.array([0, 6, 3, 1])  # id 0 special
    targets = np.array([1, 1, 2, 3])
    acc = unigram_accuracies(counts, targets)
    assert acc["unigram_argmax"] == 0.5  # always id 1
    assert acc["unigram_sample"] == pytest.approx((0.6 + 0.6 + 0.3 + 0.1) / 4)
    assert token_counts(np.array([0, 1, 1, 3]), 4, [0]).tolist() == [0, 2, 0, 1]
    with pytest.raises(ValueError, match="outside"):
        token_counts(np.array([4]), 4, [])


def test_unigram_mode_draws_from_the_frequencies_deterministically_per_seed(special):
    counts = np.zeros(special.vocab_size, np.int64)
    counts[[2000, 2001, 2002]] = [700, 200, 100]
    seqs = [[101, *range(3000, 3020), 102]] * 400  # no original token is ever drawn: every selection is replaced
    flat = np.concatenate(seqs)
    offsets = np.arange(0, len(flat) + 1, 22)
    corruptor = Corruptor(None, special, 0.3, "unigram", unigram_counts=counts)

    def run(seed: int):
        return corrupt_sequences(corruptor, flat, offsets, torch.Generator().manual_seed(seed), 64)

    out = run(1)
    drawn = out.corrupted[out.labels.astype(bool)]
    assert out.n_replaced.sum() == out.n_masked.sum() == len(drawn) > 2000
    assert set(np.unique(drawn)) == {2000, 2001, 2002}
    shares = np.bincount(drawn - 2000) / len(drawn)
    assert np.allclose(shares, [0.7, 0.2, 0.1], atol=0.03)
    assert (out.corrupted[offsets[:-1]] == 101).all()
    assert np.array_equal(run(1).corrupted, out.corrupted) and not np.array_equal(run(2).corrupted, out.corrupted)


def test_unigram_mode_refuses_a_model_missing_counts_or_all_positions(special, tiny_generator_dir):
    counts = np.ones(special.vocab_size, np.int64)
    with pytest.raises(ValueError, match="no generator model"):
        Corruptor(load_masked_lm(str(tiny_generator_dir)), special, 0.3, "unigram", unigram_counts=counts)
    with pytest.raises(ValueError, match="unigram_counts"):
        Corruptor(None, special, 0.3, "unigram")
    with pytest.raises(ValueError, match="masked positions"):
        Corruptor(None, special, 0.3, "unigram", all_positions=True, unigram_counts=counts)
    with pytest.raises(ValueError, match="one count per token id"):
        Corruptor(None, special, 0.3, "unigram", unigram_counts=counts[:10])
    with pytest.raises(ValueError, match="needs a generator model"):
        Corruptor(None, special, 0.3, "argmax")
