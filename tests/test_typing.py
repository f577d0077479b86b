"""The mypy configuration of pyproject.toml against the code: `disallow_untyped_defs` names exactly the modules of the
pure layers (models/, training/, storage/, evaluation/) whose every def is annotated, so a module that becomes fully
annotated joins the list (and then stays so: mypy refuses a new untyped def there)."""

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PURE_LAYERS = ("models", "training", "storage", "evaluation")
# Annotated or not, these stay out (the reason is beside the list in pyproject.toml): overrides of transformers'
# attention and layer classes, spliced into them at run time, whose signatures are the library's untyped ones.
LEFT_OUT = {"cse.models.prompts.module_route", "cse.models.prompts.position0"}


def untyped_defs(tree: ast.Module) -> list[str]:
    """`name:line` of every def that mypy's `disallow_untyped_defs` refuses: an argument without an annotation
    (bar `self`/`cls` of a method) or no return annotation (an `__init__` with an annotated argument needs none)."""
    found: list[str] = []

    def visit(node: ast.AST, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                a = child.args
                args = a.posonlyargs + a.args + a.kwonlyargs
                static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in child.decorator_list)
                if in_class and args and not static:
                    args = args[1:]
                args += [x for x in (a.vararg, a.kwarg) if x is not None]
                untyped = [x.arg for x in args if x.annotation is None]
                no_return = child.returns is None and not (child.name == "__init__" and args and not untyped)
                if untyped or no_return:
                    found.append(f"{child.name}:{child.lineno}")
                visit(child, False)
            elif isinstance(child, ast.ClassDef):
                visit(child, True)
            else:
                visit(child, in_class)

    visit(tree, False)
    return found


def module_name(path: Path) -> str:
    return ("cse." + ".".join(path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


def test_untyped_defs_finds_what_mypy_refuses():
    tree = ast.parse(
        "class A:\n"
        "    def __init__(self, x: int): ...\n"
        "    def m(self) -> None: ...\n"
        "    @staticmethod\n"
        "    def s(x): ...\n"
        "def f(*args: int, **kw) -> None:\n"
        "    def inner(): ...\n"
    )
    assert untyped_defs(tree) == ["s:5", "f:6", "inner:7"]


def test_disallow_untyped_defs_lists_every_fully_annotated_pure_module():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    listed = {m for o in config["overrides"] if o.get("disallow_untyped_defs") for m in o["module"]}
    annotated: set[str] = set()
    untyped: dict[str, list[str]] = {}
    for layer in PURE_LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            missing = untyped_defs(ast.parse(path.read_text()))
            if missing:
                untyped[module_name(path)] = missing
            else:
                annotated.add(module_name(path))
    assert not listed & untyped.keys(), {m: untyped[m] for m in listed & untyped.keys()}
    assert annotated - LEFT_OUT <= listed, (
        f"fully annotated, add to disallow_untyped_defs: {sorted(annotated - listed)}"
    )
    assert listed <= annotated, f"not modules of the pure layers: {sorted(listed - annotated)}"


PACKAGES = ("config", "storage", "models", "training", "evaluation", "tracking", "tasks", "flows", "ops")
_IGNORE = re.compile(r"#\s*type:\s*ignore(\[[\w, -]+\])?(?P<rest>.*)$")


def test_every_type_ignore_names_its_code_and_reason():
    """A `# type: ignore` in the packages names the error code it silences and says why: `# type: ignore[code]  #
    <reason>`."""
    bare = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if (m := _IGNORE.search(line)) and (not m.group(1) or not m.group("rest").strip().lstrip("#").strip()):
                    bare.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bare, "\n".join(bare)
