"""Flow `tokenize`: ingest one training corpus (cache hit when done) and pre-tokenise it.

Tokenisation runs in this process by default. With a Dask task runner configured (storage/settings.py:
`CSE_TASK_RUNNER=dask-local`, or `CSE_DASK_ADDRESS=tcp://host:8786`) each part of `batch_size` source
rows is a `tokenize-shard` task on the Dask workers, and the published dataset is byte for byte the
local one. Shared filesystem assumption: the workers read the ingested source and write their shard
files under the flow's data root, at the same path, and load the same tokenizer.
"""

from __future__ import annotations

from typing import Literal

from prefect import flow

from cse.config.stages import IngestConfig, TokenizeConfig
from cse.flows.deployment_params import deployment_merged
from cse.storage.datasets import DatasetRef
from cse.tasks.ingest import ingest_dataset
from cse.tasks.preflight import preflight_tokenize
from cse.tasks.tokenize import tokenize_dataset


def prepare_tokens(
    dataset: Literal["wiki1m", "nli"],
    ingest_config: IngestConfig,
    tokenize_config: TokenizeConfig,
    verify: bool = False,
) -> DatasetRef:
    """Ingest → tokenise, both cached: the building block of every training flow. `verify`: cache hits also check
    content hashes (training always asks for it)."""
    source = ingest_dataset(dataset, ingest_config, verify=verify)
    return tokenize_dataset(source, tokenize_config, verify=verify)


@flow(name="tokenize", log_prints=True)
def tokenize(
    dataset: Literal["wiki1m", "nli"] = "wiki1m",
    ingest_config: IngestConfig = IngestConfig(),
    config: TokenizeConfig = TokenizeConfig(),
) -> DatasetRef:
    """Tokenize an ingested training dataset into token shards.

    Args:
        dataset: `wiki1m` or `nli`.
        ingest_config: the ingest configuration of the source dataset.
        config: the tokenization configuration.

    Returns:
        The reference of the token dataset.

    In a deployment run the configs given are merged into the deployment's (flows/deployment_params.py).
    """
    ingest_config, config = deployment_merged(ingest_config=ingest_config, config=config)
    preflight_tokenize(dataset, ingest_config, config)  # tokenizer and source, before any work (tasks/preflight.py)
    ref = prepare_tokens(dataset, ingest_config, config)
    print(f"tokens {ref.rows:,d} sentences  key={ref.key}  {'cache hit' if ref.cache_hit else 'written'}  {ref.path}")
    return ref
