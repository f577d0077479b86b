"""Item 5: a damaged checkpoint is named (file and what is wrong) before any backbone is loaded."""

from __future__ import annotations

import pytest
import torch

from cse.models.checkpoint import META_FILE, WEIGHTS_FILE, CheckpointError, load_checkpoint, save_checkpoint
from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory, tiny_bert_dir):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("ckpt") / "best"
    save_checkpoint(D2CSE(D2CSEModelConfig(backbone=str(tiny_bert_dir), prefix_len=2)).eval(), folder)
    return folder


@pytest.fixture
def checkpoint(good_checkpoint, tmp_path, monkeypatch):
    """A copy of a valid checkpoint; loading a backbone fails the test (the checks must come first)."""
    import shutil

    import cse.models.loading

    folder = tmp_path / "best"
    shutil.copytree(good_checkpoint, folder)

    def no_backbone(*a, **k):
        raise AssertionError("the backbone was loaded before the checkpoint files were checked")

    monkeypatch.setattr(cse.models.loading, "load_encoder", no_backbone)
    return folder


def test_truncated_weights_are_named(checkpoint):
    w = checkpoint / WEIGHTS_FILE
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{WEIGHTS_FILE}: truncated: tensor .* needs bytes"):
        load_checkpoint(checkpoint)


def test_header_cut_weights_are_named(checkpoint):
    w = checkpoint / WEIGHTS_FILE
    w.write_bytes(w.read_bytes()[:50])
    with pytest.raises(CheckpointError, match=rf"{WEIGHTS_FILE}: truncated or not a safetensors file"):
        load_checkpoint(checkpoint)


def test_garbage_weights_are_named(checkpoint):
    (checkpoint / WEIGHTS_FILE).write_bytes(b"this is not a tensor file at all" * 10)
    with pytest.raises(CheckpointError, match=rf"{WEIGHTS_FILE}: (truncated or not a safetensors|damaged)"):
        load_checkpoint(checkpoint)


def test_broken_meta_json_is_named_with_line_and_column(checkpoint):
    m = checkpoint / META_FILE
    m.write_text(m.read_text()[:40] + "\n}")
    with pytest.raises(CheckpointError, match=rf"{META_FILE}: damaged: not valid JSON at line \d+ column \d+"):
        load_checkpoint(checkpoint)


def test_missing_weights_and_empty_folder_are_named(checkpoint, tmp_path):
    (checkpoint / WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointError, match=rf"{WEIGHTS_FILE}: missing"):
        load_checkpoint(checkpoint)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_evaluation_reads_the_same_checks(checkpoint):
    from cse.models.checkpoint import read_checkpoint_config

    (checkpoint / META_FILE).write_text("{\n  'single quotes': 1\n}")
    with pytest.raises(CheckpointError, match=rf"{META_FILE}: damaged: not valid JSON at line 2 column 3"):
        read_checkpoint_config(checkpoint)
