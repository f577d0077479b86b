"""The manifest's seal: an edit of a published dataset that rewrites its manifest consistently is still found.

A manifest records the sizes, row counts and sha256 of the dataset's files, so a changed file is found by comparing
it with the manifest. Someone who edits a Parquet part *and* rewrites those numbers in the manifest passes that
comparison. So every manifest written into a data root is sealed: `seal` is an HMAC-SHA256 of the manifest's other
fields (canonical JSON) under the data root's seal key (`<data root>/.seal-key`, 32 random bytes made on the first
write, readable by its owner only). Every check of a dataset recomputes it (`check_seal`, cheap: no file is read
but the manifest); an edited manifest no longer matches.

What it guarantees: an edit of a dataset's files or manifest by anything that does not use the seal key (an editor,
a script rewriting the JSON, another tool) is found by the next check. A process that reads the key can forge a
seal; the seal is tamper-evidence, not a signature against someone with the data root's key. Manifests written
before the seal existed have none and are checked as before (sizes, rows, hashes; the Arrow copy against the
Parquet parts with `full`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any, Literal, overload

from cse.storage.hashing import canonical_json

SEAL_KEY_FILE = ".seal-key"


def data_root_of(folder: str | Path) -> Path | None:
    """The data root holding dataset folder `folder` (`<root>/datasets/<kind>/<key or temporary name>`), else None."""
    folder = Path(folder).resolve()
    return folder.parents[2] if len(folder.parents) > 2 and folder.parents[1].name == "datasets" else None


@overload
def seal_key(root: str | Path, create: Literal[True]) -> bytes: ...
@overload
def seal_key(root: str | Path, create: bool) -> bytes | None: ...
def seal_key(root: str | Path, create: bool) -> bytes | None:
    """The data root's seal key: read, or with `create` made first when there is none (by one atomic link, so two
    processes making it at once agree). None when there is none and `create` is False."""
    path = Path(root) / SEAL_KEY_FILE
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        if not create:
            return None
    tmp = path.with_name(f"{SEAL_KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # fails when another process made it first: theirs is the key
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return bytes.fromhex(path.read_text().strip())


def compute_seal(fields: dict[str, Any], key: bytes) -> str:
    """The seal of a manifest's fields (all but `seal` itself) under `key`."""
    body = canonical_json({k: v for k, v in fields.items() if k != "seal"})
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def seal_for(folder: str | Path, fields: dict[str, Any]) -> str | None:
    """The seal of a manifest about to be written into `folder`; None outside a data root (a manifest written
    elsewhere is not sealed)."""
    root = data_root_of(folder)
    return None if root is None else compute_seal(fields, seal_key(root, create=True))


def check_seal(folder: str | Path, fields: dict[str, Any]) -> str | None:
    """What is wrong with the seal of the manifest `fields` read from `folder` (None when it matches, or when the
    manifest has none: written before seals, or outside a data root)."""
    if not fields.get("seal"):
        return None
    root = data_root_of(folder)
    if root is None:
        return None
    key = seal_key(root, create=False)
    if key is None:
        return (
            f"the manifest is sealed but the data root's seal key {root / SEAL_KEY_FILE} is missing: its content "
            "cannot be trusted (was the data root copied without its hidden files?)"
        )
    if not hmac.compare_digest(compute_seal(fields, key), str(fields["seal"])):
        return (
            "the manifest's seal does not match its content: the manifest was edited after the dataset was published "
            "(its files' sizes, rows or hashes rewritten?)"
        )
    return None
