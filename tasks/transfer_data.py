"""Ingestion of SentEval's seven transfer tasks: the SentEval folder (local path, mirror or `senteval.tar`) →
the Parquet dataset `transfer` (schema `cse.storage.transfer.TRANSFER`), cached by the content hash of its files.

Kept beside `tasks/ingest.py` (which ingests Wiki1M, NLI and STS) so that each reader stays in its own module;
the `ingest` flow dispatches the dataset name `transfer` here.
"""

from __future__ import annotations

import time

from prefect import task

from cse.config.stages import IngestConfig
from cse.storage.catalog import refresh_catalog
from cse.storage.datasets import DatasetRef, write_dataset
from cse.storage.hashing import sha256_files
from cse.storage.keys import SCHEMA_VERSIONS, transfer_key
from cse.storage.layout import DataRoot
from cse.storage.settings import get_settings
from cse.storage.sources import resolve_source
from cse.storage.transfer import TRANSFER, read_transfer, transfer_source_files
from cse.tasks.log import stage_logger
from cse.tracking.stage_runs import log_run_results, stage_run

SCHEMA_VERSION = SCHEMA_VERSIONS["transfer"]


@task(name="ingest-transfer", retries=0)
def ingest_transfer(config: IngestConfig) -> DatasetRef:
    """MR, CR, SUBJ, MPQA, SST-2, TREC, MRPC → dataset `transfer`; counts checked against SentEval's."""
    log = stage_logger()
    root = DataRoot(get_settings().data_root)
    src_cfg = config.senteval
    t0 = time.perf_counter()
    with stage_run(
        "data", "ingest-transfer", params={"dataset": "transfer", "source": src_cfg.model_dump(mode="json")}
    ) as run:
        src = resolve_source(
            root, "sts", src_cfg.path, src_cfg.url, sha256=src_cfg.sha256, retries=config.download_retries
        )
        digest = sha256_files(transfer_source_files(src.path))
        key = transfer_key(digest)
        log_run_results(
            run.info.run_id,
            tags={
                "dataset": "transfer",
                "source_origin": src.origin,
                "source_location": src.location,
                "source_hash": digest,
                "key": key,
            },
        )
        with root.building("transfer", key):
            manifest = root.find("transfer", key)
            hit = manifest is not None
            if manifest is None:
                table, stats = read_transfer(src.path)
                if stats.empty:
                    log.warning("%s: %d blank examples (kept, as SentEval keeps them)", src.path, stats.empty)
                manifest = write_dataset(
                    root,
                    "transfer",
                    key,
                    [table],
                    TRANSFER,
                    params={"dataset": "transfer", "schema_version": SCHEMA_VERSION},
                    source={**src.describe(), "dataset": "transfer"},
                    inputs={"source": digest},
                    stats=stats.as_dict(),
                )
                refresh_catalog(root)
        seconds = time.perf_counter() - t0
        log_run_results(
            run.info.run_id,
            metrics={
                "rows": manifest.rows,
                "empty": manifest.stats.get("empty", 0),
                "cache_hit": float(hit),
                "seconds": seconds,
            },
            tags={"content_hash": manifest.content_hash},
        )
        log.info(
            "transfer: %d rows, key %s (%s) in %.1fs", manifest.rows, key, "cache hit" if hit else "written", seconds
        )
    return DatasetRef.of(root, manifest, cache_hit=hit)
