"""Loading files that name a class by the module path it had before every package moved under `cse`.

Until then the project installed `config`, `storage`, `models`, `training`, `evaluation`, `tracking`, `tasks`,
`flows` and `ops` as top-level packages. Two kinds of files it wrote name a class by its module path, and so by the
old one:

- a prompt model logged to MLflow as a pyfunc: its `python_model.pkl` pickles `SentenceEmbeddingModel` by reference,
  as `tracking.model_export.SentenceEmbeddingModel` (as `tasks.model_export.SentenceEmbeddingModel` before the class
  moved to tracking/);
- a sentence-transformers export of the `project` kind: its `modules.json` names
  `models.st_export.PromptedEncoderModule`.

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
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

LEGACY_PACKAGES = ("config", "storage", "models", "training", "evaluation", "tracking", "tasks", "flows", "ops")
# Old module paths whose module also moved between packages: old path → its module now.
MOVED = {"tasks.model_export": "cse.tracking.model_export"}


def current_name(legacy: str) -> str | None:
    """The module under `cse` that an old module path names (None: not a path of the project's old layout).

    >>> current_name("tracking.model_export"), current_name("tasks.model_export"), current_name("numpy")
    ('cse.tracking.model_export', 'cse.tracking.model_export', None)
    """
    if legacy in MOVED:
        return MOVED[legacy]
    return f"cse.{legacy}" if legacy.split(".")[0] in LEGACY_PACKAGES else None


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
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            return None
        self.served[fullname] = module
        return importlib.machinery.ModuleSpec(fullname, _Alias(module), is_package=hasattr(module, "__path__"))


@contextmanager
def legacy_module_names() -> Iterator[None]:
    """Within the block, the old top-level module paths (`tracking.model_export`, `models.st_export`, ...) import as
    their modules under `cse`; on exit the aliases are removed from `sys.modules` (modules imported meanwhile under
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
            parent, _, child = name.rpartition(".")
            # importing `tasks.model_export` set the attribute `model_export` of `cse.tasks` (the alias of `tasks`)
            if name in MOVED and getattr(sys.modules.get(f"cse.{parent}"), child, None) is module:
                delattr(sys.modules[f"cse.{parent}"], child)
