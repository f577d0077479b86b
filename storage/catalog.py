"""A DuckDB catalog over the Parquet outputs: SQL over every dataset the pipeline wrote.

Views (refreshed after each stage writes):
- `<kind>` (wiki1m, nli, sts, tokens, corruption, evaluations, comparisons): the newest dataset of that kind;
  `<kind>_all`: every dataset of the kind with a `dataset_key` column;
- `manifests`: one row per dataset (kind, dataset_key, rows, content hash, params, stats, created), the generators'
  (model folders, no Parquet, no views) included;
- `token_lengths`: length distribution per tokens dataset and column;
- `corruption_stats`: masked / replaced ratios per corruption dataset;
- `comparisons_wide`: the newest comparison's STS table, one row per run with the seven tasks and Avg. as columns,
  beside its backbone's Avg. before training, the published Avg. and their difference;
- `damaged_datasets`: datasets left out because they failed the cheap check of `cse.storage.integrity` (kind, key,
  file, reason). One damaged dataset never breaks the catalog: the others stay queryable.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from cse.storage.integrity import Problem, check_dataset, warn_damaged_once
from cse.storage.layout import KINDS, NO_PARQUET_KINDS, DataRoot
from cse.storage.readers import SEVEN_TASKS

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)


def _q(v: object) -> str:
    return "'" + str(v).replace("'", "''") + "'"


def _sql_list(paths: list[Path]) -> str:
    return "[" + ", ".join(map(_q, paths)) + "]"


def intact_datasets(root: DataRoot, kind: str) -> tuple[list, list[Problem]]:
    """The kind's datasets that pass the cheap check (oldest first), and the problems of the others."""
    listed = root.list(kind)
    good, problems = [], []
    for folder in sorted(set(root.dataset_dirs(kind)) - {folder for folder, _ in listed}):
        # an unreadable manifest, or a listed file missing
        problems += check_dataset(folder, kind, folder.name) or [Problem(kind, folder.name, str(folder), "incomplete")]
    for folder, m in listed:
        if found := check_dataset(folder, kind, folder.name):
            problems += found
        else:
            good.append((folder, m))
    return good, problems


def _statements(root: DataRoot) -> tuple[list[str], list[Problem]]:
    stmts = [
        "CREATE OR REPLACE TABLE manifests (kind VARCHAR, dataset_key VARCHAR, rows BIGINT, content_hash VARCHAR, "
        "created VARCHAR, path VARCHAR, params JSON, stats JSON, source JSON)"
    ]
    present = set()
    damaged: list[Problem] = []
    for kind in KINDS:
        datasets, problems = intact_datasets(root, kind)
        damaged += problems
        for folder, m in datasets:
            values = (m.kind, m.key, m.rows, m.content_hash, m.created, folder)
            values += tuple(json.dumps(d) for d in (m.params, m.stats, m.source))
            stmts.append(f"INSERT INTO manifests VALUES ({', '.join(map(_q, values))})")
        if not datasets or kind in NO_PARQUET_KINDS:  # a generator holds model files: in `manifests`, no views
            stmts += [f"DROP VIEW IF EXISTS {kind}", f"DROP VIEW IF EXISTS {kind}_all"]
            continue
        present.add(kind)
        newest_dir, newest = datasets[-1]
        stmts.append(
            f"CREATE OR REPLACE VIEW {kind} AS SELECT * FROM read_parquet({_sql_list(newest.paths(newest_dir))})"
        )
        union = " UNION ALL BY NAME ".join(
            f"SELECT '{m.key}' AS dataset_key, * FROM read_parquet({_sql_list(m.paths(d))})" for d, m in datasets
        )
        stmts.append(f"CREATE OR REPLACE VIEW {kind}_all AS {union}")
    stmts.append("CREATE OR REPLACE TABLE damaged_datasets (kind VARCHAR, key VARCHAR, file VARCHAR, reason VARCHAR)")
    stmts += [
        f"INSERT INTO damaged_datasets VALUES ({_q(p.kind)}, {_q(p.key)}, {_q(p.file)}, {_q(p.reason)})"
        for p in damaged
    ]
    derived = {  # view -> (the kind it reads, its definition)
        "token_lengths": (
            "tokens",
            'CREATE OR REPLACE VIEW token_lengths AS SELECT dataset_key, "column", length, count(*) AS n '
            "FROM tokens_all GROUP BY ALL ORDER BY ALL",
        ),
        "corruption_stats": (
            "corruption",
            "CREATE OR REPLACE VIEW corruption_stats AS SELECT dataset_key, variant, count(*) AS sentences, "
            "sum(n_masked) / sum(len(input_ids) - 2) AS masked_ratio, "
            "sum(n_replaced) / sum(len(input_ids) - 2) AS replaced_ratio "
            "FROM corruption_all GROUP BY ALL ORDER BY ALL",
        ),
        "comparisons_wide": ("comparisons", comparisons_wide_sql()),
    }
    stmts += [sql if kind in present else f"DROP VIEW IF EXISTS {view}" for view, (kind, sql) in derived.items()]
    return stmts, damaged


def comparisons_wide_sql() -> str:
    """The view `comparisons_wide`: the newest comparison's STS rows pivoted to one row per run (`run` values of the
    seven tasks and Avg.; `backbone_avg`, `published_avg` and `difference_avg`: the Avg. of the run's other rows)."""

    def value(kind: str, metric: str, name: str) -> str:
        return f"max(value) FILTER (WHERE row_kind = '{kind}' AND metric = '{metric}') AS {name}"

    columns = [value("run", t, t) for t in (*SEVEN_TASKS, "sts_avg")]
    columns += [value(k, "sts_avg", f"{k}_avg") for k in ("backbone", "published", "difference")]
    return (
        "CREATE OR REPLACE VIEW comparisons_wide AS SELECT label, method, backbone, setting, mlflow_run_id, "
        + ", ".join(columns)
        + " FROM comparisons WHERE \"table\" = 'sts' GROUP BY label, method, backbone, setting, mlflow_run_id "
        "ORDER BY label"
    )


