"""The layering rules of docs/architecture.md, checked on the source (imports read with `ast`, lazy ones included)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from cse.ops.legacy import MOVED
from cse.storage.settings import REPO_ROOT

PACKAGES = ("config", "storage", "models", "training", "evaluation", "tracking", "tasks", "flows", "ops")
# What each layer may import from the project (docs/architecture.md); a layer always imports itself.
# `cse.storage.settings` (paths and services from the environment) and `cse.storage.secrets` (the masking rule for
# credentials, applied at every exit, storage's included) are the bottom layer `settings`. `cse.storage.atomic` (the
# one atomic write of a file or folder: fsync, rename, the old folder kept until the new one is in place) is the
# bottom layer `atomic`: it imports nothing from the project, and every layer, models/ included, writes through it.
# All three are files of storage/, so storage/ is the bottom folder and the folders import one another without a loop
# (`test_no_folder_imports_itself_through_another`).
ALLOWED = {
    "atomic": set(),
    "settings": set(),
    "storage": {"atomic", "settings"},
    "models": {"atomic"},
    "evaluation": {"atomic", "settings", "storage", "models"},
    "config": {"atomic", "settings", "storage", "models"},
    "training": {"atomic", "settings", "config", "storage", "models", "evaluation"},
    "tracking": {"atomic", "settings", "config", "storage", "models"},
    "tasks": {"atomic", "settings", "config", "storage", "models", "training", "evaluation", "tracking"},
    "flows": {"atomic", "settings", "config", "storage", "models", "evaluation", "tracking", "tasks"},
    "ops": {
        "atomic",
        "settings",
        "config",
        "storage",
        "models",
        "training",
        "evaluation",
        "tracking",
        "tasks",
        "flows",
    },
}
MLFLOW_SEAM = "tracking"  # the package: store, stage/training/group runs, lineage, the outage spool, model export
NO_ORCHESTRATION = ("atomic", "models", "training", "evaluation", "storage")  # pure: no prefect, no mlflow


SETTINGS_LAYER = ("cse.storage.settings", "cse.storage.secrets")
ATOMIC_LAYER = ("cse.storage.atomic",)


def layer(module: str) -> str:
    """The layer of a project module (`cse.<package>...`; `SETTINGS_LAYER` is the layer `settings`, `ATOMIC_LAYER`
    the layer `atomic`)."""
    if module in SETTINGS_LAYER:
        return "settings"
    if module in ATOMIC_LAYER:
        return "atomic"
    return module.removeprefix("cse.").split(".")[0]


def module_name(path: Path) -> str:
    """The import name of a file: `cse.<package>...` for the installed packages, the checkout path for the rest
    (`benchmarks.gpu_check`, `tests.conftest`)."""
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return f"cse.{dotted}" if parts[0] in PACKAGES else dotted


def project_files(extra: tuple[str, ...] = ()) -> dict[str, Path]:
    files = {}
    for package in PACKAGES + extra:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            files[module_name(path)] = path
    return files


def imports(path: Path, type_checking: bool = False) -> list[tuple[str, int]]:
    """Every module `path` imports, at any depth (function-level imports included), except under TYPE_CHECKING unless
    `type_checking` (the cycle check counts those: a type checker follows them)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def import_graph(extra: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """Module → the project modules it imports, TYPE_CHECKING imports included (`extra`: folders beside the packages
    whose modules count too, such as `benchmarks`)."""
    files = project_files(extra)
    return {
        name: {m for m, _ in imports(path, type_checking=True) if m in files and m != name}
        for name, path in files.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle_and_passes_a_dag():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles():
    """None in the packages, none in benchmarks/ (whose scripts import each other, and the packages)."""
    found = cycles(import_graph(extra=("benchmarks",)))
    assert not found, "import cycles (lazy and TYPE_CHECKING imports count): " + "; ".join(" ↔ ".join(c) for c in found)


def test_only_the_tracking_seam_imports_mlflow():
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{line}"
        for name, path in project_files(extra=("benchmarks",)).items()
        if layer(name) != MLFLOW_SEAM
        for module, line in imports(path)
        if module == "mlflow" or module.startswith("mlflow.")
    ]
    assert not offenders, f"mlflow imported outside {MLFLOW_SEAM}: {offenders}"


def test_pure_layers_import_neither_prefect_nor_mlflow():
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{line} imports {module}"
        for name, path in project_files().items()
        if layer(name) in NO_ORCHESTRATION
        for module, line in imports(path)
        if module.split(".")[0] in ("prefect", "mlflow", "prefect_dask")
    ]
    assert not offenders, offenders


