"""storage/hf_sources.py through storage/sources.py and the ingest stage: Hugging Face datasets (a `save_to_disk`
folder, a Parquet folder; built here, no network) as Wiki1M, NLI and STS sources, with the file readers' rows, hashing,
counts and errors."""

from __future__ import annotations

import re

import datasets
import pytest
from pydantic import ValidationError

from cse.config.stages import IngestConfig, NliSource, SentEvalSource, WikiSource
from cse.storage.fetch import ChecksumError
from cse.storage.hf_sources import HFRowError, HFSource, HFSourceError
from cse.storage.layout import DataRoot
from cse.storage.readers import DataFormatError, read_wiki1m
from cse.storage.sources import check_sts_counts, read_source, resolve_source

LINES = ["first sentence .", "second  one", "", "fourth after an empty line"]


@pytest.fixture
def root(tmp_path) -> DataRoot:
    return DataRoot(tmp_path / "data")


def _resolve(root, dataset, *specs, sha256=None):
    hf = [s if isinstance(s, HFSource) else HFSource.model_validate(s) for s in specs]
    return resolve_source(root, dataset, None, "http://127.0.0.1:9/never", sha256=sha256, retries=0, hf=hf)


def test_wiki_from_save_to_disk_and_parquet_reads_as_the_file_does(root, tmp_path):
    wiki = datasets.Dataset.from_dict({"sentence": LINES, "n": list(range(4))})
    wiki.save_to_disk(tmp_path / "disk")
    (tmp_path / "pq").mkdir()
    wiki.to_parquet(tmp_path / "pq" / "train.parquet")
    (tmp_path / "wiki.txt").write_text("\n".join(LINES) + "\n")
    file_table, file_stats = read_wiki1m(tmp_path / "wiki.txt")

    src = _resolve(root, "wiki1m", {"dataset": str(tmp_path / "disk"), "columns": {"text": "sentence"}})
    assert (src.origin, src.location, src.path) == ("hf", f"hf:{tmp_path / 'disk'}", tmp_path / "disk")
    table, stats = read_source(src)
    assert table.equals(file_table) and (stats.rows, stats.empty) == (file_stats.rows, file_stats.empty) == (4, 1)
    assert src.describe()["hf"][0]["loaded_with"] == "load_from_disk"

    from_parquet = _resolve(root, "wiki1m", {"dataset": str(tmp_path / "pq"), "columns": {"text": "sentence"}})
    assert from_parquet.content_hash == src.content_hash  # the same rows: the same hash, wherever they come from
    assert from_parquet.describe()["hf"][0]["split"] == "train"
    assert all(f.startswith(str(root.downloads / "hf")) for f in from_parquet.describe()["hf"][0]["files"])
    assert read_source(from_parquet)[0].equals(file_table)

    resharded = tmp_path / "resharded"
    wiki.save_to_disk(resharded, num_shards=2)  # stored differently, same rows
    assert (
        _resolve(root, "wiki1m", {"dataset": str(resharded), "columns": {"text": "sentence"}}).content_hash
        == src.content_hash
    )
    changed = tmp_path / "changed"
    datasets.Dataset.from_dict({"sentence": LINES[:3] + ["fourth after an empty line!"]}).save_to_disk(changed)
    assert (
        _resolve(root, "wiki1m", {"dataset": str(changed), "columns": {"text": "sentence"}}).content_hash
        != src.content_hash
    )
    with pytest.raises(ChecksumError, match="sha256 of the rows read"):
        _resolve(root, "wiki1m", {"dataset": str(changed), "columns": {"text": "sentence"}}, sha256=src.content_hash)


