"""`cse` command line: look at what the pipeline produced.

    cse report            datasets (and evaluations, when any) in the data root
    cse sql "SELECT ..."  any SQL over the DuckDB catalog
    cse deliver-metrics DIR ...  send the metrics a training job spooled while MLflow was unreachable
                          (DIR = its job folder, $CSE_HOME/runs/<method>/<key>) to its MLflow run
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from config.settings import get_settings
from storage.catalog import query, refresh_catalog
from storage.layout import DataRoot


def _print(df: pd.DataFrame) -> None:
    with pd.option_context("display.max_columns", 30, "display.width", 200, "display.max_colwidth", 60):
        print(df.to_string(index=False) if len(df) else "(no rows)")


def report(root: DataRoot) -> None:
    refresh_catalog(root)
    print(f"Data root: {root.root}\n\nDatasets:")
    _print(query(root, "SELECT kind, key, rows, created[:19] AS created, json_extract_string(source, '$.file') AS source "
                       "FROM manifests ORDER BY created"))
    if root.list("corruption"):
        print("\nCorruption statistics:")
        _print(query(root, "SELECT * FROM corruption_stats"))
    if root.list("evaluations"):
        print("\nSTS test evaluations (Spearman x100; STS12-16 'all', STS-B/SICK-R test), newest last:")
        _print(query(root, "SELECT created[:19] AS created, label, round(sts12, 2) AS sts12, round(sts13, 2) AS sts13, "
                           "round(sts14, 2) AS sts14, round(sts15, 2) AS sts15, round(sts16, 2) AS sts16, "
                           "round(stsb, 2) AS \"sts-b\", round(sickr, 2) AS \"sick-r\", sts_avg AS avg, "
                           "round(retrieval_r1, 2) AS r1, round(alignment, 4) AS align, round(uniformity, 4) AS uniform "
                           "FROM evaluations_all WHERE mode = 'test' ORDER BY created"))


def deliver_metrics(run_dirs: list[str]) -> int:
    """Deliver the spool of every job folder; exit status 1 when one could not be delivered."""
    from storage.runs import RunDir
    from tasks.tracking import SpoolNotDelivered, deliver_spool

    status = 0
    for path in run_dirs:
        try:
            n = deliver_spool(RunDir.at(path))
        except (SpoolNotDelivered, FileNotFoundError, ValueError) as e:
            print(f"{path}: not delivered: {e}", file=sys.stderr)
            status = 1
        else:
            print(f"{path}: delivered {n} metric values" if n else f"{path}: nothing to deliver")
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cse", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("report", help="datasets and evaluations in the data root")
    q = sub.add_parser("sql", help="run SQL over the DuckDB catalog")
    q.add_argument("sql")
    d = sub.add_parser("deliver-metrics", help="deliver metrics spooled while the MLflow server was unreachable")
    d.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="job folder ($CSE_HOME/runs/<method>/<key>)")
    args = p.parse_args(argv)
    if args.cmd == "deliver-metrics":
        return deliver_metrics(args.run_dirs)
    root = DataRoot(get_settings().data_root)
    if args.cmd == "report":
        report(root)
    else:
        refresh_catalog(root)
        _print(query(root, args.sql))
    return 0


if __name__ == "__main__":
    sys.exit(main())
