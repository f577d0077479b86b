"""MkDocs hook (mkdocs.yml `hooks:`): the layout of the package `cse` for the API pages' `::: cse.<package>.<module>`.

mkdocstrings reads the sources with griffe, which finds a package's submodules inside its folder. The package `cse`
is assembled by pyproject.toml's `[tool.setuptools.package-dir]` instead (`cse.models` is the top-level folder
`models/`; `cse/` holds only `__init__.py`), so before any page renders this hook lays it out as symbolic links under
`build/mkdocs-api/` (the handler's `paths` in mkdocs.yml): `cse/__init__.py` and `cse/<package>` → `<package>/`, one per
entry of that table. The links are rebuilt on every build; nothing else is written.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[1]
API_ROOT = ROOT / "build" / "mkdocs-api"


def package_links(root: Path = ROOT) -> dict[str, Path]:
    """Link name under `cse/` → what it points at, from pyproject.toml's package-dir table."""
    table = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    links = {}
    for package, folder in table.items():
        if package == "cse":
            links["__init__.py"] = root / folder / "__init__.py"
        else:
            links[package.removeprefix("cse.")] = root / folder
    return links


def build_api_root(api_root: Path = API_ROOT, root: Path = ROOT) -> Path:
    """(Re)write `api_root/cse/` as links to the package's folders; returns `api_root`."""
    package = api_root / "cse"
    package.mkdir(parents=True, exist_ok=True)
    links = package_links(root)
    for entry in package.iterdir():
        if entry.name not in links or not entry.is_symlink() or entry.resolve() != links[entry.name].resolve():
            entry.unlink() if entry.is_symlink() or entry.is_file() else None
    for name, target in links.items():
        link = package / name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(target, package), target_is_directory=target.is_dir())
    return api_root


@event_priority(100)  # before mkdocstrings' on_config: the links must exist when it reads the handler's `paths`
def on_config(config, **kwargs):
    build_api_root()
    return config