def test_every_layer_imports_only_what_it_may():
    files = project_files()
    offenders = []
    for name, path in files.items():
        source = layer(name)
        for module, line in imports(path):
            target = layer(module)
            if module in files and target != source and target not in ALLOWED[source]:
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{line} ({source}) imports {module} ({target})")
    assert not offenders, "\n".join(sorted(set(offenders)))


def test_no_folder_imports_itself_through_another():
    """The folders as one node each (config/, storage/, ...) form no loop either: a folder never imports, through
    other folders, a module of its own (settings and secrets live in storage/, the bottom folder, for this)."""
    folders: dict[str, set[str]] = {package: set() for package in PACKAGES}
    for name, targets in import_graph().items():
        folders[name.removeprefix("cse.").split(".")[0]] |= {t.removeprefix("cse.").split(".")[0] for t in targets}
    found = cycles({folder: targets - {folder} for folder, targets in folders.items()})
    assert not found, "folder-level import loops: " + "; ".join(" → ".join(c) for c in found)


def test_the_checker_sees_lazy_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import hidden\n\n"
        "def f():\n    import mlflow.entities\n    from cse.tasks.train import x\n"
    )
    found = dict(imports(source))
    assert found["mlflow.entities"] == 6 and found["cse.tasks.train"] == 7 and "hidden" not in found
    assert dict(imports(source, type_checking=True))["hidden"] == 3  # what the cycle check reads


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: Path) -> list[str]:
    """Private names (a leading underscore, not a dunder) `path` takes from the project: imported from its packages
    (`from cse.models.x import _f`, `import cse.training._y`), read as an attribute (`trainer._batch`: static analysis
    cannot tell whose object it is, so every `._name` counts) or through `getattr(x, "_name")`. A class the file defines
    may use its own: `self._x` / `cls._x` inside it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own: set[int] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        own.update(
            id(n)
            for n in ast.walk(cls)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
        )
    found = []
    for node in ast.walk(tree):
        where = (
            f"{path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}:{getattr(node, 'lineno', 0)}"
        )
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "cse":
            names = node.module.split(".") + [a.name for a in node.names]
            found += [f"{where}: imports {node.module}.{n}" for n in names if _private(n)]
        elif isinstance(node, ast.Import):
            found += [
                f"{where}: imports {a.name}"
                for a in node.names
                if a.name.split(".")[0] == "cse" and any(_private(p) for p in a.name.split("."))
            ]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and id(node) not in own:
            found.append(f"{where}: reads {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            found.append(f"{where}: {node.func.id} {node.args[1].value}")
    return found


def test_benchmarks_use_no_private_name_of_the_project():
    """Benchmarks run the pipeline through its public API (e.g. the trainer's hooks and step API), so a refactoring
    of private code cannot break them silently."""
    offenders = [u for path in sorted((REPO_ROOT / "benchmarks").rglob("*.py")) for u in private_uses(path)]
    assert not offenders, "\n".join(offenders)


def test_the_private_name_checker_sees_imports_attributes_and_getattr(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "from cse.training.loop import Trainer, _helper\nimport cse.models._hidden\nfrom torch import _C\n\n"
        "class Probe:\n    def f(self):\n        return self._own, cls_obj._other\n\n"
        "def g(t):\n    t._batch(1)\n    return getattr(t, '_autocast'), t.__class__\n"
    )
    assert sorted(f.split(": ", 1)[1] for f in private_uses(source)) == sorted(
        [
            "imports cse.training.loop._helper",
            "imports cse.models._hidden",
            "reads cls_obj._other",
            "reads t._batch",
            "getattr _autocast",
        ]
    )


# ------------------------------------------------------------------------------------------------ one import name
# Every package is installed as `cse.<package>` (pyproject.toml's package-dir). The old top-level names (`models`,
# `config`, ...) stay importable only where the checkout's root is on the import path (pytest, `python -m` in the checkout),
# and there an import by the old name loads a second copy of the module beside `cse.<package>`: two registries, two
# settings objects, classes that fail isinstance checks. So nothing may use them.
OLD_NAMES = PACKAGES
# Modules that name the old paths on purpose: the loader of files written before the move and its test, and the
# benchmark that runs an older commit's tree (whose packages are top-level) beside this one.
HANDLES_OLD_NAMES = ("ops/legacy.py", "tests/test_pre_rename.py", "benchmarks/rows_memory.py")
NOT_SOURCE = (".venv", "site", "build", ".git", ".cse", "fixtures", "results", "__pycache__", "node_modules")


def checkout_files(*patterns: str) -> list[Path]:
    """The checkout's files matching `patterns` (glob names), outside virtual environments, build output, data and
    the fixtures written by older code."""
    found = set()
    for pattern in patterns:
        for path in REPO_ROOT.rglob(pattern):
            rel = path.relative_to(REPO_ROOT)
            if path.is_file() and not any(p in NOT_SOURCE or p.endswith(".egg-info") for p in rel.parts[:-1]):
                found.add(path)
    return sorted(found)


def _old_module_path(text: str) -> bool:
    """`text` is a dotted path into a project package by its old name (`storage.locks`, `models.d2cse:D2CSE`,
    `tasks.train.log_encoder_model`): a module of that package, then anything."""
    head, _, rest = text.partition(".")
    if head not in OLD_NAMES or not rest:
        return False
    module = rest.split(".")[0].split(":")[0]
    return (
        (REPO_ROOT / head / f"{module}.py").is_file()
        or (REPO_ROOT / head / module / "__init__.py").is_file()
        or f"{head}.{module}" in MOVED  # a module that has moved since (`models.d2cse`, now models/methods/d2cse.py)
    )


def old_name_uses(path: Path) -> list[str]:
    """Imports of an old top-level name (any depth, TYPE_CHECKING included), and string constants that are an old
    module path (patch targets, logger names, entrypoints, `importlib.import_module` arguments)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"{where}:{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in OLD_NAMES
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in OLD_NAMES:
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _old_module_path(node.value.strip()):
            found.append(f"{where}:{node.lineno}: {node.value.strip()!r}")
    return found


def test_nothing_imports_a_package_by_its_old_top_level_name():
    files = checkout_files("*.py")
    assert REPO_ROOT / "benchmarks" / "gpu_check.py" in files and REPO_ROOT / "tests" / "conftest.py" in files
    offenders = [
        use
        for path in files
        if str(path.relative_to(REPO_ROOT)) not in HANDLES_OLD_NAMES
        for use in old_name_uses(path)
    ]
    assert not offenders, "use cse.<package> (see pyproject.toml):\n" + "\n".join(offenders)


# `python -m models.x`, `::: models.x` (mkdocstrings), `from models.x import`, `import models.x` in the docs, scripts,
# Makefile, Dockerfiles and configuration
_OLD_IN_TEXT = re.compile(
    rf"(?:-m|:::)\s+(?:{'|'.join(OLD_NAMES)})\.\w|\bfrom\s+(?:{'|'.join(OLD_NAMES)})(?:\.\w+)*\s+import\b"
    rf"|\bimport\s+(?:{'|'.join(OLD_NAMES)})\.\w"
)


def test_no_command_or_page_names_a_package_by_its_old_top_level_name():
    files = checkout_files("*.md", "*.sh", "*.yaml", "*.yml", "*.toml", "Makefile", "Dockerfile*")
    assert REPO_ROOT / "Makefile" in files and REPO_ROOT / "docs" / "api" / "models.md" in files
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _OLD_IN_TEXT.search(line)
    ]
    assert not offenders, "use cse.<package>:\n" + "\n".join(offenders)


