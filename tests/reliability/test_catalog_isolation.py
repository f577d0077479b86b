"""Item 2: one damaged dataset never breaks the catalog, `cse report`, `cse sql` on other views, or another stage."""

from __future__ import annotations

from cse.ops.cli import main as cse
from cse.storage.catalog import damaged, query, refresh_catalog
from tests.reliability.conftest import data_runs, ingest, part, truncate


def test_damaged_wiki_part_is_named_and_everything_else_works(ingest_config, root, capsys):
    wiki = ingest("wiki1m", ingest_config)
    nli = ingest("nli", ingest_config)
    bad = part(root, "wiki1m", wiki.key)
    truncate(bad)

    assert refresh_catalog(root) is not None  # no exception, the catalog was rebuilt
    problems = damaged(root)  # (truncated: wrong size, and no Parquet footer)
    assert {(p.kind, p.key, p.file) for p in problems} == {("wiki1m", wiki.key, str(bad))}
    assert query(root, "select count(*) as n from nli").n[0] == nli.rows
    assert query(root, "select kind from manifests").kind.tolist() == ["nli"]  # intact datasets only

    assert cse(["report"]) == 0
    out = capsys.readouterr().out
    assert "Damaged datasets" in out and f"wiki1m/{wiki.key}" in out and str(bad) in out
    assert cse(["sql", "select count(*) as n from nli"]) == 0
    assert str(nli.rows) in capsys.readouterr().out
    assert cse(["sql", "select count(*) from wiki1m"]) == 2  # the damaged kind's view is gone: one clear line
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]  # (after the catalog's warnings)
    assert last.startswith("cse: error:") and f"damaged datasets left out of the catalog: wiki1m/{wiki.key}" in last

    sts = ingest("sts", ingest_config)  # an unrelated stage run refreshes the catalog and still finishes
    assert not sts.cache_hit
    assert data_runs("ingest-sts")[-1].info.status == "FINISHED"
    assert query(root, "select count(*) as n from sts").n[0] == sts.rows


def test_unreadable_manifest_does_not_break_listing_or_catalog(ingest_config, root):
    wiki = ingest("wiki1m", ingest_config)
    nli = ingest("nli", ingest_config)
    (root.dataset_dir("wiki1m", wiki.key) / "manifest.json").write_text("{ not json")
    assert root.list("wiki1m") == []
    assert refresh_catalog(root) == root.catalog_path  # refreshed (None would mean skipped)
    assert [p.kind for p in damaged(root)] == ["wiki1m"]
    assert query(root, "select count(*) as n from nli").n[0] == nli.rows
