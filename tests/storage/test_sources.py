"""storage/sources.py: a configured source resolves to a local path, the mirror, or a download (from a local HTTP
server here), with its content hash; `read_source` parses it."""

from __future__ import annotations

import hashlib
import io
import re
import tarfile

import pytest

from cse.storage.fetch import ChecksumError
from cse.storage.hashing import sha256_files
from cse.storage.layout import DataRoot
from cse.storage.readers import DataFormatError, senteval_source_files
from cse.storage.sources import ResolvedSource, read_source, resolve_source

WIKI = "first sentence\nsecond one\n\nfourth after an empty line\n"
NLI = 'sent0,sent1,hard_neg\na man,a person,a woman\n"quoted, with comma",b,c\n'


@pytest.fixture
def root(tmp_path) -> DataRoot:
    return DataRoot(tmp_path / "data")


@pytest.fixture(autouse=True)
def no_mirror(monkeypatch):
    monkeypatch.delenv("CSE_SOURCE_MIRROR", raising=False)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_local_path_wins(root, tmp_path, monkeypatch):
    wiki = tmp_path / "my_wiki.txt"
    wiki.write_text(WIKI)
    monkeypatch.setenv("CSE_SOURCE_MIRROR", str(tmp_path / "no-such-mirror"))  # not consulted
    src = resolve_source(root, "wiki1m", str(wiki), "http://127.0.0.1:9/never", sha256=None, retries=0)
    assert src == ResolvedSource("wiki1m", wiki.resolve(), "path", str(wiki), _sha(WIKI))
    assert src.describe() == {"dataset": "wiki1m", "origin": "path", "location": str(wiki), "file": str(wiki.resolve())}
    assert not root.downloads.exists()

    table, stats = read_source(src)
    assert table.column("text").to_pylist() == ["first sentence", "second one", "", "fourth after an empty line"]
    assert table.column("id").to_pylist() == [0, 1, 2, 3] and stats.rows == 4 and stats.empty == 1


def test_a_missing_or_wrong_local_source_is_named(root, tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"missing nli source: expected a file at {tmp_path / 'nope.csv'}"):
        resolve_source(root, "nli", str(tmp_path / "nope.csv"), "http://127.0.0.1:9/x", sha256=None, retries=0)
    with pytest.raises(FileNotFoundError, match=rf"missing sts source: expected a folder at {tmp_path / 'st'}"):
        resolve_source(root, "sts", str(tmp_path / "st"), "http://127.0.0.1:9/x", sha256=None, retries=0)
    with pytest.raises(
        FileNotFoundError, match=rf"wiki1m source {tmp_path} is a folder: expected the file wiki1m_for_simcse\.txt"
    ):
        resolve_source(root, "wiki1m", str(tmp_path), "http://127.0.0.1:9/x", sha256=None, retries=0)
    nli = tmp_path / "nli.csv"
    nli.write_text(NLI)
    with pytest.raises(ChecksumError, match=f"{nli.resolve()}: sha256"):
        resolve_source(root, "nli", str(nli), "http://127.0.0.1:9/x", sha256="0" * 64, retries=0)
    assert resolve_source(
        root, "nli", str(nli), "http://127.0.0.1:9/x", sha256=_sha(NLI), retries=0
    ).content_hash == _sha(NLI)


def test_the_mirror_stands_in_for_the_network(root, tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "snli_triplets.csv").write_text(NLI)  # the sample name of the NLI source
    monkeypatch.setenv("CSE_SOURCE_MIRROR", str(mirror))
    src = resolve_source(root, "nli", None, "http://127.0.0.1:9/never", sha256=None, retries=0)
    assert (src.origin, src.path, src.content_hash) == ("mirror", (mirror / "snli_triplets.csv").resolve(), _sha(NLI))
    table, _ = read_source(src)
    assert table.column("sent0").to_pylist() == ["a man", "quoted, with comma"]


def test_a_url_is_downloaded_once_into_the_data_root(root, http_server):
    url = http_server.serve("/wiki1m_for_simcse.txt", WIKI.encode())
    src = resolve_source(root, "wiki1m", None, url, sha256=_sha(WIKI), retries=0)
    assert (src.origin, src.location, src.path) == ("url", url, root.downloads / "wiki1m_for_simcse.txt")
    assert src.path.read_text() == WIKI and src.content_hash == _sha(WIKI)
    again = resolve_source(root, "wiki1m", None, url, sha256=_sha(WIKI), retries=0)
    assert again == src and http_server.hits["/wiki1m_for_simcse.txt"] == 1  # the cached download


def test_senteval_from_a_folder_and_from_an_archive(root, shared_data, http_server):
    folder = shared_data / "senteval"
    local = resolve_source(root, "sts", str(folder), "http://127.0.0.1:9/x", sha256=None, retries=0)
    assert local.origin == "path" and local.content_hash == sha256_files(senteval_source_files(folder))

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in senteval_source_files(folder):
            tar.add(f, arcname=str(f.relative_to(folder)))
    url = http_server.serve("/senteval.tar", buf.getvalue())
    src = resolve_source(root, "sts", None, url, sha256=None, retries=0)
    assert src.origin == "url" and src.path == root.downloads / "senteval"
    assert (root.downloads / "senteval.tar").is_file()
    assert src.content_hash == local.content_hash  # the same files, whichever way they came


def test_strict_reading_turns_control_characters_and_long_lines_into_errors(root, tmp_path):
    wiki = tmp_path / "wiki.txt"
    wiki.write_text("fine\nbad \x07 bell\n")
    src = resolve_source(root, "wiki1m", str(wiki), "http://127.0.0.1:9/x", sha256=None, retries=0)
    table, stats = read_source(src)
    assert table.num_rows == 2 and stats.details == {"control_lines": 1}
    with pytest.raises(DataFormatError, match=re.escape(f"{src.path}:2: control character U+0007 at column 5")):
        read_source(src, strict=True)

    wiki.write_text("short\nten chars!\n")
    src = resolve_source(root, "wiki1m", str(wiki), "http://127.0.0.1:9/x", sha256=None, retries=0)
    with pytest.raises(DataFormatError, match=re.escape(f"{src.path}:2: 10 characters, over max_line_chars 6")):
        read_source(src, strict=True, max_line_chars=6)