def test_sts_from_several_datasets_with_constants_columns_and_counts(root, tmp_path):
    datasets.DatasetDict(
        {
            "test": datasets.Dataset.from_dict(
                {"sentence1": ["a  man", "b"], "sentence2": ["a person", ""], "score": [4.2, 0]}
            ),
            "validation": datasets.Dataset.from_dict({"sentence1": ["c"], "sentence2": ["d"], "score": [3.0]}),
        }
    ).save_to_disk(tmp_path / "stsb")
    datasets.Dataset.from_dict(
        {"s1": ["x", "y"], "s2": ["z", "w"], "rel": [1.5, 5.0], "split": ["test", "train"]}
    ).save_to_disk(tmp_path / "sick")
    stsb = str(tmp_path / "stsb")
    src = _resolve(
        root,
        "sts",
        {"dataset": stsb, "split": "test", "values": {"task": "stsb"}},
        {"dataset": stsb, "split": "validation", "values": {"task": "stsb"}},
        {
            "dataset": str(tmp_path / "sick"),
            "values": {"task": "sickr"},
            "columns": {"sentence1": "s1", "sentence2": "s2", "score": "rel"},
        },
    )
    table, stats = read_source(src)
    assert table.to_pydict() == {
        "task": ["stsb", "stsb", "stsb", "sickr", "sickr"],
        "subset": ["all"] * 5,
        "split": ["test", "test", "dev", "test", "train"],
        "pair_index": [0, 1, 0, 0, 0],
        "sentence1": ["a man", "b", "c", "x", "y"],
        "sentence2": ["a person", "", "d", "z", "w"],  # SentEval's re-join
        "score": [4.2, 0.0, 3.0, 1.5, 5.0],
    }
    assert stats.details == {"stsb/test": 2, "stsb/dev": 1, "sickr/test": 1, "sickr/train": 1} and stats.empty == 1
    check_sts_counts(src, stats, {"stsb/test": 2, "sickr/train": 1})
    with pytest.raises(
        DataFormatError,
        match=re.escape(f"hf:{stsb}@test + hf:{stsb}@validation: 2 scored pairs of stsb/test, expected 1,379"),
    ):
        check_sts_counts(src, stats, {"stsb/test": 1379})
    with pytest.raises(HFSourceError, match="no column 'task' and no value for it"):
        _resolve(root, "sts", f"hf:{stsb}@test")


def _bad(root, tmp_path, dataset, data, **spec):
    folder = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
    datasets.Dataset.from_dict(data).save_to_disk(folder)
    return _resolve(root, dataset, {"dataset": str(folder), **spec}), f"hf:{folder}"


def test_missing_columns_and_bad_values_name_the_dataset_and_the_row(root, tmp_path):
    with pytest.raises(
        HFSourceError,
        match=r"hf:\S+: no column 'hard_neg' \(for our 'hard_neg'\); its columns: sent0, "
        r"sent1, neg \(map one with columns: \{hard_neg: <column>\}\)",
    ):
        _bad(root, tmp_path, "nli", {"sent0": ["a"], "sent1": ["b"], "neg": ["c"]})
    with pytest.raises(HFSourceError, match="column 'text' \\(our 'text'\\) holds int64, expected text"):
        _bad(root, tmp_path, "wiki1m", {"text": [1, 2]})
    with pytest.raises(
        HFSourceError, match="columns names 'label'; a nli source takes columns for sent0, sent1, hard_neg only"
    ):
        _bad(root, tmp_path, "nli", {"sent0": ["a"]}, columns={"label": "x"})

    src, where = _bad(
        root, tmp_path, "nli", {"sent0": ["a", "b", "c"], "sent1": ["d", None, "f"], "hard_neg": ["g"] * 3}
    )
    with pytest.raises(HFRowError, match=re.escape(f"{where} row 1: 'sent1' is missing (null)")) as e:
        read_source(src)
    assert e.value.row == 1 and isinstance(e.value, DataFormatError)
    score = {"sentence1": ["a", "b"], "sentence2": ["c", "d"], "task": ["stsb", "stsb"]}
    src, where = _bad(root, tmp_path, "sts", {**score, "score": [1.0, 5.5]}, split="test")
    with pytest.raises(HFRowError, match=re.escape(f"{where}@test row 1: gold score 5.5 outside [0, 5]")):
        read_source(src)
    src, where = _bad(root, tmp_path, "sts", {**score, "score": [1.0, 2.0]}, values={"split": "validation"})
    with pytest.raises(
        HFRowError, match=re.escape(f"{where} row 0: split 'validation' is not one of train, dev, test")
    ):
        read_source(src)

    src, where = _bad(root, tmp_path, "wiki1m", {"text": ["fine", "bad \x07 bell"]})
    assert read_source(src)[1].examples == {
        "control_lines": [f"{where} row 1: text: control character U+0007 at column 5"]
    }
    with pytest.raises(
        HFRowError, match=re.escape(f"{where} row 1: text: control character U+0007 at column 5 (strict")
    ):
        read_source(src, strict=True)


