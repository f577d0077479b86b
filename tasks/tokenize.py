"""Pre-tokenisation of training text into Parquet token ids, cached per (dataset, tokenizer, max length).

Part i of a tokens dataset holds source rows [i × batch_size, (i + 1) × batch_size). Locally (the
default) the parts are encoded in this process one after the other. When a Dask task runner is
configured (config/settings.py: `CSE_TASK_RUNNER=dask-local` or `CSE_DASK_ADDRESS`), each part is a
`tokenize-shard` task run on the Dask workers, writing `datasets/tokens/<key>.shards/shard-NNNNN.parquet`
(kept across a crash, reused by the rerun) before the shards are published as the parts: the same
files, byte for byte, as the local path writes. The workers must see the flow's data root at the same
path (a shared filesystem) and load the same tokenizer (its fingerprint is checked there).
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import mlflow
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task, unmapped
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel
from tqdm.auto import tqdm

from config.settings import get_settings, shard_task_runner
from config.stages import TokenizeConfig
from models.loading import load_tokenizer, tokenizer_fingerprint, vocab_fingerprint
from storage import schemas
from storage.atomic import write_parquet
from storage.catalog import refresh_catalog
from storage.datasets import DatasetRef, publish_files, read_dataset, write_dataset
from storage.hashing import stable_hash
from storage.layout import DataRoot
from storage.manifest import Manifest
from tasks.ingest import _logger
from tasks.tracking import log_quarantine, stage_run

SCHEMA_VERSION = 1


def tokens_key(input_hash: str, tok_fingerprint: str, max_length: int) -> str:
    return stable_hash({"stage": "tokenize", "input": input_hash, "tokenizer": tok_fingerprint,
                        "max_length": max_length, "v": SCHEMA_VERSION})


def _encode(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    # SimCSE replaces empty/None cells by a single space before tokenisation (methods.md §1.1).
    texts = [t if t and t.strip() else " " for t in texts]
    return tokenizer(texts, truncation=True, max_length=max_length, add_special_tokens=True)["input_ids"]


def _token_part(chunk: pa.Table, columns: tuple[str, ...], tokenizer, cfg: TokenizeConfig) -> pa.Table:
    """One long-form part: rows (id, column) interleaved per source row, in source order."""
    ids = chunk.column("id").to_numpy()
    encoded = {c: _encode(tokenizer, chunk.column(c).to_pylist(), cfg.max_length) for c in columns}
    n, k = len(ids), len(columns)
    input_ids = [encoded[c][i] for i in range(n) for c in columns]
    return pa.table(
        {
            "id": np.repeat(ids, k),
            "column": [c for _ in range(n) for c in columns],
            "input_ids": pa.array(input_ids, pa.list_(pa.int32())),
            "length": pa.array([len(x) for x in input_ids], pa.int16()),
        },
        schema=schemas.TOKENS,
    )


def _token_parts(table: pa.Table, columns: tuple[str, ...], tokenizer, cfg: TokenizeConfig) -> Iterator[pa.Table]:
    """The parts of `table`, `cfg.batch_size` source rows each."""
    bar = tqdm(total=table.num_rows, unit="rows", desc="tokenize")
    for start in range(0, table.num_rows, cfg.batch_size):
        chunk = table.slice(start, cfg.batch_size)
        yield _token_part(chunk, columns, tokenizer, cfg)
        bar.update(chunk.num_rows)
    bar.close()


def _length_stats(sentences: int, truncated: int, length_sum: int, max_length_seen: int) -> dict:
    return {
        "sentences": sentences,
        "truncated": truncated,
        "mean_length": length_sum / sentences if sentences else 0.0,
        "max_length_seen": max_length_seen,
    }


class TokenizePlan(BaseModel):
    """What a `tokenize-shard` task needs (small, serialisable): shard i = part i of the tokens dataset."""

    key: str
    data_root: str
    source: DatasetRef
    config: TokenizeConfig
    tokenizer_fingerprint: str
    columns: list[str]
    part_rows: list[int]

    @property
    def n_shards(self) -> int:
        return max(1, math.ceil(self.source.rows / self.config.batch_size))

    def shard_range(self, shard: int) -> tuple[int, int]:
        if not 0 <= shard < self.n_shards:
            raise IndexError(f"shard {shard} out of range: {self.n_shards} shards")
        start = shard * self.config.batch_size
        return start, min(start + self.config.batch_size, self.source.rows)

    def root(self) -> DataRoot:
        return DataRoot.visible(self.data_root, f"tokens {self.key}")


class TokenShardResult(BaseModel):
    shard: int
    sentences: int
    truncated: int
    length_sum: int
    max_length_seen: int
    computed: bool


def token_shard_path(root: DataRoot, key: str, shard: int) -> Path:
    return root.shards_dir("tokens", key) / f"shard-{shard:05d}.parquet"


_TOKENIZERS = threading.local()  # per thread: a fast tokenizer must not be used by two threads at once


def _shard_tokenizer(plan: TokenizePlan):
    cache = _TOKENIZERS.__dict__
    if plan.config.tokenizer not in cache:
        cache.clear()
        cache[plan.config.tokenizer] = load_tokenizer(plan.config.tokenizer)
    tokenizer = cache[plan.config.tokenizer]
    if (found := tokenizer_fingerprint(tokenizer)) != plan.tokenizer_fingerprint:
        raise RuntimeError(f"tokenizer {plan.config.tokenizer!r} loads as {found} here, planned as "
                           f"{plan.tokenizer_fingerprint}: the workers must load the same tokenizer as the flow")
    return tokenizer


def _read_source_rows(root: DataRoot, plan: TokenizePlan, start: int, stop: int) -> pa.Table:
    """Rows [start, stop) of the ingested source, reading only the parts that overlap them."""
    m = root.require(plan.source.kind, plan.source.key)
    if m.content_hash != plan.source.content_hash:
        raise RuntimeError(f"{plan.source.kind} dataset {plan.source.key} changed since tokenisation was planned")
    pieces, offset = [], 0
    for path, n in zip(m.paths(root.dataset_dir(plan.source.kind, plan.source.key)), plan.part_rows, strict=True):
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            pieces.append(pq.read_table(path, columns=["id", *plan.columns]).slice(lo - offset, hi - lo))
        offset += n
    return pa.concat_tables(pieces)


@task(name="tokenize-shard", cache_policy=NO_CACHE)
def tokenize_shard(plan: TokenizePlan, shard: int) -> TokenShardResult:
    """Encode part `shard` into its work file under `plan.data_root` (reused when already there)."""
    root = plan.root()
    path = token_shard_path(root, plan.key, shard)
    computed = not path.is_file()
    if computed:
        rows = _read_source_rows(root, plan, *plan.shard_range(shard))
        table = _token_part(rows, tuple(plan.columns), _shard_tokenizer(plan), plan.config)
        write_parquet(table, path, schemas.TOKENS)
    else:
        table = pq.read_table(path)
    lengths = table.column("length").to_numpy().astype(np.int64)
    return TokenShardResult(shard=shard, sentences=int(lengths.size),
                            truncated=int((lengths >= plan.config.max_length).sum()), length_sum=int(lengths.sum()),
                            max_length_seen=int(lengths.max()) if lengths.size else 0, computed=computed)


def _tokenize_on_runner(runner, root: DataRoot, plan: TokenizePlan, params: dict) -> Manifest:
    """Encode every part as a `tokenize-shard` task on `runner`, then publish the shard files as the parts."""
    with runner:
        shards = runner.map(tokenize_shard, {"plan": unmapped(plan), "shard": list(range(plan.n_shards))}).result()
    shards = sorted(shards, key=lambda r: r.shard)
    stats = _length_stats(sum(r.sentences for r in shards), sum(r.truncated for r in shards),
                          sum(r.length_sum for r in shards), max((r.max_length_seen for r in shards), default=0))
    files = [token_shard_path(root, plan.key, r.shard) for r in shards]
    manifest = publish_files(root, "tokens", plan.key, files, params=params,
                             source={"kind": plan.source.kind, "key": plan.source.key},
                             inputs={plan.source.kind: plan.source.content_hash}, stats=stats)
    shutil.rmtree(root.shards_dir("tokens", plan.key), ignore_errors=True)
    return manifest


@task(name="tokenize-dataset")
def tokenize_dataset(source: DatasetRef, config: TokenizeConfig, verify: bool = False) -> DatasetRef:
    """Tokenise every text column of an ingested dataset (`wiki1m` or `nli`). A cache hit is verified first (content
    hashes too with `verify` or `config.verify`); a damaged one is quarantined and rebuilt."""
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
        with root.building("tokens", key):  # concurrent flows tokenise a dataset once
            manifest, quarantined = root.reuse("tokens", key, full=verify or config.verify)
            if quarantined is not None:
                log_quarantine(quarantined, log)
            hit = manifest is not None
            if not hit:
                columns = schemas.TEXT_COLUMNS[source.kind]
                tokens_params = {
                    "tokenizer": config.tokenizer, "tokenizer_fingerprint": tfp,
                    "vocab_fingerprint": vocab_fingerprint(tokenizer), "max_length": config.max_length,
                    "source_kind": source.kind, "columns": list(columns), "schema_version": SCHEMA_VERSION,
                }
                runner = shard_task_runner() if source.rows else None
                if runner is None:  # local: every part in this process
                    table = read_dataset(root, source.kind, source.key)
                    parts = list(_token_parts(table, columns, tokenizer, config))
                    lengths = np.concatenate([p.column("length").to_numpy() for p in parts]) if parts else np.zeros(0)
                    stats = _length_stats(int(lengths.size), int((lengths >= config.max_length).sum()),
                                          int(lengths.astype(np.int64).sum()), int(lengths.max()) if lengths.size else 0)
                    manifest = write_dataset(
                        root, "tokens", key, parts, schemas.TOKENS, params=tokens_params,
                        source={"kind": source.kind, "key": source.key}, inputs={source.kind: source.content_hash},
                        stats=stats,
                    )
                else:  # Dask: one tokenize-shard task per part
                    source_manifest = root.require(source.kind, source.key)
                    plan = TokenizePlan(
                        key=key, data_root=str(root.root), source=source, config=config, tokenizer_fingerprint=tfp,
                        columns=list(columns),
                        part_rows=[pq.ParquetFile(p).metadata.num_rows
                                   for p in source_manifest.paths(root.dataset_dir(source.kind, source.key))],
                    )
                    manifest = _tokenize_on_runner(runner, root, plan, tokens_params)
                refresh_catalog(root)
        seconds = time.perf_counter() - t0
        mlflow.log_metrics({"rows": manifest.rows, "cache_hit": float(hit), "seconds": seconds,
                            "sentences_per_s": manifest.rows / max(seconds, 1e-9),
                            **{k: float(v) for k, v in manifest.stats.items()}})
        mlflow.set_tag("content_hash", manifest.content_hash)
        log.info("tokens %s: %d sentences (%s) in %.1fs", key, manifest.rows, "cache hit" if hit else "written", seconds)
    return DatasetRef.of(root, manifest, cache_hit=hit)
