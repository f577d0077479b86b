"""Flow `corrupt`: offline replaced-token corruption of a tokens dataset, one task per shard.

Without `tokens_key` the flow first ingests and tokenises `dataset` (cache hits when done), so
`corrupt/default` runs on its own.

Where the shards run is read from the environment when the flow runs (storage/settings.py):
- default (`CSE_TASK_RUNNER` unset or `local`): the flow's own task runner, one shard at a time
  (one generator, one device); `corrupt.with_options(task_runner=...)` replaces it;
- `CSE_TASK_RUNNER=dask-local` (`CSE_DASK_WORKERS`, `CSE_DASK_THREADS_PER_WORKER`): a temporary
  Dask `LocalCluster` of worker processes, closed when the shards are done;
- `CSE_DASK_ADDRESS=tcp://host:8786`: the running Dask scheduler there (prefect-dask's `DaskTaskRunner`).
Planning and publishing always run in the flow's process; only the shard tasks go to Dask.

Shared filesystem assumption: every Dask worker reads the tokens and writes its shard files under
the flow's data root, at the same path (the plan carries it), and must load the generator (a local
folder at the same path, or an HF id in its cache); workers import this project and reach the
Prefect API like the flow does. Each worker process loads the generator once. A shard's bytes
depend only on the plan and its number, so the published dataset is byte for byte the same
whichever runner computed it.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from prefect import flow, unmapped
from prefect.futures import PrefectFuture
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from cse.config.stages import CorruptConfig, IngestConfig, TokenizeConfig
from cse.flows.deployment_params import deployment_merged
from cse.flows.tokenization import prepare_tokens
from cse.storage.corruption_stats import ShardResult
from cse.storage.datasets import DatasetRef
from cse.storage.settings import shard_task_runner
from cse.storage.sharded import building
from cse.tasks.corrupt import CorruptPlan, corrupt_shard, corruption_run, plan_corruption, publish_corruption
from cse.tasks.log import stage_logger
from cse.tasks.preflight import preflight_corrupt


def run_shards(plan: CorruptPlan) -> list[ShardResult]:
    """Corrupt every shard of `plan` with the configured task runner (the flow's own when local)."""
    if plan.cached:
        return []
    shards = list(range(plan.n_shards))
    stage_logger().info("corrupt-shard: %d shards", plan.n_shards)  # (the denominator of `cse run`'s count line)
    runner = shard_task_runner()
    if runner is None:
        return corrupt_shard.map(unmapped(plan), shards).result()
    with runner:
        return runner.map(corrupt_shard, {"plan": unmapped(plan), "shard": shards}).result()


# (Prefect's `flow` takes a TaskRunner[PrefectFuture]; its thread-pool runner's futures are a subclass of those, but the
# type parameter is invariant, so the runner is given as the type `flow` declares: what Prefect's own code does.)
SERIAL_RUNNER = cast(TaskRunner[PrefectFuture[Any]], ThreadPoolTaskRunner(max_workers=1))


@flow(name="corrupt", log_prints=True, task_runner=SERIAL_RUNNER)
def corrupt(
    tokens_key: str | None = None,
    config: CorruptConfig = CorruptConfig(),
    dataset: Literal["wiki1m", "nli"] = "wiki1m",
    ingest_config: IngestConfig = IngestConfig(),
    tokenize_config: TokenizeConfig = TokenizeConfig(),
    verify: bool = False,
) -> DatasetRef:
    """`verify`: a cache hit also checks the content hash of every file it reuses (the training flows set it).
    In a deployment run the configs given are merged into the deployment's (flows/deployment_params.py); the
    preflight (tasks/preflight.py) then checks the generator and device (and the tokenizer and source)."""
    config, ingest_config, tokenize_config = deployment_merged(
        config=config, ingest_config=ingest_config, tokenize_config=tokenize_config
    )
    preflight_corrupt(tokens_key, config, dataset, ingest_config, tokenize_config)
    if tokens_key is None:
        tokens_key = prepare_tokens(dataset, ingest_config, tokenize_config, verify=verify).key
    with corruption_run(tokens_key, config) as run_id:
        plan = plan_corruption(tokens_key, config, verify=verify)
        with building(plan):
            if not plan.cached:  # planned again under the lock: another flow may have published it meanwhile
                plan = plan_corruption(tokens_key, config, verify=verify, locked=True)
            shards = run_shards(plan)
            ref = publish_corruption(plan, shards, run_id)
    print(f"corruption {ref.rows:,d} rows  key={ref.key}  {'cache hit' if ref.cache_hit else 'written'}  {ref.path}")
    return ref
