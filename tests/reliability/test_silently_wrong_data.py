"""Issue 43 items 1–5, "silently wrong data": data that was wrong and used without a word.

The campaign's cases: a Parquet source replaced in place by other rows with its modification time set back (`cp -p`,
`rsync -t`, an archive) was a cache hit of `datasets.load_dataset`, so ingestion returned the old rows under the old
key; a generator with inf/NaN in six word-embedding rows passed preflight and published a corruption whose
replacements were 92 % `[PAD]`; a Wiki file of bidi marks and combining characters tokenised to `[CLS] [SEP]` and
`[CLS] [UNK] [SEP]` rows and was published with a warning; two BOM files concatenated left `'U+FEFF second …'` in a
sentence; a resume state holding inf (hashes matching) was loaded unchecked and every rerun failed with
`NonFiniteLoss`, never naming the state. New cases of each class: a generator folder whose weights change under the
same `config.json` (fingerprints); NaN in the optimizer moments of a resume state (non-finite tensors where a tensor
is loaded); lines of literal special-token text, `[MASK]` or `[PAD] [SEP]` (special-token-only content); a BOM at the
start of the values of an HF source (input text)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cse.config.stages import CorruptConfig, IngestConfig, TokenizeConfig, WikiSource
from cse.models.method import StepOutput
from cse.storage.datasets import read_dataset
from cse.storage.hashing import sha256_file
from cse.storage.hf_sources import HFSource
from cse.storage.readers import read_wiki1m
from cse.storage.runs import ResumeState
from cse.storage.training_data import TokenRows
from cse.training.loop import StopAfter, TrainingInterrupted
from cse.training.rows import TrainingRows
from tests.loops import cpu_trainer, loop_config
from tests.reliability.conftest import ingest

# ---------------------------------------------------------------- fingerprints


def _replace_keeping_mtime(path: Path, write) -> None:
    """Replace `path`'s content by `write(path)` and set its modification time back, as `cp -p` does."""
    before = path.stat()
    write(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns


def test_a_parquet_source_replaced_under_its_old_mtime_is_read_again(tmp_path, root):
    """The campaign's case: the second ingestion returned the first file's rows (and key), from the Arrow cache of
    `datasets.load_dataset`, keyed by the path and the modification time."""
    folder = tmp_path / "wiki_parquet"
    folder.mkdir()
    data = folder / "train.parquet"
    datasets.Dataset.from_dict({"text": ["an old sentence .", "another old one ."]}).to_parquet(data)
    config = IngestConfig(wiki=WikiSource(hf=[HFSource(dataset=str(folder))]))
    first = ingest("wiki1m", config)

    new_rows = ["a new sentence .", "another new one .", "and a third ."]
    _replace_keeping_mtime(data, lambda p: datasets.Dataset.from_dict({"text": new_rows}).to_parquet(p))
    second = ingest("wiki1m", config)
    assert second.key != first.key and not second.cache_hit
    assert read_dataset(root, "wiki1m", second.key).column("text").to_pylist() == new_rows
    again = ingest("wiki1m", config)  # the same content again: a cache hit of the new rows
    assert again.key == second.key and again.cache_hit


@pytest.fixture
def corruption_tokens(root, tokenizer, shared_data) -> str:
    """A tokens dataset of the packaged MiniLM: the first 300 Wiki1M lines."""
    from tests.tasks.test_corrupt import write_tokens

    lines = (shared_data / "wiki1m_head.txt").read_text(encoding="utf-8").splitlines()[:300]
    return write_tokens(root, "tokens-silent", tokenizer, tokenizer(lines, truncation=True, max_length=32)["input_ids"])


def _generator_copy(tiny_generator_dir: Path, dest: Path) -> Path:
    shutil.copytree(tiny_generator_dir, dest)
    return dest


def _corrupt(tokens_key: str, generator: Path):
    """The corrupt flow's tasks, without Prefect: plan, every shard, publish."""
    from cse.tasks.corrupt import corrupt_shard, plan_corruption, publish_corruption

    config = CorruptConfig(generator=str(generator), shard_size=100, batch_size=50, device="cpu", variants=1)
    plan = plan_corruption.fn(tokens_key, config)
    shards = [] if plan.cached else [corrupt_shard.fn(plan, i) for i in range(plan.n_shards)]
    return plan, publish_corruption.fn(plan, shards)


def test_a_generator_whose_weights_change_under_the_same_config_is_another_corruption(
    root, corruption_tokens, tiny_generator_dir, tmp_path
):
    """New case: the generator's identity was its folder and the hash of its config.json, so other weights under the
    same config.json (a fine-tuned copy unpacked over the folder) returned the corruption of the old weights."""
    from transformers import AutoModelForMaskedLM

    from cse.models.generator_cache import release_generators

    generator = _generator_copy(tiny_generator_dir, tmp_path / "generator")
    plan, first = _corrupt(corruption_tokens, generator)
    release_generators()

    model = AutoModelForMaskedLM.from_pretrained(generator)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    config_json = (generator / "config.json").read_bytes()
    weights = generator / "model.safetensors"
    _replace_keeping_mtime(weights, lambda p: model.save_pretrained(p.parent))
    (generator / "config.json").write_bytes(config_json)  # the same config.json, byte for byte

    again, second = _corrupt(corruption_tokens, generator)
    release_generators()
    assert again.generator["config_sha256"] == plan.generator["config_sha256"]
    assert second.key != first.key and not second.cache_hit
    old, new = (read_dataset(root, "corruption", r.key).column("corrupted_ids") for r in (first, second))
    assert not old.equals(new)


# ---------------------------------------------------------------- non-finite tensors


def _poison_rows(generator: Path, rows: list[int]) -> None:
    """Set word-embedding rows of the generator's weights to inf and NaN (alternately), in place."""
    weights = generator / "model.safetensors"
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("word_embeddings.weight"))
    for i, row in enumerate(rows):
        tensors[name][row] = float("inf") if i % 2 else float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})


