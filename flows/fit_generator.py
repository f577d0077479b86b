"""Flow `fit-generator`: ingest and tokenise a corpus (cache hits when done), then fit a masked-LM generator on a
frozen encoder (tasks/fit_generator.py) and publish it as dataset `generator/<key>`.

Pass the result to the corruption stage as `corrupt.generator: "generator:<key>"` (or its folder).
"""

from __future__ import annotations

from typing import Literal

from prefect import flow

from cse.config.stages import GeneratorConfig, IngestConfig, TokenizeConfig
from cse.flows.deployment_params import deployment_merged
from cse.flows.tokenization import prepare_tokens
from cse.storage.datasets import DatasetRef
from cse.tasks.fit_generator import fit_generator as fit_generator_task
from cse.tasks.preflight import preflight_fit_generator


@flow(name="fit-generator", log_prints=True)
def fit_generator(
    tokens_key: str | None = None,
    config: GeneratorConfig = GeneratorConfig(),
    dataset: Literal["wiki1m", "nli"] = "wiki1m",
    ingest_config: IngestConfig = IngestConfig(),
    tokenize_config: TokenizeConfig | None = None,
    verify: bool = False,
) -> DatasetRef:
    """`tokens_key`: a tokens dataset to fit on; without it `dataset` is ingested and tokenised with
    `tokenize_config` (default: the backbone's tokenizer, max length 32). `verify`: cache hits also check content
    hashes. In a deployment run the configs given are merged into the deployment's (flows/deployment_params.py)."""
    config, ingest_config, tokenize_config = deployment_merged(
        config=config, ingest_config=ingest_config, tokenize_config=tokenize_config
    )
    preflight_fit_generator(tokens_key, config, dataset, ingest_config, tokenize_config)  # (tasks/preflight.py)
    if tokens_key is None:
        tokenize_config = tokenize_config or TokenizeConfig(tokenizer=config.backbone)
        tokens_key = prepare_tokens(dataset, ingest_config, tokenize_config, verify=verify).key
    ref = fit_generator_task(tokens_key, config, verify=verify)
    print(
        f"generator {ref.key}  {'cache hit' if ref.cache_hit else 'written'}  {ref.path}\n"
        f'use it with corrupt.generator: "generator:{ref.key}"'
    )
    return ref
