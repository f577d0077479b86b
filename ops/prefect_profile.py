"""The Prefect profile `cse`: what lets a plain shell (only the venv activated) reach this checkout's Prefect server.

`scripts/services.sh up` (so `make main`) runs `python -m cse.ops.prefect_profile`: it writes the profile `cse` with
`PREFECT_API_URL` of the running server into the profiles file a plain shell reads (`~/.prefect/profiles.toml`, or
under the shell's own `PREFECT_HOME` / `PREFECT_PROFILES_PATH`), and makes it the active profile, so that
`prefect deployment run ...` and `cse run ...` reach the server without `source scripts/env.sh`. Other profiles and
other settings of the profile are kept. `CSE_PREFECT_PROFILE` names another profile; set it empty to write none.

`scripts/env.sh` replaces `PREFECT_HOME` (the server's database lives under `$CSE_HOME/prefect`); it records the
shell's own value first as `CSE_SHELL_PREFECT_HOME`, which is where the profile goes.
"""

from __future__ import annotations

import os
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

DEFAULT_PROFILE = "cse"


def shell_profiles_path(environ: Mapping[str, str] = os.environ) -> Path:
    """The profiles file a plain shell's `prefect` reads: `$PREFECT_PROFILES_PATH`, else `profiles.toml` in the shell's
    Prefect home (`$CSE_SHELL_PREFECT_HOME` when scripts/env.sh recorded it, else `$PREFECT_HOME`), else in
    `~/.prefect`.

    Args:
        environ: the environment to read (default: this process's).
    """
    if environ.get("PREFECT_PROFILES_PATH"):
        return Path(environ["PREFECT_PROFILES_PATH"]).expanduser()
    # recorded empty: the shell had no PREFECT_HOME (the one now set is env.sh's, the server's)
    home = environ["CSE_SHELL_PREFECT_HOME"] if "CSE_SHELL_PREFECT_HOME" in environ else environ.get("PREFECT_HOME")
    home = home or "~/.prefect"
    return Path(home).expanduser() / "profiles.toml"


def write_profile(path: Path, api_url: str, name: str = DEFAULT_PROFILE, activate: bool = True) -> str | None:
    """Set `PREFECT_API_URL = api_url` in profile `name` of the profiles file `path` (created when missing, private),
    keeping every other profile and setting; with `activate`, make `name` the active profile.

    Args:
        path: the profiles file (TOML: `active = "..."`, `[profiles.<name>]` tables of settings).
        api_url: the Prefect API URL, e.g. `http://127.0.0.1:4200/api`.
        name: the profile's name.
        activate: make it the active profile.

    Returns:
        The profile that was active before, when activating changed it (None otherwise).

    Raises:
        ValueError: when `path` is not a readable profiles file (named, with the TOML error), or `api_url` is not an
            http(s) URL.
    """
    import toml  # a dependency of prefect (it writes its profiles with it)

    if not api_url.startswith(("http://", "https://")):
        raise ValueError(f"PREFECT_API_URL must be an http(s) URL, got {api_url!r}")
    contents: dict = {}
    if path.is_file():
        try:
            contents = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path} is not a valid Prefect profiles file: {e}") from None
    profiles = contents.setdefault("profiles", {})
    if not isinstance(profiles, dict) or not isinstance(profiles.get(name, {}), dict):
        raise ValueError(f"{path}: `profiles.{name}` is not a table of settings")
    profiles.setdefault(name, {})["PREFECT_API_URL"] = api_url
    previous = contents.get("active")
    if activate:
        contents["active"] = name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(toml.dumps(contents), encoding="utf-8")
    tmp.replace(path)
    return previous if activate and previous != name else None


def main(environ: Mapping[str, str] = os.environ) -> int:
    """Write the profile for the server at `$PREFECT_API_URL` (scripts/env.sh sets it) and say what changed."""
    name = environ.get("CSE_PREFECT_PROFILE", DEFAULT_PROFILE)
    if not name:
        print("Prefect profile: none written (CSE_PREFECT_PROFILE is empty); plain shells need `source scripts/env.sh`")
        return 0
    api_url = environ.get("PREFECT_API_URL", "")
    path = shell_profiles_path(environ)
    previous = write_profile(path, api_url, name)
    from cse.storage.secrets import redact

    print(
        f"Prefect profile {name!r} (PREFECT_API_URL={redact(api_url)}) is active in {path}: plain shells reach this "
        "server" + (f"; `prefect profile use {previous}` goes back to the profile active before" if previous else "")
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"prefect profile: {e}", file=sys.stderr)
        sys.exit(2)