_IN_MEMORY: dict[Path, duckdb.DuckDBPyConnection] = {}  # data root → its catalog, when the file cannot be written


def _writable(folder: Path) -> bool:
    return (
        folder.is_dir()
        and os.access(folder, os.W_OK)
        and (not (folder / "catalog.duckdb").exists() or os.access(folder / "catalog.duckdb", os.W_OK))
    )


def _read_only_error(e: BaseException) -> bool:
    text = str(e).lower()
    return (
        isinstance(e, PermissionError)
        or getattr(e, "errno", None) in (errno.EROFS, errno.EACCES)
        or "read-only" in text
        or "permission denied" in text
    )


def _close_in_memory(root: DataRoot) -> None:
    if (old := _IN_MEMORY.pop(root.root, None)) is not None:
        old.close()


def _in_memory(root: DataRoot, stmts: list[str]) -> None:
    """The catalog's views in an in-memory DuckDB for this process (nothing written): what `query` reads when the
    data root cannot be written (a read-only mount, another user's root)."""
    con = duckdb.connect(":memory:")
    for s in stmts:
        con.execute(s)
    _close_in_memory(root)
    _IN_MEMORY[root.root] = con


def refresh_catalog(root: DataRoot, attempts: int = 5) -> Path | None:
    """Rebuild the catalog's views. The file is single-writer: a busy catalog is retried, then skipped
    with a warning (the data itself is unaffected; the next stage refreshes it). Damaged datasets are left out
    and named (one warning per dataset per process, and the table `damaged_datasets`); any other catalog error is a
    warning too: refreshing the catalog never fails the stage that wrote a dataset. On a data root this process
    cannot write (read-only), the views are built in memory instead (`query` reads them; None is returned)."""
    writable = _writable(root.root)
    if not root.root.is_dir() and os.access(root.root.parent if root.root.parent.is_dir() else "/", os.W_OK):
        try:
            root.root.mkdir(parents=True, exist_ok=True)
            writable = True
        except OSError:
            writable = False
    try:
        stmts, damaged = _statements(root)
    except Exception as e:  # noqa: BLE001 - the catalog is a convenience; the stage's data is already published
        log.warning("DuckDB catalog %s not refreshed: %s: %s", root.catalog_path, type(e).__name__, e)
        return None
    by_dataset: dict[str, list[Problem]] = {}
    for p in damaged:
        by_dataset.setdefault(f"{p.kind}/{p.key}", []).append(p)
    for name, problems in by_dataset.items():
        warn_damaged_once(name, problems)
    if not writable:
        try:
            _in_memory(root, stmts)
        except duckdb.Error as e:
            log.warning("in-memory catalog of the read-only data root %s not built: %s", root.root, e)
        return None
    for attempt in range(attempts):
        try:
            with duckdb.connect(str(root.catalog_path)) as con:
                con.execute("BEGIN TRANSACTION")
                for s in stmts:
                    con.execute(s)
                con.execute("COMMIT")
            _close_in_memory(root)
            return root.catalog_path
        except (duckdb.IOException, OSError) as e:  # locked by another process (or a file DuckDB cannot read/write)
            if _read_only_error(e):
                _in_memory(root, stmts)
                return None
            if "lock" not in str(e).lower():
                log.warning("DuckDB catalog %s not refreshed: %s", root.catalog_path, e)
                return None
            if attempt == attempts - 1:
                log.warning("DuckDB catalog %s busy or unreadable (%s); not refreshed this time", root.catalog_path, e)
                return None
            time.sleep(0.5 * (attempt + 1))
        except duckdb.Error as e:  # e.g. a Parquet file that passed the cheap check but DuckDB cannot bind
            log.warning("DuckDB catalog %s not refreshed: %s", root.catalog_path, e)
            return None
    return None


def query(root: DataRoot, sql: str) -> pd.DataFrame:
    """Run SQL against the catalog read-only (the in-memory one of a read-only data root when the last refresh built
    one); returns a pandas DataFrame."""
    if (con := _IN_MEMORY.get(root.root)) is not None:
        return _frame(con.cursor().execute(sql), sql)
    with duckdb.connect(str(root.catalog_path), read_only=True) as con:
        return _frame(con.execute(sql), sql)


class EmptyQuery(ValueError):
    """SQL that holds no statement (empty, blank, only comments or `;`): nothing to run."""


def _frame(result: duckdb.DuckDBPyConnection | None, sql: str) -> pd.DataFrame:
    if result is None:  # DuckDB runs nothing and returns None for a text without a statement
        shown = sql if len(sql) <= 80 else f"{sql[:80]}…"
        raise EmptyQuery(f"no SQL statement in {shown!r}: nothing to run (e.g. cse sql 'SELECT * FROM manifests')")
    return result.df()


def damaged(root: DataRoot) -> list[Problem]:
    """The damaged datasets the last refresh left out (none when the catalog has no such table yet)."""
    try:
        df = query(root, "SELECT kind, key, file, reason FROM damaged_datasets ORDER BY kind, key")
    except duckdb.Error:
        return []
    return [Problem(*row) for row in df.itertuples(index=False)]