def test_loading_errors_are_named(root, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"missing HF dataset source hf:{tmp_path / 'nope'}: expected a folder"):
        _resolve(root, "wiki1m", str(tmp_path / "nope"))
    datasets.DatasetDict(
        {"a": datasets.Dataset.from_dict({"text": ["x"]}), "b": datasets.Dataset.from_dict({"text": ["y"]})}
    ).save_to_disk(tmp_path / "two")
    with pytest.raises(HFSourceError, match="several splits; it has a, b"):
        _resolve(root, "wiki1m", str(tmp_path / "two"))
    with pytest.raises(HFSourceError, match="no split 'c'; it has a, b"):
        _resolve(root, "wiki1m", f"hf:{tmp_path / 'two'}@c")
    assert read_source(_resolve(root, "wiki1m", f"hf:{tmp_path / 'two'}@b"))[0].column("text").to_pylist() == ["y"]
    with pytest.raises(HFSourceError, match=r"hf:no-such/dataset-xyz@train: datasets.load_dataset failed"):
        _resolve(root, "wiki1m", "hf:no-such/dataset-xyz@train")  # offline here (HF_HUB_OFFLINE): never the network


def test_config_takes_the_short_form_and_refuses_two_origins(tmp_path):
    cfg = SentEvalSource(
        hf=["hf:mteb/stsbenchmark-sts@test", {"dataset": "mteb/sickr-sts", "values": {"task": "sickr"}}]
    )
    assert [h.describe() for h in cfg.hf] == ["hf:mteb/stsbenchmark-sts@test", "hf:mteb/sickr-sts"]
    assert NliSource(hf="hf:princeton-nlp/datasets-for-simcse:default@train").hf[0].config == "default"
    assert WikiSource().hf == () and IngestConfig().wiki.path is None
    with pytest.raises(ValidationError, match="either path .* or hf"):
        WikiSource(path=str(tmp_path / "w.txt"), hf="hf:x")
    with pytest.raises(ValidationError, match="expected hf:<dataset>"):
        WikiSource(hf="hf:x@")


def test_the_ingest_stage_reads_an_hf_source_and_caches_it(tmp_path, isolated_home):
    from cse.tasks.ingest import ingest_dataset

    datasets.Dataset.from_dict({"sent0": ["a", "b"], "sent1": ["c", "d"], "hard_neg": ["e", "f"]}).save_to_disk(
        tmp_path / "nli"
    )
    cfg = IngestConfig(nli=NliSource(hf=f"hf:{tmp_path / 'nli'}", expected_rows=2))
    first = ingest_dataset.fn("nli", cfg)
    root = DataRoot(isolated_home / "data")
    m = root.require("nli", first.key)
    assert m.rows == 2 and m.source["origin"] == "hf" and m.source["location"] == f"hf:{tmp_path / 'nli'}"
    assert m.inputs["source"] == _resolve(root, "nli", str(tmp_path / "nli")).content_hash
    again = ingest_dataset.fn("nli", cfg)
    assert again.cache_hit and again.key == first.key
    datasets.Dataset.from_dict({"sent0": ["g"], "sent1": ["h"], "hard_neg": ["i"]}).save_to_disk(tmp_path / "other")
    with pytest.raises(ValueError, match=re.escape(f"hf:{tmp_path / 'other'}: 1 rows, expected 2")):  # a miss: checked
        ingest_dataset.fn("nli", IngestConfig(nli=NliSource(hf=f"hf:{tmp_path / 'other'}", expected_rows=2)))
