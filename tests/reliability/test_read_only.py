"""Issue 23 item 6: `cse verify`, `report`, `sql` and `dataset` work on a read-only data root (a read-only mount: as
root, permission bits do not stop writes, so the commands run in a forked process with its own mount namespace where
the data root is bind-mounted read-only). Only repairs write, and a repair that cannot be written is said."""

from __future__ import annotations

import contextlib
import ctypes
import io
import multiprocessing as mp
import os
import stat
import subprocess
import traceback
from pathlib import Path

from tests.reliability.conftest import flip_byte_in_data, ingest, part

CLONE_NEWNS = 0x00020000


def _child(root: Path, fn, results) -> None:
    try:
        if os.geteuid() == 0:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(CLONE_NEWNS) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed: a read-only mount needs it as root")
            subprocess.run(["mount", "--make-rprivate", "/"], check=True)  # nothing leaks to the host's mounts
            subprocess.run(["mount", "--bind", "-o", "ro", str(root), str(root)], check=True)
        try:  # the folder really is read-only
            (root / "probe").touch()
        except OSError:
            pass
        else:
            raise AssertionError(f"{root} is writable")
        results.put(("ok", fn()))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put(("error", traceback.format_exc()))


def in_read_only(folder: Path, fn):
    """`fn()` run with `folder` read-only (a read-only bind mount in a forked process's own mount namespace as root,
    permission bits otherwise); returns its (picklable) result."""
    if os.geteuid() != 0:
        for p in [folder, *folder.rglob("*")]:
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        ctx = mp.get_context("fork")
        results = ctx.Queue()
        proc = ctx.Process(target=_child, args=(folder, fn, results))
        proc.start()
        what, out = results.get(timeout=300)
        proc.join(timeout=60)
    finally:
        if os.geteuid() != 0:
            for p in [folder, *folder.rglob("*")]:
                p.chmod(p.stat().st_mode | stat.S_IWUSR)
    assert what == "ok", out
    return out


def _read_only(root: Path, commands: list[list[str]]) -> list[tuple[int, str, str]]:
    """Run `cse` commands with the data root read-only; (status, stdout, stderr) of each."""

    def run():
        from cse.ops.cli import main as cse

        out = []
        for argv in commands:
            o, e = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                status = cse(argv)
            out.append((status, o.getvalue(), e.getvalue()))
        return out

    return in_read_only(root, run)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_every_reading_command_works_on_a_read_only_root(ingest_config, root):
    nli = ingest("nli", ingest_config)
    root.catalog_path.unlink()  # no catalog yet: the views are built in memory, nothing is written
    before = _tree(root.root)
    (v, v_out, _), (r, r_out, _), (q, q_out, q_err), (d, d_out, _) = _read_only(
        root.root, [["verify"], ["report"], ["sql", "select count(*) AS n from nli"], ["dataset", "nli"]]
    )
    assert v == 0 and "all intact" in v_out  # the campaign's `[Errno 30] ... damaged.json`
    assert r == 0 and nli.key in r_out
    assert q == 0 and "200" in q_out, q_err
    assert d == 0 and f"nli/{nli.key}: 200 rows" in d_out
    assert _tree(root.root) == before


def test_verify_on_a_read_only_root_reports_damage_and_says_it_could_not_mark_it(ingest_config, root):
    """A new case of the class: damage found on a read-only root is reported (exit 1), and the repair it could not
    write (the mark) is said instead of failing."""
    nli = ingest("nli", ingest_config)
    flip_byte_in_data(part(root, "nli", nli.key))
    before = _tree(root.root)
    [(status, out, err)] = _read_only(root.root, [["verify"]])
    assert status == 1 and f"DAMAGED nli/{nli.key}" in out and "content hash" in out
    assert "repairs not written (is the data root read-only?)" in out and "not marked" in out, out + err
    assert _tree(root.root) == before
