"""Issue 32, Inputs: "empty" means empty after Unicode whitespace and format characters are stripped, or after
tokenisation; a boolean is never read as a number.

The campaign's cases: a Wiki file whose lines are only invisible Unicode (NBSP, U+3000, U+200B, U+FEFF, U+2060) was
published as 14,000 rows and trained a registered model on `[CLS] [SEP]` rows (the ASCII-whitespace version was
refused); `{"learning_rate": true}` trained at 1.0 and `max_steps`, `eval_steps`, `epochs`, `max_train_sentences`,
`seed`, `grad_clip` took `true` as 1. New cases of each class: an NLI file of invisible sentences, lines the
tokenizer drops whole (combining accents only, which uncased BERT strips), and booleans for a method's model field,
a stage config's number and a list of numbers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cse.config.stages import IngestConfig, NliSource, TokenizeConfig, WikiSource
from cse.config.training import TrainConfig, resolve_train_config
from cse.tasks.ingest import EmptySourceError
from tests.reliability.conftest import ingest

INVISIBLE = ["\u00a0", "\u3000", "\u200b", "\ufeff", "\u2060"]


def _invisible_lines(n: int) -> str:
    return "".join(INVISIBLE[i % 5] + INVISIBLE[(i + 2) % 5] * (i % 3) + "\n" for i in range(n))


def test_a_wiki_file_of_invisible_lines_is_refused_like_a_blank_one(tmp_path, root):
    src = tmp_path / "wiki.txt"
    src.write_text(_invisible_lines(1400), encoding="utf-8")
    with pytest.raises(EmptySourceError, match=rf"{src}: 0 usable rows \(1400 rows read, 1400 with a blank sentence"):
        ingest("wiki1m", IngestConfig(wiki=WikiSource(path=str(src))))
    assert root.list("wiki1m") == []  # nothing published


def test_an_nli_file_of_invisible_sentences_is_refused(tmp_path, root):
    src = tmp_path / "nli.csv"
    rows = "".join(f"a cat sits .,{s},{s}\u200b\n" for s in INVISIBLE[:3])  # the second and third sentence blank
    src.write_text("sent0,sent1,hard_neg\n" + rows, encoding="utf-8")
    with pytest.raises(EmptySourceError, match=r"0 usable rows \(3 rows read, 3 with a blank sentence"):
        ingest("nli", IngestConfig(nli=NliSource(path=str(src))))


def test_lines_the_tokenizer_drops_whole_are_refused_at_tokenisation(tmp_path, root, tiny_bert_dir):
    """Combining accents alone are visible characters (ingestion keeps them), but uncased BERT strips accents: every
    row tokenises to `[CLS] [SEP]`. Refused before anything is published; a source with some such rows is kept and
    the rows counted."""
    from cse.tasks.tokenize import EmptyTokensError, tokenize_dataset

    src = tmp_path / "wiki.txt"
    src.write_text("\u0301\u0301\n" * 40 + "\u0300\n" * 24, encoding="utf-8")
    wiki = ingest("wiki1m", IngestConfig(wiki=WikiSource(path=str(src))))
    config = TokenizeConfig(tokenizer=str(tiny_bert_dir), max_length=32)
    with pytest.raises(EmptyTokensError, match=rf"wiki1m dataset {wiki.key}: all 64 rows tokenise to nothing but"):
        tokenize_dataset.fn(wiki, config)
    assert root.list("tokens") == []

    src.write_text("a real sentence .\n" + "\u0301\n" * 9, encoding="utf-8")
    tokens = tokenize_dataset.fn(ingest("wiki1m", IngestConfig(wiki=WikiSource(path=str(src)))), config)
    stats = root.find("tokens", tokens.key).stats
    assert stats["empty_rows"] == 9 and stats["sentences"] == 10


@pytest.mark.parametrize(
    "field", ["learning_rate", "max_steps", "eval_steps", "epochs", "max_train_sentences", "seed", "grad_clip"]
)
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_not_a_number(field, value):
    with pytest.raises(ValidationError, match=rf"TrainConfig.{field} takes a number, got the boolean"):
        TrainConfig(**{field: value})


@pytest.mark.parametrize(
    "overrides,named",
    [
        ({"model": {"temperature": True}}, r"model \(SimCSEConfig\).temperature"),
        ({"corrupt": {"mask_ratio": True}}, r"CorruptConfig.mask_ratio"),
        ({"prefix_phase": {"learning_rate": True}}, r"PrefixPhaseConfig.learning_rate"),
        ({"ingest": {"download_retries": False}}, r"IngestConfig.download_retries"),
    ],
)
def test_booleans_are_refused_in_every_config_kind(overrides, named):
    with pytest.raises(ValueError, match=rf"{named} takes a number"):
        resolve_train_config("smoke", overrides, method="simcse")


def test_booleans_stay_booleans_and_numbers_stay_numbers():
    cfg = resolve_train_config("smoke", {"test_evaluation": False, "max_steps": 3, "learning_rate": "1e-4"}, "simcse")
    assert cfg.test_evaluation is False and cfg.max_steps == 3 and cfg.learning_rate == 1e-4
    from cse.config.finite import refuse_booleans

    with pytest.raises(ValueError, match=r"x.sizes takes numbers, got a boolean in \[1, True\]"):
        refuse_booleans({"sizes": tuple[int, ...]}, {"sizes": [1, True]}, "x")
