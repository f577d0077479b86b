"""The layer diagrams (docs/architecture.md, README.md) against the imports: each arrow is an import the code makes,
every import between layers is reachable along the arrows, and no two folders import each other, directly or
around a loop (tests/test_architecture.py reads the imports; this file only compares them with the pictures)."""

from __future__ import annotations

import re

import pytest

from cse.storage.settings import REPO_ROOT
from tests.test_architecture import PACKAGES, cycles, imports, layer, project_files

DIAGRAM_PAGES = ("docs/architecture.md", "README.md")
_NODE = re.compile(r'(\w+)\["([^"]*)"\]')


def layer_diagram(page: str) -> tuple[dict[str, str], set[tuple[str, str]]]:
    """The page's `flowchart TD` block whose nodes are the layers: node id → its layer (read from the first path in
    its label: `storage/` is the folder's layer, `storage/settings.py` the layer of that module), and its arrows as
    (from layer, to layer) pairs (`A --> B & C` is two arrows)."""
    text = (REPO_ROOT / page).read_text()
    blocks = re.findall(r"```mermaid\n(flowchart TD\n.*?)```", text, flags=re.S)
    block = next(b for b in blocks if "storage/" in b and "models/" in b and "ops/" in b)
    nodes = {}
    for node, label in _NODE.findall(block):
        path = re.split(r"[ ,<·]", label, maxsplit=1)[0]
        module = "cse." + path.removesuffix("/").removesuffix(".py").replace("/", ".")
        nodes[node] = layer(module)
    arrows = set()
    for line in block.splitlines():
        if "-->" not in line:
            continue
        left, right = line.split("-->", 1)
        right = re.sub(r"^\s*\|[^|]*\|", "", right)  # the arrow's label (`-->|"atomic.py only"| STO`)
        source = _NODE.sub(r"\1", left).strip()
        for target in _NODE.sub(r"\1", right).split("&"):
            arrows.add((nodes[source], nodes[target.strip()]))
    return nodes, arrows


def layer_imports() -> set[tuple[str, str]]:
    """(layer, layer it imports) for every import between two layers of the packages (lazy ones included)."""
    files = project_files()
    return {
        (layer(name), layer(module))
        for name, path in files.items()
        for module, _ in imports(path)
        if module in files and layer(module) != layer(name)
    }


def closure(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    reach = set(edges)
    while True:
        more = {(a, d) for a, b in reach for c, d in reach if b == c} - reach
        if not more:
            return reach
        reach |= more


@pytest.mark.parametrize("page", DIAGRAM_PAGES)
def test_the_layer_diagram_draws_the_imports(page):
    nodes, arrows = layer_diagram(page)
    drawn = set(nodes.values())
    # a layer the picture does not draw (the bottom layer storage/atomic.py) is shown by its folder's node
    folder = {layer(name): name.removeprefix("cse.").split(".")[0] for name in project_files()}
    shown = lambda lay: lay if lay in drawn else folder[lay]
    actual = {(shown(a), shown(b)) for a, b in layer_imports() if shown(a) != shown(b)}
    not_imported = sorted(arrows - actual)
    assert not not_imported, f"{page}: arrows with no import behind them: {not_imported}"
    missing = sorted(actual - closure(arrows))
    assert not missing, f"{page}: imports the arrows do not reach: {missing}"


def test_no_folder_imports_around_a_loop():
    """Folder to folder (storage/atomic.py and storage/settings.py count as their folders): no loop, of any length."""
    files = project_files()
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for name, path in files.items():
        source = name.removeprefix("cse.").split(".")[0]
        graph[source] |= {
            m.removeprefix("cse.").split(".")[0] for m, _ in imports(path, type_checking=True) if m in files
        } - {source}
    assert not cycles(graph), f"folders importing around a loop: {cycles(graph)}"


def test_the_diagram_reader_reads_nodes_and_arrows():
    nodes, arrows = layer_diagram("docs/architecture.md")
    assert {"storage", "models", "ops", "tasks"} <= set(nodes.values())
    assert ("tasks", "tracking") in arrows
