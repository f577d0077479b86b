"""Loading files that name a class by the module path it had before every package moved under `cse`.

Until then the project installed `config`, `storage`, `models`, `training`, `evaluation`, `tracking`, `tasks`,
`flows` and `ops` as top-level packages. Two kinds of files it wrote name a class by its module path, and so by the
old one:

- a prompt model logged to MLflow as a pyfunc: its `python_model.pkl` pickles `SentenceEmbeddingModel` by reference,
  as `tracking.model_export.SentenceEmbeddingModel` (as `tasks.model_export.SentenceEmbeddingModel` before the class
  moved to tracking/);
- a sentence-transformers export of the `project` kind: its `modules.json` names
  `models.st_export.PromptedEncoderModule`.

Later (issue 36) models/ was sorted by role: the methods moved to `cse.models.methods`, the exports to
`cse.models.export` and `models/prefix.py` was split by mechanism into `cse.models.prompts`. A `project` export
written between the two moves names `cse.models.st_export.PromptedEncoderModule`; those paths (`cse.models.<module>`
and `models.<module>` alike) resolve here too (`MOVED`; the old `prefix` module as one module holding the public
names of the `cse.models.prompts` modules).

Nothing else that the pipeline keeps names a module: checkpoints record the method's name (`cse_model.json`), resume
states hold tensors and RNG states, dataset and run keys hash settings and content, and Prefect persists no result
across runs (tests/test_pre_rename.py loads a checkpoint and a pyfunc model written before the move).

`legacy_module_names()` makes the old paths resolve to the modules under `cse` while such a file loads:

    from cse.ops.legacy import legacy_module_names

    with legacy_module_names():
        model = mlflow.pyfunc.load_model("models:/cse-d2cse-minilm-smoke/1")

Inside the block `import tracking.model_export` gives the module `cse.tracking.model_export` itself (not a second
copy); afterwards the old names are gone from `sys.modules` again and the loaded objects keep working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import pkgutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

LEGACY_PACKAGES = ("config", "storage", "models", "training", "evaluation", "tracking", "tasks", "flows", "ops")


# models/ by role (issue 36): every module of cse.models.methods and cse.models.export was cse.models.<module> before
# (read from the subpackages' folders: the modules, not the method names, which only the registry lists).
def _submodules(package: str) -> list[str]:
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise ModuleNotFoundError(f"no package {package}", name=package)
    return [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations) if not m.name.startswith("_")]


_MODELS_MOVED = {name: sub for sub in ("methods", "export") for name in _submodules(f"cse.models.{sub}")}
# models/prefix.py, split by mechanism: the old module is served as one module holding these modules' public names.
PREFIX_PARTS = tuple(
    f"cse.models.prompts.{part}"
    for part in ("families", "prefixes", "interface", "module_route", "position0", "backbone")
)
# Old module paths whose module also moved between or inside packages: old path → its module now (a tuple: the
# modules whose public names make up the old one).
MOVED: dict[str, str | tuple[str, ...]] = {
    "tasks.model_export": "cse.tracking.model_export",
    **{
        f"{root}models.{name}": f"cse.models.{sub}.{name}"
        for name, sub in _MODELS_MOVED.items()
        for root in ("", "cse.")
    },
    "models.prefix": PREFIX_PARTS,
    "cse.models.prefix": PREFIX_PARTS,
}


def current_name(legacy: str) -> str | tuple[str, ...] | None:
    """The module under `cse` that an old module path names (None: not a path of the project's old layouts; a tuple:
    the modules an old module was split into).

    >>> current_name("tracking.model_export"), current_name("tasks.model_export"), current_name("numpy")
    ('cse.tracking.model_export', 'cse.tracking.model_export', None)
    >>> current_name("models.st_export"), current_name("cse.models.d2cse"), current_name("cse.models.checkpoint")
    ('cse.models.export.st_export', 'cse.models.methods.d2cse', None)
    """
    if legacy in MOVED:
        return MOVED[legacy]
    return f"cse.{legacy}" if legacy.split(".")[0] in LEGACY_PACKAGES else None


def _merged(name: str, parts: tuple[str, ...]) -> ModuleType:
    """One module `name` holding the public names of the modules `parts` (a module split in several)."""
    module = ModuleType(name, f"{name}, split into {', '.join(parts)}")
    for part in parts:
        found = importlib.import_module(part)
        module.__dict__.update({k: v for k, v in vars(found).items() if not k.startswith("_")})
    return module


def _parent(name: str) -> str:
    """The module now standing for the parent package of an old path (`models.x` → `cse.models`, `cse.models.x` →
    `cse.models`)."""
    parent = name.rpartition(".")[0]
    return parent if parent.split(".")[0] == "cse" else f"cse.{parent}"


class _Alias(importlib.abc.Loader):
    """Loads an old module path as the already imported module under `cse`."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def create_module(self, spec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        pass


class _LegacyFinder(importlib.abc.MetaPathFinder):
    """Finds an old module path (`models.st_export`) as its module under `cse`; records the names it served."""

    def __init__(self) -> None:
        self.served: dict[str, ModuleType] = {}

    def find_spec(self, fullname: str, path=None, target=None):
        name = current_name(fullname)
        if name is None:
            return None
        try:
            module = _merged(fullname, name) if isinstance(name, tuple) else importlib.import_module(name)
        except ModuleNotFoundError:
            return None
        self.served[fullname] = module
        return importlib.machinery.ModuleSpec(fullname, _Alias(module), is_package=hasattr(module, "__path__"))


@contextmanager
def legacy_module_names() -> Iterator[None]:
    """Within the block, the old module paths (`tracking.model_export`, `models.st_export`, `cse.models.st_export`,
    ...) import as their modules under `cse`; on exit the aliases are removed from `sys.modules` (modules imported meanwhile under
    their `cse` names stay)."""
    finder = _LegacyFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name, module in finder.served.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
            child = name.rpartition(".")[2]
            # importing `tasks.model_export` set the attribute `model_export` of `cse.tasks` (the alias of `tasks`),
            # importing `cse.models.st_export` the attribute `st_export` of `cse.models`
            if name in MOVED and getattr(sys.modules.get(_parent(name)), child, None) is module:
                delattr(sys.modules[_parent(name)], child)
