"""Item 3: no silent data loss or contamination at ingestion."""

from __future__ import annotations

import pytest

from cse.config.stages import IngestConfig, NliSource, SentEvalSource, WikiSource
from cse.storage.datasets import read_dataset
from cse.storage.readers import DataFormatError, read_nli, read_senteval, read_wiki1m
from tests.reliability.conftest import data_runs, ingest


def test_sick_without_header_is_an_error_not_a_lost_pair(sources):
    f = sources["sts"] / "SICK" / "SICK_test_annotated.txt"
    f.write_text("".join(f.read_text().splitlines(keepends=True)[1:]))
    with pytest.raises(DataFormatError, match=r"SICK_test_annotated\.txt:1: expected the SICK header"):
        read_senteval(sources["sts"])


def test_senteval_row_counts_are_checked(sources, ingest_config):
    f = sources["sts"] / "STS" / "STSBenchmark" / "sts-dev.csv"
    f.write_text("".join(f.read_text().splitlines(keepends=True)[:-1]))  # one pair short: still well-formed
    read_senteval(sources["sts"])  # the parser alone accepts it ...
    with pytest.raises(DataFormatError, match=r"sts-dev\.csv: 1,499 scored pairs of stsb/dev, expected 1,500"):
        ingest("sts", ingest_config)  # ... the stage checks every count of ../shared/data/README.md
    assert data_runs("ingest-sts")[-1].info.status == "FAILED"


def test_bom_is_stripped_and_recorded_in_every_text_source(tmp_path, root):
    wiki = tmp_path / "wiki.txt"
    wiki.write_bytes("\ufefffirst sentence .\nsecond .\n".encode())
    nli = tmp_path / "nli.csv"
    nli.write_bytes("\ufeffsent0,sent1,hard_neg\na,b,c\n".encode())
    table, st = read_wiki1m(wiki)
    assert table.column("text")[0].as_py() == "first sentence ." and st.details["bom"] == 1
    table, st = read_nli(nli)
    assert table.num_rows == 1 and st.details["bom"] == 1

    cfg = IngestConfig(wiki=WikiSource(path=str(wiki)))
    ref = ingest("wiki1m", cfg)
    m = root.require("wiki1m", ref.key)
    assert m.stats["bom"] == 1 and "wiki.txt:1" in m.stats["examples"]["bom"][0]
    assert read_dataset(root, "wiki1m", ref.key).column("text")[0].as_py() == "first sentence ."
    assert data_runs("ingest-wiki1m")[-1].data.metrics["bom"] == 1


def _dirty_wiki(tmp_path):
    p = tmp_path / "wiki.txt"
    p.write_bytes(b"clean line .\nnul \x00 inside .\n" + b"x" * 100_000 + b"\nlast .\n")
    return p


def test_control_characters_and_long_lines_are_counted(tmp_path, root):
    ref = ingest("wiki1m", IngestConfig(wiki=WikiSource(path=str(_dirty_wiki(tmp_path)))))
    m = root.require("wiki1m", ref.key)
    assert (m.stats["control_lines"], m.stats["long_lines"]) == (1, 1)
    assert m.stats["examples"]["control_lines"][0].endswith("wiki.txt:2: control character U+0000 at column 5")
    assert "wiki.txt:3: 100,000 characters" in m.stats["examples"]["long_lines"][0]
    metrics = data_runs("ingest-wiki1m")[-1].data.metrics
    assert (metrics["control_lines"], metrics["long_lines"]) == (1, 1)


def test_strict_turns_them_into_errors_naming_file_and_line(tmp_path):
    p = _dirty_wiki(tmp_path)
    with pytest.raises(DataFormatError, match=r"wiki\.txt:2: control character U\+0000"):
        ingest("wiki1m", IngestConfig(wiki=WikiSource(path=str(p)), strict=True))
    p.write_bytes(b"ok .\n" + b"y" * 100_000 + b"\n")
    with pytest.raises(DataFormatError, match=r"wiki\.txt:2: 100,000 characters, over max_line_chars 10,000"):
        ingest("wiki1m", IngestConfig(wiki=WikiSource(path=str(p)), strict=True))
    nli = tmp_path / "nli.csv"
    nli.write_bytes(b"sent0,sent1,hard_neg\na,b\x07,c\n")
    with pytest.raises(DataFormatError, match=r"nli\.csv:2: control character U\+0007"):
        ingest("nli", IngestConfig(nli=NliSource(path=str(nli)), strict=True))


def test_real_senteval_passes_the_count_check(shared_data):
    cfg = IngestConfig(senteval=SentEvalSource(path=str(shared_data / "senteval")))
    assert ingest("sts", cfg).rows == 31099
