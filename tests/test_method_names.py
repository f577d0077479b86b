"""A method is one unit: outside its unit no code names it (the acceptance rule of the method registry).

Method names may appear in config/methods.py (the registry), config/presets.py, config/published.py,
models/methods/<method>.py, the method's flow line in flows/train.py (written out so grep finds each flow),
benchmarks/facts.py (the benchmarks' table of per-method facts), prefect.yaml, the docs and the tests. Everywhere
else a per-method fact is read from the registry entry, the model class or that table. The check reads Python tokens: identifiers and string literals (docstrings and
comments are prose and may name the papers).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from cse.config.methods import METHODS
from cse.storage.settings import REPO_ROOT

ALLOWED = {"config/methods.py", "config/presets.py", "config/published.py", "flows/train.py", "benchmarks/facts.py"}
SKIPPED_DIRS = {".venv", "tests", "docs", "site", ".git", ".cse", "build"}


def method_tokens(path: Path, pattern: re.Pattern) -> list[tuple[int, str]]:
    """(line, token) of every identifier or non-docstring string literal of `path` that names a method."""
    hits = []
    previous = tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        is_docstring = tok.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        if tok.type in (tokenize.NAME, tokenize.STRING) and not is_docstring and pattern.search(tok.string):
            hits.append((tok.start[0], tok.string))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return hits


def source_files() -> list[Path]:
    unit_modules = {f"models/methods/{name}.py" for name in METHODS}
    files = []
    tops = [p for p in REPO_ROOT.iterdir() if p.name not in SKIPPED_DIRS and not p.name.startswith(".")]
    candidates = [
        p for top in tops for p in ([top] if top.suffix == ".py" else top.rglob("*.py") if top.is_dir() else [])
    ]
    for path in sorted(candidates):
        rel = path.relative_to(REPO_ROOT)
        if str(rel) in ALLOWED | unit_modules:
            continue
        files.append(path)
    return files


def test_no_method_name_outside_its_unit():
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, METHODS)) + r")\b")
    found = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {text}"
        for path in source_files()
        for line, text in method_tokens(path, pattern)
    ]
    assert not found, "method names outside their unit (read them from cse.config.methods):\n" + "\n".join(found)


def test_the_check_finds_a_method_name(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        f'"""A docstring naming {METHODS[0]} is prose."""\nx = "{METHODS[0]}"\n# {METHODS[0]} in a comment\n'
    )
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, METHODS)) + r")\b")
    assert method_tokens(probe, pattern) == [(2, f'"{METHODS[0]}"')]
