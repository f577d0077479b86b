"""Containment: every dataset key, job folder and other name that reaches the data root or `$CSE_HOME` from a user
(the `cse` command line, a flow parameter, a configuration) is checked here before any path is built from it.

- A key (dataset key, run key, method name) is one path component: letters, digits, `.`, `_`, `-`, starting with a
  letter or digit, at most 200 characters, never `..`. So `<data root>/datasets/<kind>/<key>` can never leave its
  kind's folder (`../../etc`, `../wiki1m/<key>` and absolute paths are refused).
- A folder a command takes (a training job folder) must have the shape the command expects, said in the refusal, and
  lie inside the `$CSE_HOME` of the command (`cse card` writes there).
- A training job's folder is reached from `$CSE_HOME` without a symbolic link (`no_links_below`): a link under
  `<CSE_HOME>/runs` would send the job's writes outside `$CSE_HOME`, and every later stage, which checks the folder's
  shape, would refuse it. So the link is refused before the job starts.

Refusals are `PathRefused` (a `ValueError`): one line naming what was given and what was expected.
"""

from __future__ import annotations

import re
from pathlib import Path

_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_RESERVED_SUFFIXES = (".shards", ".lock")  # work folders and locks beside the datasets


class PathRefused(ValueError):
    """A key or folder from a user that would leave its root, or does not have the expected shape."""


def check_key(key: object, what: str = "dataset key") -> str:
    """`key` when it is a safe single path component (see the module docstring); `PathRefused` naming it otherwise.

    Args:
        key: the key as given (CLI argument, flow parameter, configuration value).
        what: what the key names, for the message ("nli dataset key", "run key", ...).
    """
    if not isinstance(key, str) or not _KEY.fullmatch(key) or ".." in key or key.endswith(_RESERVED_SUFFIXES):
        raise PathRefused(
            f"{what} {key!r} refused: a key is one name of letters, digits, '.', '_' and '-' "
            "(no '/', no '..', at most 200 characters), e.g. the key `cse report` lists"
        )
    return key


def contained(base: str | Path, path: str | Path, what: str) -> Path:
    """`path` (relative paths are taken from `base`) resolved, when it lies inside `base`; `PathRefused` otherwise.

    Args:
        base: the root the path must stay in (the data root, `$CSE_HOME/runs`).
        path: the path as given.
        what: what the path names, for the message.
    """
    base = Path(base).expanduser().resolve()
    resolved = (base / Path(path).expanduser()).resolve()
    if not resolved.is_relative_to(base):
        raise PathRefused(f"{what} {str(path)!r} refused: it resolves to {resolved}, outside {base}")
    return resolved


def no_links_below(home: str | Path, parts: tuple[str, ...], what: str) -> Path:
    """`home/parts...`, refused (`PathRefused`) when an existing folder on the way from `home` is a symbolic link.

    Args:
        home: the root (itself may be reached through links: it is resolved).
        parts: the names below it (`("runs", method, run key)`).
        what: what the folder is, for the message.
    """
    path = Path(home).expanduser().resolve()
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise PathRefused(
                f"{path} is a symbolic link to {path.resolve()}: refused before the {what} is made (its writes would "
                f"leave {Path(home).expanduser().resolve()}, and its later stages refuse such a folder). Remove the "
                "link, or set CSE_HOME to a folder on the disk you want the runs on"
            )
    return path


def job_folder(path: str | Path, home: str | Path | None = None) -> tuple[Path, str, str]:
    """`(home, method, run key)` of a training job folder `<home>/runs/<method>/<run key>`; `PathRefused` saying what
    was expected when `path` does not have that shape (or is no folder), or lies outside `home`.

    Args:
        path: the folder as given (`cse card`, `cse deliver-metrics`, a distributed job's hand-over).
        home: the `$CSE_HOME` the folder must lie in (the commands' own); None checks the shape only.
    """
    resolved = Path(path).expanduser().resolve()
    expected = "a training job folder <CSE_HOME>/runs/<method>/<run key> (the run_dir tag of its MLflow run)"
    if len(resolved.parents) < 3 or resolved.parent.parent.name != "runs":
        raise PathRefused(f"{str(path)!r} is not {expected}")
    if home is not None and resolved.parents[2] != Path(home).expanduser().resolve():
        raise PathRefused(
            f"{str(path)!r} is not {expected}: it lies outside CSE_HOME={Path(home).expanduser().resolve()} "
            "(set CSE_HOME to the home the job belongs to)"
        )
    method, key = resolved.parent.name, resolved.name
    check_key(method, f"method of job folder {str(path)!r}")
    check_key(key, f"run key of job folder {str(path)!r}")
    if not resolved.is_dir():
        raise FileNotFoundError(f"no job folder at {resolved} (expected {expected})")
    return resolved.parents[2], method, key
