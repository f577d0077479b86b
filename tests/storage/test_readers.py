"""Source parsers: real counts on the local mirror, and file:line errors on malformed fixtures."""

from __future__ import annotations

import pytest

from cse.storage.readers import DataFormatError, read_nli, read_senteval, read_wiki1m, senteval_root

EXPECTED_TEST = {"sts12": 3108, "sts13": 1500, "sts14": 3750, "sts15": 3000, "sts16": 1186, "stsb": 1379, "sickr": 4927}


@pytest.fixture(scope="module")
def sts_table(shared_data):
    table, stats = read_senteval(shared_data / "senteval")
    return table.to_pandas(), stats


def test_senteval_counts_match_the_papers(sts_table):
    df, _ = sts_table
    counts = df[df.split == "test"].groupby("task").size().to_dict()
    assert counts == EXPECTED_TEST
    assert (df[(df.task == "stsb") & (df.split == "dev")].shape[0]) == 1500
    assert (df[(df.task == "sickr") & (df.split == "dev")].shape[0]) == 500


def test_senteval_subsets_and_unscored_pairs(sts_table):
    df, stats = sts_table
    assert "SMT" not in set(df[df.task == "sts13"].subset)
    sts16 = df[df.task == "sts16"].groupby("subset").size().to_dict()
    assert sts16 == {
        "answer-answer": 254,
        "headlines": 249,
        "plagiarism": 230,
        "postediting": 244,
        "question-question": 209,
    }
    assert stats.skipped > 0  # STS15/16 gold files leave unscored lines
    assert df.score.between(0, 5).all()
    # SentEval whitespace-splits and re-joins every sentence
    assert not df.sentence1.str.contains(r"\s\s|\t").any()


def test_real_training_samples_round_trip_counts(shared_data):
    wiki, ws = read_wiki1m(shared_data / "wiki1m_head.txt")
    nli, ns = read_nli(shared_data / "snli_triplets.csv")
    assert (wiki.num_rows, ws.rows) == (11913, 11913)
    assert (nli.num_rows, ns.rows) == (5864, 5864)
    assert nli.column_names == ["id", "sent0", "sent1", "hard_neg"]


def test_wiki_invalid_utf8_names_file_and_line(tmp_path):
    p = tmp_path / "wiki.txt"
    p.write_bytes(b"fine line\nsecond \xff\xfe broken\n")
    with pytest.raises(DataFormatError, match=r"wiki\.txt:2: invalid UTF-8"):
        read_wiki1m(p)


def test_wiki_empty_lines_are_counted_not_dropped(tmp_path):
    p = tmp_path / "wiki.txt"
    p.write_text("a sentence .\n\n   \nanother .\n")
    table, stats = read_wiki1m(p)
    assert table.num_rows == 4 and stats.empty == 2


def test_nli_wrong_column_count(tmp_path):
    p = tmp_path / "nli.csv"
    p.write_text('sent0,sent1,hard_neg\na,b,c\n"x, y",z\n')
    with pytest.raises(DataFormatError, match=r"nli\.csv:3: 2 columns, expected 3"):
        read_nli(p)


def test_nli_bad_header(tmp_path):
    p = tmp_path / "nli.csv"
    p.write_text("premise,hypothesis,neg\na,b,c\n")
    with pytest.raises(DataFormatError, match=r"nli\.csv:1: header"):
        read_nli(p)


def _mini_senteval(root, gold_line="4.0"):
    for task, subsets in {
        "STS12-en-test": ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"),
        "STS13-en-test": ("FNWN", "headlines", "OnWN"),
        "STS14-en-test": ("deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"),
        "STS15-en-test": ("answers-forums", "answers-students", "belief", "headlines", "images"),
        "STS16-en-test": ("answer-answer", "headlines", "plagiarism", "postediting", "question-question"),
    }.items():
        d = root / "STS" / task
        d.mkdir(parents=True)
        for s in subsets:
            (d / f"STS.input.{s}.txt").write_text("a  man .\ta man .\nb .\tc .\n")
            (d / f"STS.gs.{s}.txt").write_text(f"{gold_line}\n\n")
    b = root / "STS" / "STSBenchmark"
    b.mkdir(parents=True)
    for split in ("train", "dev", "test"):
        (b / f"sts-{split}.csv").write_text("g\tf\t2012\t0001\t5.000\ta b .\ta b .\n")
    s = root / "SICK"
    s.mkdir()
    for name in ("SICK_train.txt", "SICK_trial.txt", "SICK_test_annotated.txt"):
        (s / name).write_text(
            "pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n1\tA b\tA c\t3.5\tNEUTRAL\n"
        )
    return root


def test_senteval_fixture_parses_and_skips_unscored(tmp_path):
    table, stats = read_senteval(_mini_senteval(tmp_path))
    df = table.to_pandas()
    assert (df[df.task == "sts12"].shape[0]) == 5  # one scored pair per subset, the unscored one skipped
    assert stats.skipped == 24
    assert df[df.task == "sts12"].sentence1.iloc[0] == "a man ."


def test_senteval_unparsable_score_names_gold_file_and_line(tmp_path):
    _mini_senteval(tmp_path, gold_line="four")
    with pytest.raises(DataFormatError, match=r"STS\.gs\.MSRpar\.txt:1: gold score 'four' is not a number"):
        read_senteval(tmp_path)


def test_senteval_wrong_field_count(tmp_path):
    _mini_senteval(tmp_path)
    (tmp_path / "STS" / "STSBenchmark" / "sts-dev.csv").write_text("g\tf\t2012\t0001\t5.000\tonly one sentence\n")
    with pytest.raises(DataFormatError, match=r"sts-dev\.csv:1: 6 tab-separated fields"):
        read_senteval(tmp_path)


def test_senteval_missing_folder_says_what_was_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected folders STS/ and SICK/"):
        senteval_root(tmp_path)
    _mini_senteval(tmp_path)
    (tmp_path / "SICK" / "SICK_trial.txt").unlink()
    with pytest.raises(FileNotFoundError, match="missing SICK dev split: expected a file at .*SICK_trial.txt"):
        read_senteval(tmp_path)
