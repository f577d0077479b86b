"""Flow `ingest`: Wiki1M, NLI, SentEval STS and (dataset `transfer`) SentEval's transfer tasks → Parquet datasets
(cached by source hash)."""

from __future__ import annotations

from prefect import flow

from cse.config.stages import IngestConfig
from cse.flows.deployment_params import deployment_merged
from cse.storage.datasets import DatasetRef
from cse.tasks.ingest import ingest_dataset
from cse.tasks.transfer_data import ingest_transfer


@flow(name="ingest", log_prints=True)
def ingest(config: IngestConfig = IngestConfig()) -> dict[str, DatasetRef]:
    """Ingest the configured datasets into the data root (cache hits are reused).

    Args:
        config: the ingest configuration (in a deployment run, merged into the deployment's).

    Returns:
        Dataset name → its dataset reference.
    """
    (config,) = deployment_merged(config=config)
    refs: dict[str, DatasetRef] = {
        name: ingest_transfer(config) if name == "transfer" else ingest_dataset(name, config)
        for name in config.datasets
    }
    for name, ref in refs.items():
        print(
            f"{name:7s} {ref.rows:>9,d} rows  key={ref.key}  {'cache hit' if ref.cache_hit else 'written'}  {ref.path}"
        )
    return refs
