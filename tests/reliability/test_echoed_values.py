"""Issue 43, Echoed values: whatever value `cse` echoes (an argument, a path, a key, SQL a library quotes back) is cut
and escaped like a `repr` (`cse.config.limits.echo`, applied to every line `cse` prints about a value), so an error
stays one short line that shows what was given.

The campaign's cases: a 100,000-character argument was echoed whole (error lines of 100 to 200 KB, while the docs said
long values are cut: only `-p` was); `cse push`, `cse deliver-metrics` and `cse sql` echoed control bytes and ANSI
escape sequences raw (a terminal ran them), and a newline in a path split `deliver-metrics`' message over two lines.
The new case of the class: characters outside ASCII that still rewrite what a terminal shows, a right-to-left override
(U+202E, "Trojan Source") and the one-character C1 control sequence introducer (U+009B), in a path or an SQL name."""

from __future__ import annotations

import pytest

from cse.config.limits import MESSAGE_CHARS
from cse.ops.cli import main as cse

LONG = "x" * 100_000
RAW = "a\x1b[31mred\x1b[0m\x07b\nc"  # an ANSI colour, a bell and a newline
RAW_SHOWN = repr(RAW)[1:-1]  # a\x1b[31mred\x1b[0m\x07b\nc, as repr writes it
NEW = "report\u202etxt.exe\x9b2J"  # a right-to-left override and the C1 CSI


def _lines(capsys) -> tuple[str, list[str]]:
    out = capsys.readouterr()
    text = out.out + out.err
    return text, text.splitlines()


def _printable(text: str) -> bool:
    return all(line.isprintable() for line in text.splitlines())


def _export(tmp_path):
    """A complete export folder (model card and modules.json): `cse push` gets past its checks."""
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "modules.json").write_text("[]")
    (folder / "README.md").write_text("---\nlibrary_name: sentence-transformers\n---\n")
    return folder


# every command's argument that an error echoes: (argv with {} for the value, what the command is about)
LONG_ARGS = {
    "dataset KEY": ["dataset", "nli", "{}"],
    "push EXPORT_DIR": ["push", "{}", "owner/name"],
    "push --token-env": ["push", "{export}", "owner/name", "--token-env", "{}"],
    "card RUN_DIR": ["card", "{}"],
    "deliver-metrics RUN_DIR": ["deliver-metrics", "{}"],
    "sql SQL": ["sql", "SELECT {} FROM manifests"],
    "run DEPLOYMENT": ["run", "{}"],
    "run -p": ["run", "train-simcse/smoke", "-p", "{}"],
    "dataset KIND": ["dataset", "{}"],
}


def _argv(args: list[str], value: str, tmp_path) -> list[str]:
    export = str(_export(tmp_path)) if any("{export}" in a for a in args) else ""
    return [a.replace("{export}", export).replace("{}", value) for a in args]


@pytest.mark.parametrize("args", list(LONG_ARGS.values()), ids=list(LONG_ARGS))
def test_a_100000_character_argument_is_echoed_cut(args, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # `push --token-env` reaches the token check
    assert cse(_argv(args, LONG, tmp_path)) in (1, 2)
    text, lines = _lines(capsys)
    assert len(lines) == 1 and len(text) < 2_000, (len(lines), len(text), text[:300])
    assert "100,000 characters" in text or "characters)" in text, text


RAW_ARGS = {
    "push EXPORT_DIR": ["push", "/nowhere/{}", "owner/name"],
    "deliver-metrics RUN_DIR": ["deliver-metrics", "/nowhere/{}"],
    "sql SQL": ["sql", 'SELECT * FROM "{}"'],
    "dataset KEY": ["dataset", "nli", "{}"],
    "card RUN_DIR": ["card", "/nowhere/{}"],
}


@pytest.mark.parametrize("args", list(RAW_ARGS.values()), ids=list(RAW_ARGS))
def test_control_bytes_and_escape_sequences_are_echoed_escaped_on_one_line(args, tmp_path, capsys):
    assert cse(_argv(args, RAW, tmp_path)) in (1, 2)
    text, lines = _lines(capsys)
    assert len(lines) == 1 and _printable(text) and "\x1b" not in text, repr(text)
    # shown escaped; DuckDB quotes back a part of the SQL, whose newline becomes a space as its own line breaks do
    assert RAW_SHOWN in text or (args[0] == "sql" and RAW_SHOWN.replace("\\n", " ") in text), text


@pytest.mark.parametrize("args", list(RAW_ARGS.values()), ids=list(RAW_ARGS))
def test_terminal_rewriting_characters_outside_ascii_are_echoed_escaped(args, tmp_path, capsys):
    """New case: a right-to-left override (U+202E) and the C1 CSI (U+009B) are no ASCII control byte, but a terminal
    obeys them all the same (the override shows `report\u202etxt.exe` as `reportexe.txt`)."""
    assert cse(_argv(args, NEW, tmp_path)) in (1, 2)
    text, lines = _lines(capsys)
    assert len(lines) == 1 and _printable(text) and "\u202e" not in text and "\x9b" not in text, repr(text)
    assert "report\\u202etxt.exe\\x9b2J" in text, text


def test_the_rule():
    from cse.config.limits import echo, one_line

    assert echo("/data/runs/simcse/k1") == "/data/runs/simcse/k1"  # a plain value is shown as it is
    assert echo(RAW) == repr(RAW) and echo(NEW) == repr(NEW)
    assert echo(LONG) == repr("x" * MESSAGE_CHARS) + "… (100,000 characters)"
    message = f"{LONG}: not a folder; also {LONG!r} and {RAW!r} and {RAW}\n(see\tabove)"
    line = one_line(message, echoed=[LONG, RAW])
    assert line == f"{echo(LONG)}: not a folder; also {echo(LONG)} and {echo(RAW)} and {echo(RAW)} (see above)"
    partial = f"Binder Error: column {LONG[:-1]}y not found"  # a library quoting back a part of an argument
    assert (
        one_line(partial, echoed=[LONG])
        == f"Binder Error: column {'x' * MESSAGE_CHARS}… (100,000 characters) not found"
    )

    assert one_line("SELECT a\x1b[2J") == "SELECT a\\x1b[2J"
