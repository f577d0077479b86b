"""Issue 24: after `make main`, a plain shell (only the venv activated, no `source scripts/env.sh`) reaches the
Prefect server through the profile `cse` (ops/prefect_profile.py), and `cse` finds the checkout's `.cse`."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cse.ops.prefect_profile import main as write_cse_profile
from cse.ops.prefect_profile import shell_profiles_path, write_profile
from cse.storage.settings import REPO_ROOT, get_settings


def _plain_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "CSE_", "MLFLOW_"))}
    return {**env, **extra}


def test_env_sh_records_the_shell_prefect_home(tmp_path):
    """env.sh replaces PREFECT_HOME (the server's database) but keeps the shell's own, once, for the profile."""
    script = 'source scripts/env.sh; source scripts/env.sh; echo "$CSE_SHELL_PREFECT_HOME|$PREFECT_HOME"'
    for shell_home in ("", str(tmp_path / "mine")):
        env = _plain_env(CSE_HOME=str(tmp_path / "cse"), **({"PREFECT_HOME": shell_home} if shell_home else {}))
        out = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, env=env, text=True, capture_output=True, check=True)
        recorded, server_home = out.stdout.strip().split("|")
        if shell_home:
            assert (recorded, server_home) == (shell_home, shell_home)
        else:
            assert (recorded, server_home) == ("", str(tmp_path / "cse" / "prefect"))
    # recorded empty (the shell had none): the default home, not the server's PREFECT_HOME that env.sh set
    assert (
        shell_profiles_path({"CSE_SHELL_PREFECT_HOME": "", "PREFECT_HOME": str(tmp_path / "cse" / "prefect")})
        == Path("~/.prefect/profiles.toml").expanduser()
    )
    assert shell_profiles_path({"PREFECT_HOME": str(tmp_path)}) == tmp_path / "profiles.toml"  # not via env.sh
    assert shell_profiles_path({"CSE_SHELL_PREFECT_HOME": str(tmp_path)}) == tmp_path / "profiles.toml"
    assert shell_profiles_path({"PREFECT_PROFILES_PATH": str(tmp_path / "p.toml")}) == tmp_path / "p.toml"


def test_profile_is_written_kept_and_read_by_prefect(tmp_path, capsys):
    shell_home = tmp_path / "shell-prefect"
    path = shell_home / "profiles.toml"
    path.parent.mkdir()
    path.write_text(
        'active = "mine"\n\n[profiles.mine]\nPREFECT_API_URL = "http://example.org/api"\n\n'
        '[profiles.cse]\nPREFECT_LOGGING_LEVEL = "WARNING"\n'
    )
    env = {"CSE_SHELL_PREFECT_HOME": str(shell_home), "PREFECT_API_URL": "http://127.0.0.1:4311/api"}
    assert write_cse_profile(env) == 0
    assert "`prefect profile use mine` goes back" in capsys.readouterr().out
    written = tomllib.loads(path.read_text())
    assert written["active"] == "cse"
    assert written["profiles"]["cse"] == {
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_API_URL": "http://127.0.0.1:4311/api",
    }
    assert written["profiles"]["mine"] == {"PREFECT_API_URL": "http://example.org/api"}  # the user's own profile kept
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert write_profile(path, "http://127.0.0.1:4311/api") is None  # again: nothing changes

    # what a plain shell's prefect sees: no PREFECT_API_URL in the environment, only its Prefect home
    probe = "from prefect.settings import get_current_settings as s; print(s().api.url)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=_plain_env(PREFECT_HOME=str(shell_home)),
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "http://127.0.0.1:4311/api"


def test_profile_errors_and_opt_out(tmp_path, capsys):
    bad = tmp_path / "profiles.toml"
    bad.write_text("active = \n")
    with pytest.raises(ValueError, match=rf"{bad} is not a valid Prefect profiles file"):
        write_profile(bad, "http://127.0.0.1:4200/api")
    with pytest.raises(ValueError, match="must be an http"):
        write_profile(tmp_path / "new.toml", "")
    assert write_cse_profile({"CSE_PREFECT_PROFILE": "", "CSE_SHELL_PREFECT_HOME": str(tmp_path / "x")}) == 0
    assert "none written" in capsys.readouterr().out and not (tmp_path / "x").exists()


def test_cse_home_defaults_to_the_checkout(tmp_path, monkeypatch):
    """Without CSE_HOME, `cse` (any working directory) reads the checkout's `.cse`, where the scripts keep it."""
    monkeypatch.delenv("CSE_HOME")
    monkeypatch.chdir(tmp_path)
    s = get_settings()
    assert s.home == REPO_ROOT / ".cse"
    assert s.data_root == REPO_ROOT / ".cse" / "data"
    assert s.mlflow_tracking_uri == f"sqlite:///{REPO_ROOT / '.cse' / 'mlflow.db'}"
