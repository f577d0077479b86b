"""Ingestion: canonical sources (or a local copy, or Hugging Face datasets) → Parquet datasets with manifests."""

from __future__ import annotations

import logging
import time

from prefect import task

from cse.config.stages import IngestConfig, NliSource, SentEvalSource, WikiSource
from cse.storage import schemas
from cse.storage.catalog import refresh_catalog
from cse.storage.datasets import DatasetRef, write_dataset
from cse.storage.keys import SCHEMA_VERSIONS, ingest_key
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest
from cse.storage.readers import ReadStats
from cse.storage.settings import get_settings
from cse.storage.sources import ResolvedSource, check_sts_counts, read_source, resolve_source
from cse.tasks.log import stage_logger
from cse.tracking.lineage import CONTEXT_SOURCE, log_dataset_inputs
from cse.tracking.stage_runs import log_quarantine, log_run_results, stage_run

SCHEMA_VERSION = SCHEMA_VERSIONS["ingest"]
PART_ROWS = 250_000
_SCHEMAS = {"wiki1m": schemas.WIKI1M, "nli": schemas.NLI, "sts": schemas.STS}


class EmptySourceError(ValueError):
    """A source without a single usable row: refused at ingestion, naming the file and the counts."""


_FINDINGS = ("bom", "control_lines", "long_lines")
Logger = logging.Logger | logging.LoggerAdapter


@task(name="ingest-dataset", retries=0)
def ingest_dataset(dataset: str, config: IngestConfig, verify: bool = False) -> DatasetRef:
    """Ingest one source. Same source content → the existing dataset (a cache hit), verified first (content hashes
    too with `verify` or `config.verify`); a damaged one is quarantined and rebuilt."""
    log = stage_logger()
    root = DataRoot(get_settings().data_root)
    sources: dict[str, WikiSource | NliSource | SentEvalSource] = {
        "wiki1m": config.wiki,
        "nli": config.nli,
        "sts": config.senteval,
    }
    src_cfg = sources[dataset]
    t0 = time.perf_counter()
    with stage_run("data", f"ingest-{dataset}", params={"dataset": dataset, "source": src_cfg.model_dump()}) as run:
        src = resolve_source(
            root,
            dataset,
            src_cfg.path,
            src_cfg.url,
            sha256=src_cfg.sha256,
            retries=config.download_retries,
            hf=src_cfg.hf,
        )
        key = ingest_key(dataset, src.content_hash)
        log_run_results(
            run.info.run_id,
            tags={
                "dataset": dataset,
                "source_origin": src.origin,
                "source_location": src.location,
                "source_hash": src.content_hash,
                "key": key,
            },
        )
        log_dataset_inputs(run.info.run_id, [(src, CONTEXT_SOURCE)])  # the raw source (file, folder, URL, HF) + hash
        with root.building(dataset, key):  # concurrent flows ingest a source once
            manifest, quarantined = root.reuse(dataset, key, full=verify or config.verify)
            if quarantined is not None:
                log_quarantine(quarantined, log)
            hit = manifest is not None
            if manifest is None:
                manifest = _ingest(root, dataset, key, src, config, log)
        seconds = time.perf_counter() - t0
        _log_outcome(run.info.run_id, manifest, hit, seconds)
        log.info(
            "%s: %d rows, key %s (%s) in %.1fs", dataset, manifest.rows, key, "cache hit" if hit else "written", seconds
        )
    return DatasetRef.of(root, manifest, cache_hit=hit)


def _ingest(root: DataRoot, dataset: str, key: str, src: ResolvedSource, config: IngestConfig, log: Logger) -> Manifest:
    """Read the source, refuse it without a usable row or with other counts than expected, say what it holds
    (`_warn_findings`) and write dataset `dataset/key` in parts of `PART_ROWS` rows; the catalog is refreshed."""
    table, stats = read_source(src, strict=config.strict, max_line_chars=config.max_line_chars)
    # nothing to tokenise or train on: refused here, not later
    if (usable := table.num_rows - stats.empty) < 1:
        raise EmptySourceError(
            f"{src.where}: {usable} usable rows ({table.num_rows} rows read, {stats.empty} with a blank "
            f"sentence: empty, or only whitespace and invisible characters; {stats.skipped} skipped): "
            "nothing to ingest"
        )
    exp = {"wiki1m": config.wiki.expected_lines, "nli": config.nli.expected_rows}.get(dataset)
    if exp is not None and table.num_rows != exp:
        raise ValueError(f"{src.where}: {table.num_rows} rows, expected {exp}")
    if dataset == "sts" and config.senteval.expected_rows:
        check_sts_counts(src, stats, config.senteval.expected_rows)
    _warn_findings(src, stats, log)
    parts = (table.slice(i, PART_ROWS) for i in range(0, max(table.num_rows, 1), PART_ROWS))
    manifest = write_dataset(
        root,
        dataset,
        key,
        parts,
        _SCHEMAS[dataset],
        params={"dataset": dataset, "schema_version": SCHEMA_VERSION},
        source=src.describe(),
        inputs={"source": src.content_hash},
        stats=stats.as_dict(),
    )
    refresh_catalog(root)
    return manifest


def _warn_findings(src: ResolvedSource, stats: ReadStats, log: Logger) -> None:
    """Warn of the kept blank rows and of each finding (`_FINDINGS`) with its first example."""
    if stats.empty:
        log.warning(
            "%s: %d rows with a blank sentence (empty, or only whitespace and invisible characters; kept)",
            src.where,
            stats.empty,
        )
    for finding in _FINDINGS:
        if n := stats.details.get(finding):
            log.warning(
                "%s: %d x %s (first: %s)%s",
                src.where,
                n,
                finding,
                stats.examples[finding][0],
                "" if finding == "bom" else "; strict: true makes them errors",
            )


def _log_outcome(run_id: str, manifest: Manifest, hit: bool, seconds: float) -> None:
    """The stage run's metrics (rows, findings, cache hit, speed), the content hash and the findings' examples."""
    st = manifest.stats
    log_run_results(
        run_id,
        metrics={
            "rows": manifest.rows,
            "empty": st.get("empty", 0),
            "skipped": st.get("skipped", 0),
            **{f: float(st.get(f, 0)) for f in _FINDINGS},
            "cache_hit": float(hit),
            "seconds": seconds,
            "rows_per_s": manifest.rows / max(seconds, 1e-9),
        },
        tags={"content_hash": manifest.content_hash},
        dicts={"source_findings.json": st["examples"]} if st.get("examples") else None,
    )
