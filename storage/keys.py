"""Every dataset key and run key of the pipeline, derived in one place.

A key addresses what a stage produced: `datasets/<kind>/<key>` for a dataset, `runs/<method>/<key>` for a training
job. It is a `stable_hash` of the stage's name, the content hashes of its inputs, every setting that changes its
output and the stage's schema version (`SCHEMA_VERSIONS`), so the same inputs and settings find the dataset (or the
job) already built, and anything that changes the output gives a new key.

Keys are a compatibility contract: a key that changes turns every dataset and finished job built under the old key
into a cache miss (rebuilt, retrained). `tests/storage/test_keys.py` pins keys computed before this module existed.

The rule for adding a parameter to a stage:

- A parameter added later enters the key **only when it differs from its default**, the default being what the
  stage did before the parameter existed. Old keys then stay valid (nothing built before had the parameter, and it
  was built as the default does), while a non-default value gives a new key. `corruption_key`'s `positions` is the
  first such parameter: a corruption with `positions="masked"` has the key it had before `positions` existed.
- Write the parameter with its default into the stage's `ADDED_LATER` table below (for the generator, whose key
  holds the whole `GeneratorConfig`, a new field of that config; for training jobs, a field of the job, its model or
  its corruption, listed in `cse.config.training.KEY_NEUTRAL_DEFAULTS`); `without_defaults` drops it at that default.
- A parameter that changes the output at every value (a new output format) bumps the stage's schema version
  instead: every key of the stage changes, deliberately.
- A parameter that never changes the output (a device, a batch size of a deterministic computation, the number of
  processes of a training job) stays out of the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cse.storage.hashing import stable_hash

# The schema version of each stage's output: part of its keys and of its manifests' params (`schema_version`).
SCHEMA_VERSIONS: dict[str, int] = {
    "ingest": 1,
    "transfer": 1,
    "tokens": 1,
    "generator": 1,
    "corruption": 1,
    "backbone_evaluation": 1,
}

# Parameters added after keys of the stage existed → their default (what the stage did before them).
CORRUPTION_ADDED_LATER: dict[str, Any] = {"positions": "masked", "hard": False}
GENERATOR_ADDED_LATER: dict[str, Any] = {"backbone_lr": None}  # GeneratorConfig fields added after its first keys
RUN_ADDED_LATER: dict[str, Any] = {"nli_tokens": None}  # the NLI tokens dataset of a DiffAug job

# The settings of cse.config.stages.CorruptConfig that enter a corruption key (`corruption_key`'s keyword arguments):
# `corruption_key(..., **config.model_dump(include=CORRUPTION_SETTINGS))`.
CORRUPTION_SETTINGS = frozenset(
    {"mask_ratio", "mode", "variants", "seed", "shard_size", "generator_dropout", "positions", "hard"}
)


def without_defaults(params: Mapping[str, Any], added_later: Mapping[str, Any]) -> dict[str, Any]:
    """`params` without the parameters of `added_later` that are at their default (the compatibility rule above).

    A section (a mapping in both) is handled the same way inside, and left out when nothing of it is left: a training
    job's table (`cse.config.training.KEY_NEUTRAL_DEFAULTS`) lists its model and corruption fields under their
    sections, and a section added whole (`grad_cache`) at its defaults.

    Args:
        params: what enters a key, parameter name → value.
        added_later: the parameters added after keys existed → their defaults.
    """
    out = {}
    for k, v in params.items():
        if k in added_later and isinstance(added_later[k], Mapping) and isinstance(v, Mapping):
            v = without_defaults(v, added_later[k])
            if not v:
                continue
        elif k in added_later and v == added_later[k]:
            continue
        out[k] = v
    return out


def ingest_key(dataset: str, source_hash: str) -> str:
    """The key of an ingested dataset (`datasets/<dataset>/<key>`): its name and the content hash of its source.

    Args:
        dataset: the dataset's name (`wiki1m`, `nli`, `sts`, ...).
        source_hash: the content hash of the raw source read (file, folder, URL or HF datasets).
    """
    return stable_hash({"stage": "ingest", "dataset": dataset, "source": source_hash, "v": SCHEMA_VERSIONS["ingest"]})


def transfer_key(source_hash: str) -> str:
    """The key of the `transfer` dataset (the SentEval transfer tasks): the content hash of their files.

    Args:
        source_hash: the combined sha256 of the SentEval files read.
    """
    return stable_hash(
        {"stage": "ingest", "dataset": "transfer", "source": source_hash, "v": SCHEMA_VERSIONS["transfer"]}
    )


def tokens_key(input_hash: str, tokenizer_fingerprint: str, max_length: int) -> str:
    """The key of a tokens dataset: the text's content hash, the tokenizer and the truncation length.

    Args:
        input_hash: the content hash of the dataset tokenised.
        tokenizer_fingerprint: `cse.models.loading.tokenizer_fingerprint` of the tokenizer.
        max_length: the truncation length.
    """
    return stable_hash(
        {
            "stage": "tokenize",
            "input": input_hash,
            "tokenizer": tokenizer_fingerprint,
            "max_length": max_length,
            "v": SCHEMA_VERSIONS["tokens"],
        }
    )


def generator_key(
    tokens_hash: str, tokenizer_fingerprint: str | None, backbone: Mapping[str, str], config: Mapping[str, Any]
) -> str:
    """The key of a fitted generator (the fit-generator stage): the tokens it was fitted on, the frozen backbone and
    the whole config (its fields added later only off their defaults, `GENERATOR_ADDED_LATER`).

    Args:
        tokens_hash: the content hash of the tokens dataset.
        tokenizer_fingerprint: the tokenizer fingerprint the tokens dataset records (None when it records none).
        backbone: the backbone's identity (name or folder, hash of its config.json and of a folder's files).
        config: the stage's config as a dict, without the fields that change nothing (`device`).
    """
    return stable_hash(
        {
            "stage": "generator",
            "input": tokens_hash,
            "tokenizer": tokenizer_fingerprint,
            "backbone": dict(backbone),
            "config": without_defaults(config, GENERATOR_ADDED_LATER),
            "v": SCHEMA_VERSIONS["generator"],
        }
    )


def corruption_key(
    tokens_hash: str,
    tokenizer_fingerprint: str | None,
    generator: Mapping[str, str],
    precision: str,
    *,
    mask_ratio: float,
    mode: str,
    variants: int,
    seed: int,
    shard_size: int,
    generator_dropout: bool,
    positions: str = "masked",
    hard: bool = False,
) -> str:
    """The key of a corruption dataset: the tokens' content, the generator's identity, the precision and every setting
    that changes the corrupted rows; `positions` and `hard` (added later) only when not `"masked"` and not False.

    Args:
        tokens_hash: the content hash of the tokens dataset corrupted.
        tokenizer_fingerprint: the tokenizer fingerprint the tokens dataset records (None when it records none).
        generator: the generator's identity (name or folder + config.json hash + a folder's files' hash; a generator
            dataset's key and content hash; `{"name": "unigram"}` for mode unigram).
        precision: `fp32` or `bf16`.
        mask_ratio, mode, variants, seed, shard_size, generator_dropout, positions, hard: the corruption settings
            (`cse.config.stages.CorruptConfig`, resolved: `variants` and `seed` explicit).
    """
    return stable_hash(
        {
            "stage": "corruption",
            "input": tokens_hash,
            "generator": dict(generator),
            "tokenizer": tokenizer_fingerprint,
            "mask_ratio": mask_ratio,
            "mode": mode,
            "variants": variants,
            "seed": seed,
            "shard_size": shard_size,
            "generator_dropout": generator_dropout,
            "precision": precision,
            "v": SCHEMA_VERSIONS["corruption"],
            **without_defaults({"positions": positions, "hard": hard}, CORRUPTION_ADDED_LATER),
        }
    )


BACKBONE_EVALUATION_PREFIX = "backbone-"  # the evaluation id (= `evaluations` dataset key) of a backbone's own score


def backbone_evaluation_key(
    backbone: Mapping[str, str], pooler: str, template: str | None, sts_hash: str, precision: str
) -> str:
    """The evaluation id of a backbone's own STS test score before training (`datasets/evaluations/<key>`, cached per
    backbone, pooler and STS data): `backbone-<hash>` of the backbone's identity, the pooler and prompt template, the
    STS dataset's content hash and the evaluation precision.

    Args:
        backbone: the backbone's identity (name or folder, hash of its config.json and of a folder's files).
        pooler: the pooler read from the backbone's output (`cls_before_pooler`, `avg`, `mask`, ...).
        template: the prompt template each sentence is wrapped in, None for none.
        sts_hash: the content hash of the STS dataset scored.
        precision: the evaluation precision (`fp32`, `bf16`).
    """
    return BACKBONE_EVALUATION_PREFIX + stable_hash(
        {
            "stage": "backbone_evaluation",
            "backbone": dict(backbone),
            "pooler": pooler,
            "template": template,
            "sts": sts_hash,
            "precision": precision,
            "v": SCHEMA_VERSIONS["backbone_evaluation"],
        }
    )


def run_key(
    config: Mapping[str, Any], tokens_hash: str, corruption_hash: str | None, nli_tokens_hash: str | None = None
) -> str:
    """A training job's identity (`runs/<method>/<key>`): its resolved config and the content of every dataset it reads.

    Args:
        config: the job's `TrainConfig` as a dict, without the launch fields and with its model fields added later
            dropped at their defaults (`cse.training.job.run_key` prepares it).
        tokens_hash: the content hash of the tokens dataset.
        corruption_hash: the content hash of the corruption dataset (None for methods without one).
        nli_tokens_hash: the content hash of DiffAug's NLI tokens dataset (added later: None leaves it out).
    """
    return stable_hash(
        {
            "config": dict(config),
            "tokens": tokens_hash,
            "corruption": corruption_hash,
            **without_defaults({"nli_tokens": nli_tokens_hash}, RUN_ADDED_LATER),
        }
    )