def test_the_old_name_checker_sees_imports_and_module_strings(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "import models.d2cse\nfrom config import settings\nimport cse.models.methods.d2cse\n\n"
        "def f(mp):\n    from storage.locks import exclusive\n    mp.setattr('tasks.train.log_encoder_model', 1)\n"
        "    return ('models.d2cse:D2CSE', 'config.json', 'config.backbone', 'cse.storage.locks')\n"
    )
    assert sorted(u.split(": ", 1)[1] for u in old_name_uses(source)) == sorted(
        [
            "import models.d2cse",
            "from config import ...",
            "from storage.locks import ...",
            "'tasks.train.log_encoder_model'",
            "'models.d2cse:D2CSE'",
        ]
    )


def test_every_package_folder_is_linked_and_installed_under_cse():
    """Each top-level package folder is `cse.<folder>`: `cse/` holds the package's `__init__.py` and one relative link
    per folder (so the checkout has the installed layout and static tools follow every import), and pyproject.toml
    installs those packages and each subpackage folder (models/methods/ is cse.models.methods), with no folder
    mapping."""
    import tomllib

    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {p.name for p in REPO_ROOT.iterdir() if (p / "__init__.py").is_file() and not p.is_symlink()} - {
        "tests",
        "cse",
    }
    assert folders == set(PACKAGES)
    assert "package-dir" not in setuptools, "cse/ links the folders: setuptools needs no mapping"
    links = {p.name: p for p in (REPO_ROOT / "cse").iterdir() if p.name not in ("__init__.py", "__pycache__")}
    assert sorted(links) == sorted(PACKAGES)
    assert all(link.is_symlink() and os.readlink(link) == f"../{name}" for name, link in links.items())
    expected = {"cse", *(f"cse.{name}" for name in PACKAGES)}
    subpackages = {  # models/methods/ is cse.models.methods: setuptools finds it under its parent's folder
        module_name(init)
        for name in PACKAGES
        for init in (REPO_ROOT / name).rglob("__init__.py")
        if init.parent != REPO_ROOT / name
    }
    assert sorted(setuptools["packages"]) == sorted(expected | subpackages)
    folders = [p for name in PACKAGES for p in (REPO_ROOT / name).rglob("*") if p.is_dir() and p.name != "__pycache__"]
    assert all((p / "__init__.py").is_file() for p in folders), "a folder of a package that is no subpackage"


