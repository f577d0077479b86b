"""The README and the documentation pages: short README, links that resolve, nothing a reader cannot see.

`make test` also builds the site with `mkdocs build --strict` (links between pages, anchors, the API pages'
docstrings); these checks cover what MkDocs does not see: the README itself, and links that leave `docs/`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOC_PAGES]
README_MAX_LINES = 250

# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"""(?:src|href)=["']([^"']+)["']""")  # <img src="..."> and <a href="..."> in the README
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# A git object name as people paste it: 7 to 40 hex digits with at least one digit and one letter (so neither a
# plain number nor an English word such as "defaced" matches).
GIT_REF = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
FORBIDDEN = {
    "a design file outside the repository": re.compile(r"(?<![\w-])methods\.md"),
    "an issue number": re.compile(r"\bissues?\s*(#\s*\d+|\d{1,4}\b)", re.I),
    "a git hash-like ref": GIT_REF,
}


def _prose(text: str) -> str:
    """The page without fenced code blocks and inline code, where links are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _relative_links(page: Path) -> list[str]:
    targets = []
    prose = _prose(page.read_text(encoding="utf-8"))
    for target in LINK.findall(prose) + HTML_LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http:, https:, mailto: and links within the page
        targets.append(target)
    return targets


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES} (move the rest into docs/)"


def test_the_docs_have_pages():
    names = {p.name for p in DOC_PAGES}
    for required in (
        "index.md",
        "architecture.md",
        "data.md",
        "evaluation.md",
        "training.md",
        "exports.md",
        "operations.md",
        "evidence.md",
        "configuration.md",
        "tests.md",
    ):
        assert required in names, f"docs/{required} is missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    links = _relative_links(page)
    broken = []
    for target in links:
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to files that do not exist: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_references_a_reader_cannot_follow(page: Path):
    text = page.read_text(encoding="utf-8")
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            m = pattern.search(line)
            if m:
                found.append(f"line {lineno}: {what}: {m.group(0)!r}")
    assert not found, f"{page.relative_to(ROOT)} cites what a reader of the repository cannot see:\n" + "\n".join(found)


def test_the_checks_catch_what_they_look_for(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "See [a](missing.md), [b](page.md#top), [c](https://example.org/x.md) and `[d](nope.md)`.\n"
        '<a href="gone.png"><img src="gone.png" width="20%"></a> <img src="https://example.org/y.png">\n'
        "As methods.md §4 says (issue #12, commit e721e3a); methods-overview.md and 1000000 are fine.\n",
        encoding="utf-8",
    )
    assert _relative_links(page) == ["missing.md", "page.md#top", "gone.png", "gone.png"]
    line = page.read_text(encoding="utf-8").splitlines()[2]
    assert [p.search(line).group(0) for p in FORBIDDEN.values()] == ["methods.md", "issue #12", "e721e3a"]
    assert not FORBIDDEN["a design file outside the repository"].search("see methods-overview.md")
    assert not GIT_REF.search("1000000 rows, a defaced word, 0.021")


# The modules whose docstrings carry runnable examples (`>>>`): the examples are part of the docs site, so they run.
DOCTEST_MODULES = (
    "cse.config.limits",
    "cse.storage.secrets",
    "cse.config.suggest",
    "cse.storage.readers",
    "cse.models.losses",
    "cse.models.pooling",
    "cse.models.heads",
    "cse.models.method",
    "cse.models.methods.crtd",
    "cse.models.finite",
    "benchmarks.machine",
    "cse.evaluation.alignment",
    "cse.evaluation.sts",
    "cse.evaluation.retrieval",
    "cse.evaluation.classifier",
    "cse.evaluation.encode",
    "cse.evaluation.qualitative",
    "cse.evaluation.plots",
    "cse.training.precision",
    "cse.training.state_writer",
    "cse.training.memory",
)


@pytest.mark.parametrize("module", DOCTEST_MODULES)
def test_docstring_examples_run(module: str):
    import doctest
    import importlib

    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True)
    assert result.attempted > 0, f"{module} has no docstring examples"
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} docstring examples of {module} failed (see above)"
    )
