"""The statistics of a corruption dataset: the counts of each shard (`ShardResult`, what a shard task returns) and
the manifest's `stats` made of them (`corruption_stats`): masked and replaced ratios over non-special tokens, overall
and per shard, the replacements that are special tokens (`special_replaced`: a healthy generator predicts words, one
with NaN logits `[PAD]`), and the throughput of the shards computed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from cse.storage.sharded import ShardDone


class ShardResult(ShardDone):
    """Counts of one shard. `tokens` = non-special tokens over all variants; `seconds` = 0 when reused."""

    sentences: int
    rows: int
    tokens: int
    masked: int
    replaced: int
    seconds: float
    # special token id -> how many replacements are that token (a healthy generator: none or nearly none)
    special_replacements: dict[int, int] = Field(default_factory=dict)


def shard_result(
    shard: int, table: pa.Table, special_ids: list[int], variants: int, computed: bool, seconds: float
) -> ShardResult:
    """The counts of shard `shard` from its corruption rows.

    Args:
        shard: the shard's number.
        table: its corruption rows (schema `cse.storage.schemas.CORRUPTION`).
        special_ids: the token ids that are never corrupted (not counted as tokens).
        variants: corruptions per input row.
        computed: whether the shard was computed now (False: its file was reused).
        seconds: how long computing it took.
    """
    flat = pc.list_flatten(table.column("input_ids")).to_numpy()
    corrupted = pc.list_flatten(table.column("corrupted_ids")).to_numpy()
    replaced = pc.list_flatten(table.column("labels")).to_numpy() == 1
    ids, counts = np.unique(corrupted[replaced & np.isin(corrupted, special_ids)], return_counts=True)
    return ShardResult(
        shard=shard,
        sentences=table.num_rows // variants,
        rows=table.num_rows,
        tokens=int(len(flat) - np.isin(flat, special_ids).sum()),
        masked=int(pc.sum(table.column("n_masked")).as_py() or 0),
        replaced=int(pc.sum(table.column("n_replaced")).as_py() or 0),
        computed=computed,
        seconds=seconds,
        special_replacements=dict(zip(ids.tolist(), counts.tolist())),
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def special_replacements(shards: list[ShardResult]) -> dict[int, int]:
    """Special token id -> how many replacements of all `shards` are that token, most frequent first."""
    total: dict[int, int] = {}
    for s in shards:
        for token, n in s.special_replacements.items():
            total[token] = total.get(token, 0) + n
    return dict(sorted(total.items(), key=lambda kv: (-kv[1], kv[0])))


def corruption_stats(shards: list[ShardResult]) -> dict[str, Any]:
    """Manifest stats: ratios over non-special tokens, overall and per shard; throughput of the computed
    shards in corrupted sentences (rows) per second of compute.

    Args:
        shards: every shard's counts, in shard order.
    """
    tokens, masked, replaced = (sum(getattr(s, f) for s in shards) for f in ("tokens", "masked", "replaced"))
    computed = [s for s in shards if s.computed]
    seconds = sum(s.seconds for s in computed)
    return {
        "sentences": sum(s.sentences for s in shards),
        "rows": sum(s.rows for s in shards),
        "masked_ratio": _ratio(masked, tokens),
        "replaced_ratio": _ratio(replaced, tokens),
        "replaced_of_masked": _ratio(replaced, masked),
        "special_replaced": sum(special_replacements(shards).values()),
        "shards": len(shards),
        "shards_computed": len(computed),
        "compute_seconds": seconds,
        "sentences_per_s": _ratio(sum(s.rows for s in computed), seconds),
        "per_shard": [
            {
                "shard": s.shard,
                "rows": s.rows,
                "masked_ratio": _ratio(s.masked, s.tokens),
                "replaced_ratio": _ratio(s.replaced, s.tokens),
                "computed": s.computed,
                "sentences_per_s": _ratio(s.rows, s.seconds),
            }
            for s in shards
        ],
    }