def test_a_generator_with_non_finite_weights_is_refused_before_corrupting(
    root, corruption_tokens, tiny_generator_dir, tmp_path, tokenizer
):
    """The campaign's case: six poisoned word-embedding rows; the corruption was published, its replacements
    nearly all `[PAD]`."""
    from cse.models.generator_cache import release_generators
    from cse.training.job import NonFiniteWeights

    generator = _generator_copy(tiny_generator_dir, tmp_path / "poisoned")
    rows = [int(t) for t in tokenizer.convert_tokens_to_ids(["the", ",", ".", "of", "and", "in"])]
    _poison_rows(generator, rows)
    with pytest.raises(NonFiniteWeights, match=r"generator .*poisoned.* holds non-finite") as e:
        _corrupt(corruption_tokens, generator)
    release_generators()
    shown = ", ".join(map(str, sorted(rows)[:5]))
    assert f"word_embeddings.weight (192 of {len(tokenizer) * 32:,d} values, rows {shown} …)" in str(e.value)
    assert root.list("corruption") == []  # nothing published


def test_a_corruption_whose_replacements_are_special_tokens_is_refused(
    root, corruption_tokens, tiny_generator_dir, tmp_path, tokenizer
):
    """A finite generator that predicts `[PAD]` everywhere (its output bias for id 0 far above the rest) corrupts
    into the same garbage: refused before publishing, over the stated share of special replacements."""
    from cse.models.generator_cache import release_generators
    from cse.tasks.corrupt import MAX_SPECIAL_REPLACEMENTS, SpecialReplacements

    generator = _generator_copy(tiny_generator_dir, tmp_path / "pad_generator")
    weights = generator / "model.safetensors"
    tensors = load_file(weights)
    tensors["vocab_projector.bias"][tokenizer.pad_token_id] = 1e4
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(SpecialReplacements, match=r"of \d[\d,]* replaced tokens are special tokens \(\[PAD\] ") as e:
        _corrupt(corruption_tokens, generator)
    release_generators()
    assert f"over {MAX_SPECIAL_REPLACEMENTS:.0%}" in str(e.value)
    assert root.list("corruption") == []
    assert not root.shards_dir("corruption", e.value.key).exists()  # its shards are not kept for a rerun


class _Prompted(torch.nn.Module):
    """A weight per token position and a prefix (two rows) that every step uses."""

    phases = ("main",)

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.prefix = torch.nn.Parameter(torch.full((2, 3), 0.1))

    def training_step(self, batch, step=0, phase="main"):
        return StepOutput((((batch.input_ids.float() @ self.w) ** 2).mean() + self.prefix.sum() ** 2) / 100)


def _trainer(state: ResumeState, stop_after=None):
    seqs = [np.array([1, i + 3, 2]) for i in range(8)]
    rows = TrainingRows(TokenRows(ids=np.arange(8), seqs={"text": seqs}), None, supervised=False, pad_id=0)
    torch.manual_seed(0)
    hooks = [StopAfter(stop_after)] if stop_after is not None else []
    return cpu_trainer(_Prompted(), rows, loop_config(epochs=2, checkpoint_steps=2), state, hooks=hooks)


def _poison_state(state: ResumeState, where: str) -> Path:
    """Put inf/NaN into the state's prefix tensor or Adam moments and record the new files' sizes and hashes, as a
    state written that way would have them. Returns the file changed."""
    if where == "prefix":
        tensors = load_file(state.trainable)
        tensors["prefix"][1] = float("inf")
        save_file(tensors, state.trainable)
        target = state.trainable
    else:
        st = torch.load(state.optimizer, weights_only=False)
        st["optimizer"]["state"][1]["exp_avg"][0, 2] = float("nan")
        torch.save(st, state.optimizer)
        target = state.optimizer
    meta = json.loads(state.progress.read_text())
    meta["files"][target.name] = {"size": target.stat().st_size, "sha256": sha256_file(target)}
    state.progress.write_text(json.dumps(meta))
    return target


