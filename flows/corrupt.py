"""Flow `corrupt`: offline replaced-token corruption of a tokens dataset, one task per shard.

Without `tokens_key` the flow first ingests and tokenises `dataset` (cache hits when done), so
`corrupt/default` runs on its own. Shards run one at a time by default (one generator, one
device); another task runner (Dask, Ray) spreads them: `corrupt.with_options(task_runner=...)`.
"""

from __future__ import annotations

from typing import Literal

from prefect import flow, unmapped
from prefect.task_runners import ThreadPoolTaskRunner

from config.stages import CorruptConfig, IngestConfig, TokenizeConfig
from flows.tokenize import prepare_tokens
from storage.datasets import DatasetRef
from tasks.corrupt import corrupt_shard, corruption_run, plan_corruption, publish_corruption


@flow(name="corrupt", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=1))
def corrupt(
    tokens_key: str | None = None,
    config: CorruptConfig = CorruptConfig(),
    dataset: Literal["wiki1m", "nli"] = "wiki1m",
    ingest_config: IngestConfig = IngestConfig(),
    tokenize_config: TokenizeConfig = TokenizeConfig(),
) -> DatasetRef:
    if tokens_key is None:
        tokens_key = prepare_tokens(dataset, ingest_config, tokenize_config).key
    with corruption_run(tokens_key, config) as run_id:
        plan = plan_corruption(tokens_key, config)
        shards = [] if plan.cached else corrupt_shard.map(unmapped(plan), list(range(plan.n_shards))).result()
        ref = publish_corruption(plan, shards, run_id)
    print(f"corruption {ref.rows:,d} rows  key={ref.key}  {'cache hit' if ref.cache_hit else 'written'}  {ref.path}")
    return ref
