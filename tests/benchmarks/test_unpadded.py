"""benchmarks/unpadded.py: the Wiki1M sample's real-token fill, and `time_packed_step` (the entry point a GPU
measurement calls) on real rows at tiny size."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.gpu_check import build_model, preset, synthetic_tokenizer
from benchmarks.unpadded import fill_figures, time_packed_step, wiki_sequences, wiki_training_rows
from cse.models.loading import PACKAGED_MINILM, load_tokenizer
from cse.training.rows import epoch_order


@pytest.fixture(scope="module")
def wiki(shared_data):
    """The shared Wiki1M sample tokenised at max length 32, and untruncated."""
    tokenizer = load_tokenizer(PACKAGED_MINILM)
    path = shared_data / "wiki1m_head.txt"
    return wiki_sequences(path, tokenizer, 32), wiki_sequences(path, tokenizer, None)


def test_the_wiki_sample_fills_two_thirds_of_its_padded_positions(wiki):
    seqs, full = wiki
    figures = fill_figures(np.array([len(s) for s in seqs]), np.array([len(s) for s in full]), 32, 64)
    assert figures["rows"] == 11913
    assert figures["mean_real_tokens"] == 21.9 and figures["fill"] == pytest.approx(0.684, abs=5e-4)
    assert figures["truncated_share"] == pytest.approx(0.25, abs=0.01)
    assert figures["fill"] < figures["batch_fill_max"] <= figures["least_safe_fill"] < 1


def test_time_packed_step_counts_fewer_flops_unpadded_and_leaves_the_model_padded(wiki):
    seqs, _ = wiki
    cfg = preset("simcse", "tiny", 8, 32)
    model = build_model("simcse", cfg, "tiny", synthetic_tokenizer(), seed=0).train()
    rows = wiki_training_rows("simcse", cfg, seqs)
    batch = rows.batch(epoch_order(len(rows), 42, 0)[:8], 0)
    result = time_packed_step(model, batch, "main", fill=0.85, steps=1, warmup=0)
    assert result["padded_positions"] == 8 * 2 * 32 and result["real_tokens"] < 0.85 * result["padded_positions"]
    assert result["unpadded"]["flops"] < result["padded"]["flops"] and result["flop_ratio"] < 1
    assert model.__dict__["_unpadded_encoder"] is None  # padded again


def test_wiki_training_rows_corrupt_real_tokens_only_for_the_methods_that_read_corruption(wiki):
    seqs, _ = wiki
    cfg = preset("d2cse", "tiny", 8, 32)
    batch = wiki_training_rows("d2cse", cfg, seqs[:40]).batch(np.arange(8), 0)
    assert batch.input_ids.shape == (8, 2, 32)
    replaced = batch.rtd_labels.bool()
    assert replaced.any() and not (replaced & ~batch.attention_mask.bool()).any()
    assert (batch.corrupted_ids[..., 0] == batch.input_ids[..., 0]).all()
    assert wiki_training_rows("simcse", preset("simcse", "tiny", 8, 32), seqs[:40]).corruption is None
