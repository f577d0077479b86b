"""Pre-tokenisation of training text into Parquet token ids, cached per (dataset, tokenizer, max length)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import mlflow
import numpy as np
import pyarrow as pa
from prefect import task
from tqdm.auto import tqdm

from config.settings import get_settings
from config.stages import TokenizeConfig
from models.loading import load_tokenizer, tokenizer_fingerprint, vocab_fingerprint
from storage import schemas
from storage.catalog import refresh_catalog
from storage.datasets import DatasetRef, read_dataset, write_dataset
from storage.hashing import stable_hash
from storage.layout import DataRoot
from tasks.ingest import _logger
from tasks.tracking import stage_run

SCHEMA_VERSION = 1


def tokens_key(input_hash: str, tok_fingerprint: str, max_length: int) -> str:
    return stable_hash({"stage": "tokenize", "input": input_hash, "tokenizer": tok_fingerprint,
                        "max_length": max_length, "v": SCHEMA_VERSION})


def _encode(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    # SimCSE replaces empty/None cells by a single space before tokenisation (methods.md §1.1).
    texts = [t if t and t.strip() else " " for t in texts]
    return tokenizer(texts, truncation=True, max_length=max_length, add_special_tokens=True)["input_ids"]


def _token_parts(table: pa.Table, columns: tuple[str, ...], tokenizer, cfg: TokenizeConfig) -> Iterator[pa.Table]:
    """Long-form parts: rows (id, column) interleaved per source row, in source order."""
    bar = tqdm(total=table.num_rows, unit="rows", desc="tokenize")
    for start in range(0, table.num_rows, cfg.batch_size):
        chunk = table.slice(start, cfg.batch_size)
        ids = chunk.column("id").to_numpy()
        encoded = {c: _encode(tokenizer, chunk.column(c).to_pylist(), cfg.max_length) for c in columns}
        n, k = len(ids), len(columns)
        input_ids = [encoded[c][i] for i in range(n) for c in columns]
        yield pa.table(
            {
                "id": np.repeat(ids, k),
                "column": [c for _ in range(n) for c in columns],
                "input_ids": pa.array(input_ids, pa.list_(pa.int32())),
                "length": pa.array([len(x) for x in input_ids], pa.int16()),
            },
            schema=schemas.TOKENS,
        )
        bar.update(n)
    bar.close()


@task(name="tokenize-dataset")
def tokenize_dataset(source: DatasetRef, config: TokenizeConfig) -> DatasetRef:
    """Tokenise every text column of an ingested dataset (`wiki1m` or `nli`)."""
    log = _logger()
    if source.kind not in schemas.TEXT_COLUMNS:
        raise ValueError(f"cannot tokenise dataset kind {source.kind!r}; expected one of {list(schemas.TEXT_COLUMNS)}")
    root = DataRoot(get_settings().data_root)
    t0 = time.perf_counter()
    params = {"source_kind": source.kind, "source_key": source.key, **config.model_dump()}
    with stage_run("data", f"tokenize-{source.kind}", params=params):
        tokenizer = load_tokenizer(config.tokenizer)
        tfp = tokenizer_fingerprint(tokenizer)
        key = tokens_key(source.content_hash, tfp, config.max_length)
        mlflow.set_tags({"key": key, "input_hash": source.content_hash, "tokenizer_fingerprint": tfp})
        manifest = root.find("tokens", key)
        hit = manifest is not None
        if not hit:
            table = read_dataset(root, source.kind, source.key)
            columns = schemas.TEXT_COLUMNS[source.kind]
            parts = list(_token_parts(table, columns, tokenizer, config))
            lengths = np.concatenate([p.column("length").to_numpy() for p in parts]) if parts else np.zeros(0)
            stats = {
                "sentences": int(lengths.size),
                "truncated": int((lengths >= config.max_length).sum()),
                "mean_length": float(lengths.mean()) if lengths.size else 0.0,
                "max_length_seen": int(lengths.max()) if lengths.size else 0,
            }
            manifest = write_dataset(
                root, "tokens", key, parts, schemas.TOKENS,
                params={"tokenizer": config.tokenizer, "tokenizer_fingerprint": tfp,
                        "vocab_fingerprint": vocab_fingerprint(tokenizer), "max_length": config.max_length,
                        "source_kind": source.kind, "columns": list(columns), "schema_version": SCHEMA_VERSION},
                source={"kind": source.kind, "key": source.key}, inputs={source.kind: source.content_hash}, stats=stats,
            )
            refresh_catalog(root)
        seconds = time.perf_counter() - t0
        mlflow.log_metrics({"rows": manifest.rows, "cache_hit": float(hit), "seconds": seconds,
                            "sentences_per_s": manifest.rows / max(seconds, 1e-9),
                            **{k: float(v) for k, v in manifest.stats.items()}})
        mlflow.set_tag("content_hash", manifest.content_hash)
        log.info("tokens %s: %d sentences (%s) in %.1fs", key, manifest.rows, "cache hit" if hit else "written", seconds)
    return DatasetRef.of(root, manifest, cache_hit=hit)
