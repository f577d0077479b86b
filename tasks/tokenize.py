"""Pre-tokenisation of training text into Parquet token ids, cached per (dataset, tokenizer, max length).

Part i of a tokens dataset holds source rows [i × batch_size, (i + 1) × batch_size). Locally (the
default) the parts are encoded in this process one after the other. When a Dask task runner is
configured (storage/settings.py: `CSE_TASK_RUNNER=dask-local` or `CSE_DASK_ADDRESS`), each part is a
`tokenize-shard` task run on the Dask workers, writing `datasets/tokens/<key>.shards/shard-NNNNN.parquet`
(kept across a crash, reused by the rerun) before the shards are published as the parts: the same
files, byte for byte, as the local path writes (storage/sharded.py: the shard files, reading a row range of the
source, publishing). The workers must see the flow's data root at the same
path (a shared filesystem) and load the same tokenizer (its fingerprint is checked there).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
from prefect import task, unmapped
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from cse.config.stages import TokenizeConfig
from cse.models.loading import load_tokenizer, tokenizer_fingerprint, vocab_fingerprint
from cse.storage import schemas
from cse.storage.catalog import refresh_catalog
from cse.storage.corruption import token_lists
from cse.storage.datasets import DatasetRef, read_dataset, write_dataset
from cse.storage.keys import SCHEMA_VERSIONS, tokens_key
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest
from cse.storage.settings import get_settings, shard_task_runner
from cse.storage.sharded import ShardDone, ShardedPlan, build_shard, part_rows, publish_shards
from cse.tasks.log import stage_logger
from cse.tracking.lineage import CONTEXT_SOURCE, log_dataset_inputs
from cse.tracking.stage_runs import log_dataset_metrics, log_quarantine, stage_run, tag_dataset_run

SCHEMA_VERSION = SCHEMA_VERSIONS["tokens"]


def _encode(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    # SimCSE replaces empty/None cells by a single space before tokenisation (princeton-nlp/SimCSE train.py).
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


def non_content_ids(tokenizer) -> list[int]:
    """The token ids that are no content: the special tokens (`[CLS]`, `[SEP]`, `[PAD]`, `[MASK]`, also where the
    text spells them, `"[MASK]"`) and the unknown token: `[UNK]` stands for characters the vocabulary lacks (a
    combining enclosing mark, an emoji), not for a word."""
    ids = {*tokenizer.all_special_ids, tokenizer.unk_token_id}
    ids.discard(None)
    return sorted(ids)


def _length_counts(part: pa.Table, max_length: int, non_content: list[int], columns: int) -> dict[str, int]:
    """The length counts of one tokens part (or shard): sentences, truncated ones, sum and max of the lengths, and the
    sentences (and source rows, of `columns` sentences each) that hold no token but the `non_content` ones (special
    and unknown: `[CLS] [SEP]`, `[CLS] [UNK] [SEP]`)."""
    lengths = part.column("length").to_numpy().astype(np.int64)
    flat, offsets = token_lists(part.column("input_ids"))
    content = np.concatenate([[0], np.cumsum(~np.isin(flat, non_content))])
    empty = content[offsets[1:]] == content[offsets[:-1]]
    return {
        "sentences": int(lengths.size),
        "empty": int(empty.sum()),
        "empty_rows": int(empty.reshape(-1, columns).any(axis=1).sum()) if lengths.size else 0,
        "truncated": int((lengths >= max_length).sum()),
        "length_sum": int(lengths.sum()),
        "max_length_seen": int(lengths.max()) if lengths.size else 0,
    }


def _length_stats(counts: Iterable[Mapping[str, int]]) -> dict:
    """Manifest stats of a tokens dataset from the `_length_counts` of its parts."""
    counts = list(counts)
    sentences, length_sum = sum(c["sentences"] for c in counts), sum(c["length_sum"] for c in counts)
    return {
        "sentences": sentences,
        "empty": sum(c["empty"] for c in counts),
        "empty_rows": sum(c["empty_rows"] for c in counts),
        "truncated": sum(c["truncated"] for c in counts),
        "mean_length": length_sum / sentences if sentences else 0.0,
        "max_length_seen": max((c["max_length_seen"] for c in counts), default=0),
    }


class TokenizePlan(ShardedPlan):
    """What a `tokenize-shard` task needs (small, serialisable): shard i = part i of the tokens dataset."""

    kind: ClassVar[str] = "tokens"
    output_schema: ClassVar[pa.Schema] = schemas.TOKENS

    config: TokenizeConfig
    tokenizer_fingerprint: str
    columns: list[str]

    @property
    def shard_size(self) -> int:
        return self.config.batch_size


class TokenShardResult(ShardDone):
    """Statistics of one tokenized shard: sentences, truncated sentences, total and maximum length."""

    sentences: int
    empty: int
    empty_rows: int
    truncated: int
    length_sum: int
    max_length_seen: int


_TOKENIZERS = threading.local()  # per thread: a fast tokenizer must not be used by two threads at once


def _shard_tokenizer(plan: TokenizePlan):
    cache = _TOKENIZERS.__dict__
    if plan.config.tokenizer not in cache:
        cache.clear()
        cache[plan.config.tokenizer] = load_tokenizer(plan.config.tokenizer)
    tokenizer = cache[plan.config.tokenizer]
    if (found := tokenizer_fingerprint(tokenizer)) != plan.tokenizer_fingerprint:
        raise RuntimeError(
            f"tokenizer {plan.config.tokenizer!r} loads as {found} here, planned as "
            f"{plan.tokenizer_fingerprint}: the workers must load the same tokenizer as the flow"
        )
    return tokenizer


@task(name="tokenize-shard", cache_policy=NO_CACHE)
def tokenize_shard(plan: TokenizePlan, shard: int) -> TokenShardResult:
    """Encode part `shard` into its work file under `plan.data_root` (reused when already there)."""
    table, computed = build_shard(
        plan,
        shard,
        ["id", *plan.columns],
        lambda rows: _token_part(rows, tuple(plan.columns), _shard_tokenizer(plan), plan.config),
    )
    counts = _length_counts(table, plan.config.max_length, non_content_ids(_shard_tokenizer(plan)), len(plan.columns))
    return TokenShardResult(shard=shard, computed=computed, **counts)


def _tokenize_on_runner(runner, root: DataRoot, plan: TokenizePlan, params: dict) -> Manifest:
    """Encode every part as a `tokenize-shard` task on `runner`, then publish the shard files as the parts."""
    stage_logger().info("tokenize-shard: %d shards", plan.n_shards)  # (the denominator of `cse run`'s count line)
    with runner:
        shards = runner.map(tokenize_shard, {"plan": unmapped(plan), "shard": list(range(plan.n_shards))}).result()

    def stats(done):  # refused before anything is published
        return _usable(_length_stats(r.model_dump() for r in done), plan.source, plan.config)

    return publish_shards(root, plan, shards, params=params, stats=stats)


class EmptyTokensError(ValueError):
    """Every source row tokenises to nothing but special and unknown tokens (`[CLS] [SEP]`, `[CLS] [UNK] [SEP]`):
    nothing to train on."""


def _usable(stats: dict, source: DatasetRef, config: TokenizeConfig) -> dict:
    """`stats` when some source row has content tokens in every sentence; `EmptyTokensError` naming the dataset, the
    tokenizer and the counts otherwise (a source whose lines the tokenizer drops whole, e.g. combining marks only)."""
    rows = stats["sentences"] // max(len(schemas.TEXT_COLUMNS[source.kind]), 1)
    if rows and stats["empty_rows"] >= rows:
        raise EmptyTokensError(
            f"{source.kind} dataset {source.key}: all {rows:,d} rows tokenise to nothing but special tokens with "
            f"{config.tokenizer!r} ({stats['empty']:,d} of {stats['sentences']:,d} sentences empty after "
            "tokenisation: special or unknown tokens only): nothing to train on. Check the source's text"
        )
    return stats


@task(name="tokenize-dataset")
def tokenize_dataset(source: DatasetRef, config: TokenizeConfig, verify: bool = False) -> DatasetRef:
    """Tokenise every text column of an ingested dataset (`wiki1m` or `nli`). A cache hit is verified first (content
    hashes too with `verify` or `config.verify`); a damaged one is quarantined and rebuilt."""
    log = stage_logger()
    if source.kind not in schemas.TEXT_COLUMNS:
        raise ValueError(f"cannot tokenise dataset kind {source.kind!r}; expected one of {list(schemas.TEXT_COLUMNS)}")
    root = DataRoot(get_settings().data_root)
    t0 = time.perf_counter()
    params = {"source_kind": source.kind, "source_key": source.key, **config.model_dump()}
    with stage_run("data", f"tokenize-{source.kind}", params=params) as run:
        log_dataset_inputs(run.info.run_id, [(source, CONTEXT_SOURCE)])
        tokenizer = load_tokenizer(config.tokenizer)
        tfp = tokenizer_fingerprint(tokenizer)
        key = tokens_key(source.content_hash, tfp, config.max_length)
        tag_dataset_run({"key": key, "input_hash": source.content_hash, "tokenizer_fingerprint": tfp})
        with root.building("tokens", key):  # concurrent flows tokenise a dataset once
            manifest, quarantined = root.reuse("tokens", key, full=verify or config.verify)
            if quarantined is not None:
                log_quarantine(quarantined, log)
            hit = manifest is not None
            if manifest is None:
                manifest = _tokenize(root, source, config, tokenizer, tfp, key)
                refresh_catalog(root)
        if empty_rows := manifest.stats.get("empty_rows"):
            log.warning(
                "tokens %s: %d of %d source rows hold a sentence that tokenises to nothing but special or unknown "
                "tokens (kept)",
                key,
                empty_rows,
                manifest.stats["sentences"] // max(len(schemas.TEXT_COLUMNS[source.kind]), 1),
            )
        seconds = time.perf_counter() - t0
        log_dataset_metrics(
            {
                "rows": manifest.rows,
                "cache_hit": float(hit),
                "seconds": seconds,
                "sentences_per_s": manifest.rows / max(seconds, 1e-9),
                **{k: float(v) for k, v in manifest.stats.items()},
            }
        )
        tag_dataset_run({"content_hash": manifest.content_hash})
        log.info(
            "tokens %s: %d sentences (%s) in %.1fs", key, manifest.rows, "cache hit" if hit else "written", seconds
        )
    return DatasetRef.of(root, manifest, cache_hit=hit)


def _tokenize(
    root: DataRoot, source: DatasetRef, config: TokenizeConfig, tokenizer: Any, tfp: str, key: str
) -> Manifest:
    """Write tokens dataset `key` of `source`: every part in this process, or one tokenize-shard task per part on
    the configured Dask runner (`tfp`: the tokenizer's fingerprint)."""
    columns = schemas.TEXT_COLUMNS[source.kind]
    tokens_params = {
        "tokenizer": config.tokenizer,
        "tokenizer_fingerprint": tfp,
        "vocab_fingerprint": vocab_fingerprint(tokenizer),
        "max_length": config.max_length,
        "source_kind": source.kind,
        "columns": list(columns),
        "schema_version": SCHEMA_VERSION,
    }
    runner = shard_task_runner() if source.rows else None
    if runner is not None:  # Dask: one tokenize-shard task per part
        plan = TokenizePlan(
            key=key,
            data_root=str(root.root),
            source=source,
            config=config,
            tokenizer_fingerprint=tfp,
            columns=list(columns),
            part_rows=part_rows(root, source.kind, source.key),
        )
        return _tokenize_on_runner(runner, root, plan, tokens_params)
    table = read_dataset(root, source.kind, source.key)  # local: every part in this process
    parts = list(_token_parts(table, columns, tokenizer, config))
    non_content = non_content_ids(tokenizer)
    counts = (_length_counts(p, config.max_length, non_content, len(columns)) for p in parts)
    return write_dataset(
        root,
        "tokens",
        key,
        parts,
        schemas.TOKENS,
        params=tokens_params,
        source={"kind": source.kind, "key": source.key},
        inputs={source.kind: source.content_hash},
        stats=_usable(_length_stats(counts), source, config),
    )
