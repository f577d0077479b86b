"""`cse push`: upload an export folder (a sentence-transformers export or a PEFT adapter, with its model card) to a
Hugging Face hub model repository.

A folder is pushed only when it is complete: a model card (`README.md` with YAML front matter, written by
`cse.tracking.model_card.write_model_card` or `cse card RUN_DIR`) and `modules.json` (sentence-transformers) or
`adapter_config.json` (PEFT). The upload is `HfApi.create_repo(exist_ok=True)` then `HfApi.upload_folder` (one
commit); a `revision` other than `main` is created as a branch first. The token comes from an environment variable
(`--token-env`, default `HF_TOKEN`; unset: the hub's own stored login) and is never printed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from huggingface_hub import HfApi

CARD_FILE = "README.md"
MODEL_FILES = ("modules.json", "adapter_config.json")  # a sentence-transformers export / a PEFT adapter
DEFAULT_TOKEN_ENV = "HF_TOKEN"
# Never uploaded: leftovers of interrupted atomic writes (storage/atomic.py) and lock files.
IGNORE_PATTERNS = [".tmp-*", "**/.tmp-*", "*.lock", "**/*.lock"]
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
_TRUE = {"1", "on", "yes", "true"}


class ExportFolderError(ValueError):
    """The folder is not a complete export (no model card, or neither modules.json nor adapter_config.json)."""


@dataclass(frozen=True)
class PushResult:
    """The outcome of a hub push: the repository id, its URL and the URL of the upload commit."""

    repo_id: str
    url: str  # the repository (at `revision` when one was given)
    commit_url: str | None


def check_export_folder(folder: str | Path) -> Path:
    """`folder` when it holds a model card with front matter and a model (`modules.json` or `adapter_config.json`);
    an `ExportFolderError` naming what is missing otherwise."""
    if not str(folder).strip():  # Path("") is the current folder: never pushed by accident
        raise ExportFolderError("no export folder given (an empty path): name the export folder to push")
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ExportFolderError(
            f"{folder} is not a folder (expected an export folder: $CSE_HOME/runs/<method>/<key>/export)"
        )
    card = folder / CARD_FILE
    if not card.is_file():
        raise ExportFolderError(
            f"{folder} has no model card ({CARD_FILE}): write one with `cse card RUN_DIR` "
            "(the job folder that holds this export) before pushing"
        )
    _check_front_matter(card)
    if not any((folder / name).is_file() for name in MODEL_FILES):
        raise ExportFolderError(
            f"{folder} holds neither modules.json (a sentence-transformers export) nor "
            "adapter_config.json (a PEFT adapter): nothing to push"
        )
    return folder


def _check_front_matter(card: Path) -> None:
    text = card.read_text(encoding="utf-8")
    match = re.match(r"---\n(.*?)\n---\n", text, flags=re.S)
    if match is None:
        raise ExportFolderError(
            f"{card}: no YAML front matter (the hub reads the model's metadata from it): "
            "regenerate it with `cse card RUN_DIR`"
        )
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError as e:
        raise ExportFolderError(f"{card}: the front matter is not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(meta, dict):
        raise ExportFolderError(f"{card}: the front matter is not a YAML mapping")


def resolve_token(token_env: str | None) -> str | None:
    """The token in `$token_env`. None → `$HF_TOKEN` when set, else None (the hub's stored login); a variable named
    explicitly must be set."""
    if token_env is None:
        return os.environ.get(DEFAULT_TOKEN_ENV) or None
    token = os.environ.get(token_env)
    if not token:
        raise ValueError(f"--token-env {token_env}: the environment variable {token_env} is not set (or empty)")
    return token


def push_export(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token_env: str | None = None,
    commit_message: str | None = None,
) -> PushResult:
    """Upload the export `folder` to the hub model repository `repo_id` (created when missing; `private` makes a new
    repository private) as one commit on `revision` (default: the main branch). Returns the URLs."""
    folder = check_export_folder(folder)
    if not _REPO_ID.match(repo_id):
        raise ValueError(f"{repo_id!r} is not a hub repository id (expected `owner/name` or `name`)")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        raise RuntimeError("HF_HUB_OFFLINE is set: the hub cannot be reached in offline mode; unset it to push")
    api = HfApi(token=resolve_token(token_env))
    repo_url = api.create_repo(repo_id, private=True if private else None, repo_type="model", exist_ok=True)
    if revision and revision != "main":
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    info = api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        repo_type="model",
        revision=revision,
        commit_message=commit_message or f"cse push {folder.name}",
        ignore_patterns=IGNORE_PATTERNS,
    )
    url = str(getattr(repo_url, "url", repo_url)).rstrip("/")
    if revision:
        url += f"/tree/{revision}"
    return PushResult(repo_id=repo_id, url=url, commit_url=getattr(info, "commit_url", None))
