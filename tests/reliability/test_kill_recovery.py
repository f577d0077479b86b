"""Item 4: after a SIGKILL, the next run of the stage removes the dead build's temporaries (never a live one's)
and marks the orphaned MLflow run KILLED."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from cse.config.stages import IngestConfig, WikiSource
from cse.storage.locks import exclusive
from cse.storage.settings import REPO_ROOT
from cse.tracking.orphans import ORPHAN_TAG, OWNER_TAG
from tests.reliability.conftest import data_runs, ingest

_KILLED_WRITER = textwrap.dedent("""
    import os, sys, time, pathlib
    import cse.storage.datasets as ds
    real = ds.write_parquet
    def stuck(table, path, schema=None):  # the first part is written, then the stage "hangs" until killed
        out = real(table, path, schema)
        pathlib.Path(sys.argv[2]).write_text(str(os.getpid()))
        time.sleep(600)
        return out
    ds.write_parquet = stuck
    from cse.config.stages import IngestConfig, WikiSource
    from cse.tasks.ingest import ingest_dataset
    ingest_dataset.fn("wiki1m", IngestConfig(wiki=WikiSource(path=sys.argv[1])))
""")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sigkilled_stage_leaves_nothing_behind_after_the_next_run(sources, root, tmp_path):
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(sources["wiki1m"]), str(ready)], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert proc.poll() is None, "the writer process died before it wrote a part"
            assert time.monotonic() < deadline, "the writer process never wrote its first part"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    leftovers = list(root.kind_dir("wiki1m").glob(".tmp-*"))
    assert len(leftovers) == 1 and f"-{proc.pid}-" in leftovers[0].name
    [orphan] = [
        r for r in data_runs("ingest-wiki1m") if r.data.tags.get(OWNER_TAG, "").split(":")[1:2] == [str(proc.pid)]
    ]
    assert orphan.info.status == "RUNNING"

    ref = ingest("wiki1m", IngestConfig(wiki=WikiSource(path=str(sources["wiki1m"]))))
    assert ref.rows == 300 and not ref.cache_hit
    assert list(root.kind_dir("wiki1m").glob(".tmp-*")) == []
    runs = {r.info.run_id: r for r in data_runs("ingest-wiki1m")}
    assert runs[orphan.info.run_id].info.status == "KILLED"
    assert str(proc.pid) in runs[orphan.info.run_id].data.tags[ORPHAN_TAG]
    newest = data_runs("ingest-wiki1m")[-1]
    assert newest.info.status == "FINISHED" and newest.data.tags["closed_orphaned_runs"] == orphan.info.run_id


def test_only_temporaries_of_dead_unlocked_writers_are_removed(root):
    d = root.kind_dir("tokens")
    d.mkdir(parents=True)
    live = subprocess.Popen(["sleep", "60"])
    try:
        dead = _dead_pid()
        of_live = d / f".tmp-keylive-{live.pid}-0000aaaa"
        of_dead = d / f".tmp-keydead-{dead}-0000bbbb"
        of_locked = d / f".tmp-keylocked-{dead}-0000cccc"
        shard_of_dead = d / "keyshards.shards" / f".tmp-shard-00001.parquet-{dead}-0000dddd"
        held = d / f".tmp-keyheld-{live.pid}-0000eeee"  # the caller holds this key's lock: stale whoever wrote it
        for p in (of_live, of_dead, of_locked, held):
            p.mkdir()
        shard_of_dead.parent.mkdir()
        shard_of_dead.write_bytes(b"half a shard")
        with exclusive(root.lock_path("tokens", "keylocked"), "another builder"):  # a live builder holds this one
            removed = root.clean_stale("tokens", held_key="keyheld")
        assert sorted(removed) == sorted([of_dead, shard_of_dead, held])
        assert of_live.exists() and of_locked.exists() and not of_dead.exists() and not shard_of_dead.exists()
    finally:
        live.kill()
        live.wait()


def test_a_run_of_a_live_process_is_not_closed():
    from cse.tracking.orphans import close_orphaned_runs
    from cse.tracking.stage_runs import stage_run
    from cse.tracking.store import ensure_experiment

    with stage_run("data", "reliability-live") as run:  # this process is alive: its run stays RUNNING
        assert close_orphaned_runs(ensure_experiment("data"), "reliability-live") == []
        assert data_runs("reliability-live")[-1].info.run_id == run.info.run_id
        assert data_runs("reliability-live")[-1].info.status == "RUNNING"
