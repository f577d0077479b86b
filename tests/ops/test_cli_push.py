"""`cse push EXPORT_DIR REPO_ID` (ops/publish.py) against a local fake of the hub's upload calls: the calls and their
arguments, the printed URL, the token never printed, and the refusals (no model card, no front matter, no model,
an unset token variable, offline mode, a bad repository id) made before any call. No network: the HfApi methods are
replaced, and huggingface_hub itself was imported in offline mode (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import CommitInfo, HfApi, RepoUrl

from cse.ops.cli import main as cse
from cse.ops.publish import IGNORE_PATTERNS, ExportFolderError, check_export_folder
from cse.tracking.model_card import CardFacts, write_model_card

SECRET = "hf_secret_token_value_123"


def _namespaced(repo_id: str) -> str:
    """The hub puts a bare repository name in the token owner's namespace (here `me`)."""
    return repo_id if "/" in repo_id else f"me/{repo_id}"


@pytest.fixture
def hub(monkeypatch):
    """The HfApi calls `cse push` makes, recorded instead of sent."""
    calls: list[tuple[str, tuple, dict]] = []

    def create_repo(self, repo_id, **kw):
        calls.append(("create_repo", (repo_id,), {**kw, "token": self.token}))
        return RepoUrl(f"https://huggingface.co/{_namespaced(repo_id)}")

    def create_branch(self, repo_id, **kw):
        calls.append(("create_branch", (repo_id,), kw))

    def upload_folder(self, **kw):
        calls.append(("upload_folder", (), {**kw, "files": sorted(p.name for p in Path(kw["folder_path"]).iterdir())}))
        return CommitInfo(
            commit_url=f"https://huggingface.co/{_namespaced(kw['repo_id'])}/commit/abc123",
            commit_message="m",
            commit_description="",
            oid="abc123",
        )

    for call in (create_repo, create_branch, upload_folder):
        monkeypatch.setattr(HfApi, call.__name__, call)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the command's own offline check; the library stays offline
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return calls


def _facts() -> CardFacts:
    return CardFacts(
        method="d2cse",
        method_title="D2CSE",
        preset="default",
        backbone="bert-base-uncased",
        setting="unsup",
        metrics={"stsb": 82.0},
        git_commit="abc",
    )


@pytest.fixture
def export(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "modules.json").write_text("[]")
    (folder / ".tmp-weights-123-abcd").write_text("leftover of a killed writer")
    write_model_card(folder, _facts())
    return folder


def test_push_uploads_the_folder_and_prints_the_url(hub, export, monkeypatch, capsys):
    monkeypatch.setenv("MY_HF_TOKEN", SECRET)
    argv = ["push", str(export), "me/d2cse-bert", "--private", "--revision", "v1", "--token-env", "MY_HF_TOKEN"]
    assert cse(argv) == 0
    assert [name for name, _, _ in hub] == ["create_repo", "create_branch", "upload_folder"]
    assert hub[0][1:] == (
        ("me/d2cse-bert",),
        {"private": True, "repo_type": "model", "exist_ok": True, "token": SECRET},
    )
    assert hub[1][1:] == (("me/d2cse-bert",), {"branch": "v1", "repo_type": "model", "exist_ok": True})
    up = hub[2][2]
    assert up["repo_id"] == "me/d2cse-bert" and up["folder_path"] == str(export) and up["revision"] == "v1"
    assert up["repo_type"] == "model" and up["ignore_patterns"] == IGNORE_PATTERNS and ".tmp-*" in IGNORE_PATTERNS
    out, err = capsys.readouterr()
    assert out.strip() == (
        f"pushed {export} to https://huggingface.co/me/d2cse-bert/tree/v1 "
        "(commit https://huggingface.co/me/d2cse-bert/commit/abc123)"
    )
    assert SECRET not in out + err


def test_push_defaults_public_main_and_hf_token(hub, export, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert cse(["push", str(export), "d2cse-bert"]) == 0
    assert [name for name, _, _ in hub] == ["create_repo", "upload_folder"]  # no branch for the main branch
    assert hub[0][2]["private"] is None and hub[0][2]["token"] == SECRET
    assert hub[1][2]["revision"] is None and hub[1][2]["commit_message"] == "cse push export"
    assert capsys.readouterr().out.startswith(f"pushed {export} to https://huggingface.co/me/d2cse-bert (commit ")


def test_push_accepts_a_peft_adapter_folder(hub, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    write_model_card(adapter, _facts())
    assert cse(["push", str(adapter), "me/adapter"]) == 0
    assert hub[-1][2]["files"] == ["README.md", "adapter_config.json"]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "README.md").unlink(), "has no model card (README.md)"),
        (lambda f: (f / "README.md").write_text("# a card without front matter\n"), "no YAML front matter"),
        (lambda f: (f / "README.md").write_text("---\nkey: [unclosed\n---\n"), "front matter is not valid YAML"),
        (lambda f: (f / "modules.json").unlink(), "neither modules.json"),
    ],
)
def test_push_refuses_an_incomplete_export(hub, export, damage, message, capsys):
    damage(export)
    assert cse(["push", str(export), "me/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cse: error: ExportFolderError: ") and message in err
    assert hub == []
    with pytest.raises(ExportFolderError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_export_folder(export)


def test_push_refuses_before_any_call(hub, export, monkeypatch, tmp_path, capsys):
    assert cse(["push", str(tmp_path / "absent"), "me/model"]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert cse(["push", str(export), "me/model", "--token-env", "UNSET_TOKEN_VAR"]) == 2
    assert "UNSET_TOKEN_VAR is not set" in capsys.readouterr().err
    assert cse(["push", str(export), "not a/repo id"]) == 2
    assert "not a hub repository id" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cse(["push", str(export), "me/model"]) == 2
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err
    assert hub == []
