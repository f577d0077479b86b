"""cse-pipeline: contrastive sentence embeddings (D2CSE, SimCSE, DCPCSE, DiffCSE, DiffAug) with Prefect and MLflow.

The one import name of the project: its packages are `cse.config`, `cse.storage`, `cse.models`, `cse.training`,
`cse.evaluation`, `cse.tracking`, `cse.tasks`, `cse.flows` and `cse.ops`. In the checkout they stay top-level folders
(`config/`, `storage/`, ...) and this folder links each of them (`cse/models` → `../models`), so the checkout has the
layout a regular install has: every `cse.` import resolves from the files alone (editors, type checkers), and each
module has one name at run time. Each package's `__init__.py` refuses its folder's bare name (`import models`), which
would load a second copy of it beside `cse.models`.
"""


def refuse_bare_name(name: str) -> None:
    """Raise ImportError unless `name` (a package's `__name__`) is under `cse`.

    Where the checkout's root is on `sys.path` (pytest, `python -m` in the checkout) `import models` would find the
    folder `models/` and load a second copy of every module beside `cse.models`: two registries, two settings
    objects, classes that fail isinstance checks. Files written before the packages moved under `cse` load through
    `cse.ops.legacy.legacy_module_names`, which maps the old names onto the modules under `cse` and never runs this.

    Args:
        name: the importing package's `__name__`.

    Example:
        >>> refuse_bare_name("cse.models")
    """
    if not name.startswith("cse."):
        raise ImportError(
            f"import cse.{name}, not {name}: the project's packages have one name each, under cse "
            f"(for a file written before the move, see cse.ops.legacy)"
        )
