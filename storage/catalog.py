"""A DuckDB catalog over the Parquet outputs: SQL over every dataset the pipeline wrote.

Views (refreshed after each stage writes):
- `<kind>` (wiki1m, nli, sts, tokens, corruption, evaluations, comparisons): the newest dataset of that kind;
  `<kind>_all`: every dataset of the kind with a `dataset_key` column;
- `manifests`: one row per dataset (kind, key, rows, content hash, params, stats, created);
- `token_lengths`: length distribution per tokens dataset and column;
- `corruption_stats`: masked / replaced ratios per corruption dataset.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import duckdb

from storage.layout import KINDS, DataRoot

log = logging.getLogger(__name__)


def _sql_list(paths: list[Path]) -> str:
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


def _statements(root: DataRoot) -> list[str]:
    stmts = ["CREATE OR REPLACE TABLE manifests (kind VARCHAR, key VARCHAR, rows BIGINT, content_hash VARCHAR, "
             "created VARCHAR, path VARCHAR, params JSON, stats JSON, source JSON)"]
    present = set()
    for kind in KINDS:
        datasets = root.list(kind)
        if not datasets:
            continue
        present.add(kind)
        for folder, m in datasets:
            stmts.append(
                "INSERT INTO manifests VALUES ("
                + ", ".join("'" + str(v).replace("'", "''") + "'" for v in (
                    m.kind, m.key, m.rows, m.content_hash, m.created, folder,
                    json.dumps(m.params), json.dumps(m.stats), json.dumps(m.source)))
                + ")"
            )
        newest_dir, newest = datasets[-1]
        stmts.append(f"CREATE OR REPLACE VIEW {kind} AS SELECT * FROM read_parquet({_sql_list(newest.paths(newest_dir))})")
        union = " UNION ALL BY NAME ".join(
            f"SELECT '{m.key}' AS dataset_key, * FROM read_parquet({_sql_list(m.paths(d))})" for d, m in datasets
        )
        stmts.append(f"CREATE OR REPLACE VIEW {kind}_all AS {union}")
    if "tokens" in present:
        stmts.append(
            "CREATE OR REPLACE VIEW token_lengths AS SELECT dataset_key, \"column\", length, count(*) AS n "
            "FROM tokens_all GROUP BY ALL ORDER BY ALL"
        )
    if "corruption" in present:
        stmts.append(
            "CREATE OR REPLACE VIEW corruption_stats AS SELECT dataset_key, variant, count(*) AS sentences, "
            "sum(n_masked) / sum(len(input_ids) - 2) AS masked_ratio, "
            "sum(n_replaced) / sum(len(input_ids) - 2) AS replaced_ratio "
            "FROM corruption_all GROUP BY ALL ORDER BY ALL"
        )
    return stmts


def refresh_catalog(root: DataRoot, attempts: int = 5) -> Path | None:
    """Rebuild the catalog's views. The file is single-writer: a busy catalog is retried, then skipped
    with a warning (the data itself is unaffected; the next stage refreshes it)."""
    root.root.mkdir(parents=True, exist_ok=True)
    stmts = _statements(root)
    for attempt in range(attempts):
        try:
            with duckdb.connect(str(root.catalog_path)) as con:
                con.execute("BEGIN TRANSACTION")
                for s in stmts:
                    con.execute(s)
                con.execute("COMMIT")
            return root.catalog_path
        except duckdb.IOException as e:  # locked by another process
            if attempt == attempts - 1:
                log.warning("DuckDB catalog %s busy (%s); not refreshed this time", root.catalog_path, e)
                return None
            time.sleep(0.5 * (attempt + 1))
    return None


def query(root: DataRoot, sql: str):
    """Run SQL against the catalog read-only; returns a pandas DataFrame."""
    with duckdb.connect(str(root.catalog_path), read_only=True) as con:
        return con.execute(sql).df()
