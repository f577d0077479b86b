"""storage/fetch.py: downloads from a local HTTP server (retries, truncation, checksums, the cache), the source
mirror, tar extraction."""

from __future__ import annotations

import hashlib
import io
import logging
import tarfile
import types

import pytest

from cse.storage import fetch
from cse.storage.atomic import TMP_PREFIX
from cse.storage.fetch import ChecksumError, download, extract_tar, mirror_lookup, verify

BODY = b"one sentence\nanother sentence\n" * 1000


@pytest.fixture
def no_sleep(monkeypatch) -> list[float]:
    """The backoff waits between download attempts, recorded instead of slept."""
    waits: list[float] = []
    monkeypatch.setattr(fetch, "time", types.SimpleNamespace(sleep=waits.append))
    return waits


def _leftovers(folder) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_download_writes_the_file_and_checks_its_hash(http_server, tmp_path):
    url = http_server.serve("/wiki.txt", BODY)
    dest = tmp_path / "downloads" / "wiki.txt"
    assert download(url, dest, sha256=hashlib.sha256(BODY).hexdigest().upper()) == dest
    assert dest.read_bytes() == BODY and _leftovers(dest.parent) == []


def test_a_cached_download_is_reused_without_a_request(http_server, tmp_path):
    url = http_server.serve("/wiki.txt", b"new content")
    dest = tmp_path / "wiki.txt"
    dest.write_bytes(BODY)
    assert download(url, dest) == dest
    assert dest.read_bytes() == BODY and http_server.hits["/wiki.txt"] == 0
    with pytest.raises(ChecksumError, match=f"{dest}: sha256 .*, expected {'0' * 64}"):
        download(url, dest, sha256="0" * 64)  # a cached file that fails its checksum is refused
    assert http_server.hits["/wiki.txt"] == 0


def test_a_wrong_checksum_after_downloading_names_the_file(http_server, tmp_path):
    url = http_server.serve("/wiki.txt", BODY)
    dest = tmp_path / "wiki.txt"
    with pytest.raises(ChecksumError, match=f"{dest}: sha256 {hashlib.sha256(BODY).hexdigest()}, expected {'a' * 64}"):
        download(url, dest, sha256="a" * 64)


def test_server_errors_are_retried_with_backoff(http_server, tmp_path, no_sleep, caplog):
    url = http_server.serve("/flaky.txt", BODY, fail_first=2, fail_status=503)
    dest = tmp_path / "flaky.txt"
    with caplog.at_level(logging.WARNING, logger="cse.storage.fetch"):
        download(url, dest, retries=3)
    assert dest.read_bytes() == BODY
    assert http_server.hits["/flaky.txt"] == 3 and no_sleep == [1, 2]
    assert caplog.text.count(f"download of {url} failed") == 2


def test_giving_up_says_what_to_do_and_leaves_nothing(http_server, tmp_path, no_sleep):
    url = http_server.serve("/down.txt", BODY, fail_first=99, fail_status=500)
    dest = tmp_path / "down.txt"
    with pytest.raises(ConnectionError, match=rf"could not download {url} after 3 attempts .*CSE_SOURCE_MIRROR"):
        download(url, dest, retries=2)
    assert http_server.hits["/down.txt"] == 3 and no_sleep == [1, 2]
    assert not dest.exists() and _leftovers(tmp_path) == []


def test_a_truncated_download_is_never_kept(http_server, tmp_path, no_sleep):
    url = http_server.serve("/short.txt", BODY, declared_length=len(BODY) * 2)  # the connection drops at half
    dest = tmp_path / "short.txt"
    with pytest.raises(ConnectionError, match=f"could not download {url} after 2 attempts"):
        download(url, dest, retries=1)
    assert http_server.hits["/short.txt"] == 2
    assert not dest.exists() and _leftovers(tmp_path) == []


def test_a_missing_url_is_an_error(http_server, tmp_path, no_sleep):
    with pytest.raises(ConnectionError, match="404"):
        download(http_server.base + "/nothing", tmp_path / "x", retries=0)
    assert not (tmp_path / "x").exists()


def test_verify_checks_size_and_hash(tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(b"12345")
    verify(f, hashlib.sha256(b"12345").hexdigest(), size=5)
    with pytest.raises(ChecksumError, match=f"{f}: size 5 bytes, expected 6"):
        verify(f, size=6)
    with pytest.raises(ChecksumError, match=f"{f}: sha256"):
        verify(f, sha256=hashlib.sha256(b"1234").hexdigest())


def test_mirror_lookup(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("CSE_SOURCE_MIRROR", raising=False)
    assert mirror_lookup("wiki1m_for_simcse.txt") is None

    monkeypatch.setenv("CSE_SOURCE_MIRROR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=rf"CSE_SOURCE_MIRROR={tmp_path} holds none of .*wiki1m_head\.txt"):
        mirror_lookup("wiki1m_for_simcse.txt")

    (tmp_path / "wiki1m_head.txt").write_text("a sample\n")
    with caplog.at_level(logging.WARNING, logger="cse.storage.fetch"):
        assert mirror_lookup("wiki1m_for_simcse.txt") == (tmp_path / "wiki1m_head.txt").resolve()
    assert "not the full canonical file" in caplog.text

    (tmp_path / "wiki1m_for_simcse.txt").write_text("the full file\n")  # the canonical name wins
    assert mirror_lookup("wiki1m_for_simcse.txt") == (tmp_path / "wiki1m_for_simcse.txt").resolve()

    (tmp_path / "other.bin").write_bytes(b"x")  # a name without alternatives is looked up as it is
    assert mirror_lookup("other.bin") == (tmp_path / "other.bin").resolve()


def _tar(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_extract_tar_once(tmp_path):
    archive = tmp_path / "senteval.tar"
    _tar(archive, {"STS/a.txt": b"alpha", "SICK/b.txt": b"beta"})
    dest = tmp_path / "downloads" / "senteval"
    assert extract_tar(archive, dest) == dest
    assert (dest / "STS" / "a.txt").read_bytes() == b"alpha" and (dest / "SICK" / "b.txt").read_bytes() == b"beta"

    _tar(archive, {"STS/a.txt": b"changed"})
    extract_tar(archive, dest)  # an extracted folder is reused as it is
    assert (dest / "STS" / "a.txt").read_bytes() == b"alpha"


def test_extract_tar_refuses_paths_outside_the_folder(tmp_path):
    archive = tmp_path / "evil.tar"
    _tar(archive, {"ok.txt": b"fine", "../escaped.txt": b"evil"})
    dest = tmp_path / "out" / "x"
    with pytest.raises(tarfile.FilterError):
        extract_tar(archive, dest)
    assert not dest.exists() and not (tmp_path / "out" / "escaped.txt").exists()
    assert _leftovers(tmp_path / "out") == []