def test_a_package_refuses_its_bare_folder_name():
    """From the checkout's root (on sys.path under pytest and `python -m`) `import models` would load a second copy
    of every module beside cse.models; each layer's `__init__.py` refuses it."""
    for name in PACKAGES:
        done = subprocess.run(
            [sys.executable, "-c", f"import {name}"], cwd=REPO_ROOT, capture_output=True, text=True, check=False
        )
        assert done.returncode == 1 and f"ImportError: import cse.{name}, not {name}" in done.stderr, done.stderr


def test_a_regular_install_holds_every_package_and_imports_from_anywhere(tmp_path):
    """A wheel built from the checkout copies each folder through its link under cse/ (modules and package data), and
    installed without the checkout, `import cse.models` works from `/` and finds the installed files only."""
    wheels, site, source = tmp_path / "wheels", tmp_path / "site", tmp_path / "source"
    # a copy of the checkout (links kept as links): setuptools builds in the source's build/, never the checkout's
    skip = (".venv", ".git", "build", ".cse", "site", "*.egg-info", "__pycache__", ".mypy_cache", ".ruff_cache")
    shutil.copytree(REPO_ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(*skip, "tests", "benchmarks"))
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."]
    subprocess.run(build, cwd=source, check=True, capture_output=True)
    (wheel,) = wheels.glob("cse_pipeline-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    for name in PACKAGES:
        assert (site / "cse" / name / "__init__.py").is_file() and not (site / "cse" / name).is_symlink()
    assert (site / "cse" / "tracking" / "model_card_template.md").is_file()
    # PYTHONPATH comes before the venv's packages (and the editable install's path line): `cse` is the installed copy
    probe = "import cse.models.method, cse.storage.settings; print(cse.models.method.__file__)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", probe], cwd="/", env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(site / "cse" / "models" / "method.py")