@pytest.mark.parametrize("where", ["prefix", "optimizer moments"])
def test_a_resume_state_holding_non_finite_tensors_is_quarantined_and_named(where, tmp_path, caplog):
    """The campaign's case (inf in the prompt tensors, hashes matching: every rerun failed with `NonFiniteLoss … lower
    the learning rate`) and a new one, NaN in Adam's first moment of the prefix (the weights finite)."""
    state = ResumeState(tmp_path / "state")
    with pytest.raises(TrainingInterrupted):
        _trainer(state, stop_after=2).run()
    target = _poison_state(state, where)
    with caplog.at_level(logging.WARNING, logger="cse.training.loop"):
        result = _trainer(state).run()
    assert result.resumed_from is None and result.steps == 4  # started over, and finished
    named = {
        "prefix": "prefix (3 of 6 values, rows 1)",
        "optimizer moments": "optimizer.state.1.exp_avg (1 of 6 values",
    }
    assert f"resume state file {target} is damaged: non-finite (nan/inf) tensors: {named[where]}" in caplog.text
    assert "restarts from step 0" in caplog.text
    [moved] = (tmp_path / "quarantine").iterdir()
    recorded = json.loads((moved / "state" / "trainer_state.json").read_text())["files"][target.name]
    assert sha256_file(moved / "state" / target.name) == recorded["sha256"]  # moved as it was, its hash matching
    assert json.loads(state.progress.read_text())["step"] == 4  # a fresh, finite state


# ---------------------------------------------------------------- special-token-only content


def _tokenize(root, src: Path, tiny_bert_dir: Path):
    from cse.tasks.tokenize import tokenize_dataset

    wiki = ingest("wiki1m", IngestConfig(wiki=WikiSource(path=str(src))))
    return wiki, lambda: tokenize_dataset.fn(wiki, TokenizeConfig(tokenizer=str(tiny_bert_dir), max_length=32))


@pytest.mark.parametrize(
    "lines,what",
    [
        (["\u200f\u0301", "\u202b\u20dd\u202c", "\u0301\u200e\u0302", "\u2067\u0488\u2069"], "bidi and combining"),
        (["[MASK]", "[PAD] [SEP]", "[UNK] [CLS]", "[MASK] [MASK]"], "literal special tokens"),
    ],
)
def test_rows_of_only_special_or_unknown_tokens_are_empty(lines, what, tmp_path, root, tiny_bert_dir):
    """The campaign's case (bidi marks and combining characters: `[CLS] [SEP]` and `[CLS] [UNK] [SEP]` rows, published
    with a warning) and a new one: lines of literal special-token text, which the tokenizer turns into the special
    tokens themselves (`[CLS] [MASK] [SEP]`: no row was even counted empty)."""
    from cse.tasks.tokenize import EmptyTokensError

    src = tmp_path / "wiki.txt"
    src.write_text("".join(lines[i % 4] + "\n" for i in range(40)), encoding="utf-8")
    wiki, tokenize = _tokenize(root, src, tiny_bert_dir)
    with pytest.raises(EmptyTokensError, match=rf"wiki1m dataset {wiki.key}: all 40 rows tokenise to nothing but"):
        tokenize()
    assert root.list("tokens") == []

    src.write_text("a real sentence .\n" + "".join(line + "\n" for line in lines), encoding="utf-8")
    stats = root.find("tokens", _tokenize(root, src, tiny_bert_dir)[1]().key).stats
    assert (stats["empty_rows"], stats["sentences"]) == (4, 5)  # some such rows: kept and counted


# ---------------------------------------------------------------- input text


def test_a_bom_at_any_line_start_is_stripped_and_counted(tmp_path, root):
    """The campaign's case: two BOM files concatenated; the second BOM stayed in the sentence."""
    src = tmp_path / "wiki.txt"
    src.write_bytes("\ufefffirst sentence .\n".encode() + "\ufeffsecond sentence .\nthird .\n".encode())
    table, stats = read_wiki1m(src)
    assert table.column("text").to_pylist() == ["first sentence .", "second sentence .", "third ."]
    assert stats.details["bom"] == 2 and stats.examples["bom"][1].endswith("wiki.txt:2: byte-order mark stripped")
    ref = ingest("wiki1m", IngestConfig(wiki=WikiSource(path=str(src))))
    assert read_dataset(root, "wiki1m", ref.key).column("text")[1].as_py() == "second sentence ."
    assert root.require("wiki1m", ref.key).stats["bom"] == 2


def test_a_bom_at_the_start_of_an_hf_sources_values_is_stripped_and_counted(tmp_path, root):
    """New case: the rows of an HF source written from BOM files by a loader that keeps the mark."""
    folder = tmp_path / "bom_parquet"
    folder.mkdir()
    rows = ["\ufefffirst sentence .", "second .", "\ufeffthird ."]
    datasets.Dataset.from_dict({"text": rows}).to_parquet(folder / "train.parquet")
    ref = ingest("wiki1m", IngestConfig(wiki=WikiSource(hf=[HFSource(dataset=str(folder))])))
    assert read_dataset(root, "wiki1m", ref.key).column("text").to_pylist() == [r.lstrip("\ufeff") for r in rows]
    stats = root.require("wiki1m", ref.key).stats
    assert stats["bom"] == 2 and stats["examples"]["bom"][0].endswith("row 0: text: byte-order mark stripped")
