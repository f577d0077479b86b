"""Offline replaced-token corruption of a tokens dataset (DiffCSE, Chuang et al., 2022), sharded and cached: the stage.

The key (`cse.storage.keys.corruption_key`) hashes the tokens' content, the generator (name or folder + its config.json
and, for a folder, the content of its files; a `generator:<key>` dataset of the fit-generator stage, by key or by
folder, by its key and content hash; "unigram" for mode unigram), the tokenizer fingerprint and every setting that
changes the output. Each shard of `shard_size` sentences is one task writing
`datasets/corruption/<key>.shards/shard-NNNNN.parquet` atomically, so a rerun after a crash computes only the missing
shards; publishing links the shards into the dataset folder with
its manifest and removes the work folder (storage/sharded.py: the plan's shards, their files, reading the
tokens rows of a shard, publishing). Output rows: every input row × `variants`, in input order
(storage/corruption.py assembles them, storage/corruption_stats.py counts them; the generator is loaded once per
process, models/generator_cache.py).

A corruption whose replacements are special tokens beyond `MAX_SPECIAL_REPLACEMENTS` of them is refused before it
is published (`SpecialReplacements`, naming the tokens; its shards are removed): a generator predicts words, and one
whose logits are NaN predicts `[PAD]` everywhere (a generator with non-finite weights is refused when it is loaded,
`cse.models.generator_cache`; this catches the finite ones that behave the same).

A shard's bytes depend only on the plan and the shard number (its seeds come from `shard_seed`), so
shards may run in any order, in any process, on any machine (flows/corrupt.py hands them to Dask
when one is configured). The plan carries the data root: a shard task reads and writes there, not
under its own process's `CSE_DATA_ROOT`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import ClassVar, Literal

import pyarrow as pa
import pyarrow.compute as pc
from prefect import task
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from cse.config.stages import CorruptConfig
from cse.models.corruption import Corruptor, SpecialTokens, corrupt_variants
from cse.models.generator_cache import release_generators, shared_corruptor
from cse.models.loading import (
    PACKAGED_MINILM,
    check_same_vocabulary,
    is_random_init,
    load_tokenizer,
    pick_device,
    resolve_model_path,
    vocab_fingerprint,
)
from cse.storage import schemas, sharded
from cse.storage.catalog import refresh_catalog
from cse.storage.corruption import corruption_rows, token_lists
from cse.storage.corruption_stats import ShardResult, corruption_stats, shard_result, special_replacements
from cse.storage.datasets import DatasetRef, read_dataset
from cse.storage.generators import GENERATOR_PREFIX, generator_dataset
from cse.storage.generators import KIND as GENERATOR_KIND
from cse.storage.hashing import sha256_file, sha256_folder, stable_hash
from cse.storage.integrity import Quarantined
from cse.storage.keys import CORRUPTION_SETTINGS, SCHEMA_VERSIONS, corruption_key
from cse.storage.layout import DataRoot
from cse.storage.manifest import Manifest
from cse.storage.settings import get_settings
from cse.storage.sharded import ShardedPlan
from cse.tasks.log import stage_logger
from cse.tracking.lineage import CONTEXT_SOURCE, log_dataset_inputs
from cse.tracking.stage_runs import log_dataset_metrics, log_quarantine, stage_run, tag_dataset_run

KIND = "corruption"
SCHEMA_VERSION = SCHEMA_VERSIONS[KIND]
# The largest share of the replacements that may be special tokens ([PAD], [CLS], [SEP], [MASK], [UNK]): a healthy
# generator predicts them at almost no masked position (measured: 0 of 1,751 for a random tiny DistilBERT); one
# whose logits are NaN predicts [PAD] at every position (92 % of the replacements in the campaign's case).
MAX_SPECIAL_REPLACEMENTS = 0.05


class SpecialReplacements(ValueError):
    """A corruption whose replacements are special tokens beyond `MAX_SPECIAL_REPLACEMENTS`: refused before it is
    published. `key`: the corruption's key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


class CorruptPlan(ShardedPlan):
    """Everything the shard and publish tasks need; small and serialisable. `source`: the tokens dataset."""

    kind: ClassVar[str] = KIND
    output_schema: ClassVar[pa.Schema] = schemas.CORRUPTION

    tokenizer: str
    tokenizer_fingerprint: str | None
    generator: dict[str, str]
    generator_path: str | None = None  # what loads the generator (a generator dataset's folder); None: config.generator
    unigram_counts: list[int] | None = None  # mode unigram: non-special token counts of the tokens dataset
    config: CorruptConfig
    device: str
    precision: Literal["fp32", "bf16"]
    special_ids: list[int]
    cached: bool
    quarantined: dict | None = None  # a damaged dataset of this key moved aside while planning (logged when publishing)

    @property
    def shard_size(self) -> int:
        return self.config.shard_size

    @property
    def tokens_key(self) -> str:
        return self.source.key

    @property
    def tokens_hash(self) -> str:
        return self.source.content_hash


def _root() -> DataRoot:
    return DataRoot(get_settings().data_root)


def shard_seed(seed: int, shard: int, variant: int) -> int:
    """The RNG seed of one (shard, variant): independent of how shards are scheduled."""
    return int(stable_hash({"seed": seed, "shard": shard, "variant": variant}), 16) & (2**63 - 1)


def generator_identity(name: str) -> dict[str, str]:
    """The generator (or any model) as the cache keys see it: name (or resolved folder) and the hash of its
    config.json; for a folder also the content hash of its files (`sha256_folder`: config, weights, tokenizer), so
    weights replaced under the same config.json, whatever their modification time, are another generator (hashing
    reads the weights once per call: about a second a GB). A hub model is its name and config.json (the files of one
    hub revision do not change)."""
    if is_random_init(name):
        return {"name": name}
    resolved = Path(resolve_model_path(name))
    if resolved.is_dir():
        return {
            "name": name if name == PACKAGED_MINILM else str(resolved),
            "config_sha256": sha256_file(resolved / "config.json"),
            "files_sha256": sha256_folder(resolved),
        }
    from transformers.utils import cached_file

    try:
        config_file = cached_file(name, "config.json")
    except OSError as e:
        raise ValueError(
            f"generator {name!r} is neither a local model folder nor an HF model available "
            f"online or in the local cache: {e}"
        ) from e
    if config_file is None:  # (a missing file raises above; None only where that is turned off)
        raise ValueError(f"generator {name!r} has no config.json")
    return {"name": name, "config_sha256": sha256_file(config_file)}


def resolve_generator(root: DataRoot, config: CorruptConfig, verify: bool = False) -> tuple[dict[str, str], str | None]:
    """(identity for the key, what loads it): a generator dataset (`generator:<key>`, or its folder) is verified and
    identified by its key and content hash, so both spellings give one corruption key; mode unigram has no
    generator; anything else is `generator_identity`'s (the path to load: None = `config.generator` itself)."""
    if config.mode == "unigram":
        return {"name": "unigram"}, None
    m = generator_dataset(root, config.generator)
    if m is None:
        return generator_identity(config.generator), None
    root.verify(GENERATOR_KIND, m.key, full=verify)
    return {"name": f"{GENERATOR_PREFIX}{m.key}", "content_hash": m.content_hash}, str(
        root.dataset_dir(GENERATOR_KIND, m.key)
    )


def unigram_counts(root: DataRoot, tokens: Manifest, special: list[int]) -> list[int]:
    """The non-special token counts of a tokens dataset (what mode unigram draws from)."""
    from cse.models.generator import token_counts

    ids = pc.list_flatten(read_dataset(root, "tokens", tokens.key, columns=["input_ids"]).column("input_ids"))
    vocab = len(load_tokenizer(_tokens_tokenizer(tokens)))
    return token_counts(ids.to_numpy(), vocab, special).tolist()


def _tokens_tokenizer(tokens: Manifest) -> str:
    name = tokens.params.get("tokenizer")
    if not name:
        raise ValueError(f"tokens dataset {tokens.key} records no tokenizer in its manifest params")
    return name


def load_tokens_tokenizer(tokens: Manifest):
    """(name, tokenizer) of the tokenizer a tokens dataset was made with, refused when it no longer gives the
    dataset's recorded vocabulary."""
    name = _tokens_tokenizer(tokens)
    tokenizer = load_tokenizer(name)
    if tokens.params.get("vocab_fingerprint") not in (None, vocab_fingerprint(tokenizer)):
        raise ValueError(f"tokenizer {name!r} no longer matches the vocabulary of tokens dataset {tokens.key}")
    return name, tokenizer


def check_generator_vocabulary(tokens: Manifest, generator: str) -> list[int]:
    """Refuse a generator whose vocabulary differs from the tokens'; returns the special token ids."""
    name, tokenizer = load_tokens_tokenizer(tokens)
    try:
        gen_tokenizer = load_tokenizer(generator)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer of generator {generator!r} to check its vocabulary: {e}") from e
    check_same_vocabulary(tokenizer, gen_tokenizer, name, generator)
    return list(SpecialTokens.from_tokenizer(tokenizer).special)


@task(name="corrupt-plan", cache_policy=NO_CACHE)
def plan_corruption(tokens_key: str, config: CorruptConfig, verify: bool = False, locked: bool = False) -> CorruptPlan:
    """Resolve the key; on a miss check the generator's vocabulary (the generator itself is not loaded).

    An existing dataset is verified before it counts as cached (content hashes too with `verify`); when damaged it is
    a miss, and with `locked` (the caller holds the build lock) it is moved to the quarantine."""
    config = config.resolved()  # `variants` None → its explicit default, so both spellings share one dataset
    root = _root()
    tokens = root.require("tokens", tokens_key)
    device = pick_device(config.device)
    precision: Literal["fp32", "bf16"] = "bf16" if device.type == "cuda" and config.bf16 else "fp32"
    generator, generator_path = resolve_generator(root, config, verify=verify)
    key = corruption_key(
        tokens.content_hash,
        tokens.params.get("tokenizer_fingerprint"),
        generator,
        precision,
        **config.model_dump(include=set(CORRUPTION_SETTINGS)),
    )
    manifest, quarantined = root.reuse(KIND, key, full=verify, quarantine=locked)
    cached = manifest is not None
    counts = None
    if cached:
        special = []
    elif config.mode == "unigram":
        special = list(SpecialTokens.from_tokenizer(load_tokenizer(_tokens_tokenizer(tokens))).special)
        counts = unigram_counts(root, tokens, special)
    else:
        special = check_generator_vocabulary(tokens, generator_path or config.generator)
    return CorruptPlan(
        key=key,
        data_root=str(root.root),
        source=DatasetRef.of(root, tokens, cache_hit=False),
        part_rows=[] if cached else sharded.part_rows(root, "tokens", tokens_key),
        tokenizer=_tokens_tokenizer(tokens),
        tokenizer_fingerprint=tokens.params.get("tokenizer_fingerprint"),
        generator=generator,
        config=config,
        generator_path=generator_path,
        unigram_counts=counts,
        device=str(device),
        precision=precision,
        special_ids=special,
        cached=cached,
        quarantined=asdict(quarantined) if quarantined is not None else None,
    )


def _corruptor(plan: CorruptPlan) -> Corruptor:
    """The generator of this plan, loaded once per process (shard tasks share it: models/generator_cache.py)."""
    cfg = plan.config
    return shared_corruptor(
        plan.generator_path or cfg.generator,
        plan.tokenizer,
        plan.device,
        cfg.mask_ratio,
        cfg.mode,
        cfg.bf16,
        cfg.generator_dropout,
        cfg.positions == "all",
        unigram_counts=plan.unigram_counts,
        unigram_source=plan.tokens_hash,
        hard=cfg.hard,
    )


def _corrupt_table(tokens: pa.Table, corruptor: Corruptor, plan: CorruptPlan, shard: int) -> pa.Table:
    """The corruption rows of one shard: each input row × variants, in input order."""
    flat, offsets = token_lists(tokens.column("input_ids"))
    cfg = plan.config
    bar = tqdm(
        total=tokens.num_rows * cfg.resolved_variants,
        unit="sent",
        desc=f"corrupt shard {shard + 1}/{plan.n_shards}",
        leave=False,
    )

    def advance(n: int) -> None:
        bar.update(n)

    variants = corrupt_variants(
        corruptor,
        flat,
        offsets,
        [shard_seed(cfg.resolved_seed, shard, v) for v in range(cfg.resolved_variants)],
        cfg.batch_size,
        seeded_dropout=cfg.generator_dropout,
        on_batch=advance,
    )
    bar.close()
    return corruption_rows(tokens, flat, offsets, variants)


@task(name="corrupt-shard", cache_policy=NO_CACHE)
def corrupt_shard(plan: CorruptPlan, shard: int) -> ShardResult:
    """Corrupt one shard into its work file; a shard file already there is reused as it is.

    Runs in the flow's process or on a Dask worker: it reads the tokens and writes under `plan.data_root`.
    """
    timing = {"seconds": 0.0}

    def compute(tokens: pa.Table) -> pa.Table:
        corruptor = _corruptor(plan)
        t0 = time.perf_counter()
        table = _corrupt_table(tokens, corruptor, plan, shard)
        timing["seconds"] = time.perf_counter() - t0
        return table

    table, computed = sharded.build_shard(plan, shard, ["id", "column", "input_ids"], compute)
    seconds = timing["seconds"]
    result = shard_result(
        shard, table, plan.special_ids, plan.config.resolved_variants, computed=computed, seconds=seconds
    )
    if computed:
        stage_logger().info(
            "corruption %s shard %d/%d: %d rows in %.1fs (%.0f sentences/s)",
            plan.key,
            shard + 1,
            plan.n_shards,
            result.rows,
            seconds,
            result.rows / max(seconds, 1e-9),
        )
    return result


def check_replacements(root: DataRoot, plan: CorruptPlan, shards: list[ShardResult]) -> None:
    """Refuse the corruption of `shards` when over `MAX_SPECIAL_REPLACEMENTS` of its replacements are special tokens,
    naming them; its shard files are removed (a rerun computes them again, from a generator fixed or replaced).

    Raises:
        SpecialReplacements: naming the key, the counts, the special tokens and the generator.
    """
    replaced = sum(s.replaced for s in shards)
    special = special_replacements(shards)
    if not replaced or sum(special.values()) <= MAX_SPECIAL_REPLACEMENTS * replaced:
        return
    tokenizer = load_tokenizer(plan.tokenizer)
    named = ", ".join(f"{tokenizer.convert_ids_to_tokens(t)} {n:,d}" for t, n in special.items())
    sharded.remove_shards(root, KIND, plan.key)
    raise SpecialReplacements(
        plan.key,
        f"corruption {plan.key}: {sum(special.values()):,d} of {replaced:,d} replaced tokens are special tokens "
        f"({named}), over {MAX_SPECIAL_REPLACEMENTS:.0%}: generator {plan.generator_path or plan.config.generator!r} "
        "predicts special tokens instead of words (degenerate or non-finite weights?). Nothing was published: check "
        "or replace the generator",
    )


def _publish(root: DataRoot, plan: CorruptPlan, shards: list[ShardResult]) -> Manifest:
    check_replacements(root, plan, shards)
    cfg = plan.config
    params = {
        "generator": cfg.generator,
        "generator_identity": plan.generator,
        "tokenizer": plan.tokenizer,
        "tokenizer_fingerprint": plan.tokenizer_fingerprint,
        "mask_ratio": cfg.mask_ratio,
        "mode": cfg.mode,
        "variants": cfg.variants,
        "seed": cfg.seed,
        "shard_size": cfg.shard_size,
        "batch_size": cfg.batch_size,
        "generator_dropout": cfg.generator_dropout,
        "positions": cfg.positions,
        **({"hard": True} if cfg.hard else {}),  # (added later: recorded when on, as in the key)
        "device": plan.device,
        "precision": plan.precision,
        "schema_version": SCHEMA_VERSION,
    }
    manifest = sharded.publish_shards(root, plan, shards, params=params, stats=corruption_stats)
    refresh_catalog(root)
    return manifest


def _log_to_run(run_id: str, plan: CorruptPlan, manifest: Manifest) -> None:
    log_dataset_inputs(run_id, [(plan.source, CONTEXT_SOURCE)])  # the tokens dataset it corrupted
    stats = manifest.stats
    metrics = {"rows": manifest.rows, "cache_hit": float(plan.cached)}
    keys: tuple[str, ...] = ("sentences", "masked_ratio", "replaced_ratio", "replaced_of_masked")
    if not plan.cached:
        keys += ("shards", "shards_computed", "compute_seconds", "sentences_per_s")
        for s in stats["per_shard"]:
            log_dataset_metrics(
                {"shard_masked_ratio": s["masked_ratio"], "shard_replaced_ratio": s["replaced_ratio"]},
                run_id=run_id,
                step=s["shard"],
            )
    metrics.update({k: float(stats[k]) for k in keys if k in stats})
    log_dataset_metrics(metrics, run_id=run_id)
    tag_dataset_run(
        {
            "key": plan.key,
            "tokens_key": plan.tokens_key,
            "input_hash": plan.tokens_hash,
            "content_hash": manifest.content_hash,
            "generator": plan.config.generator,
            "precision": plan.precision,
        },
        run_id=run_id,
    )


@task(name="corrupt-publish", cache_policy=NO_CACHE)
def publish_corruption(plan: CorruptPlan, shards: list[ShardResult], run_id: str | None = None) -> DatasetRef:
    """Publish the finished shards as dataset `corruption/<key>` (or return the cached one) and log to
    the MLflow run `run_id` when given."""
    root = _root()
    if plan.cached:
        manifest = root.require(KIND, plan.key)
    else:
        manifest = _publish(root, plan, shards)
        release_generators()
    if run_id is not None:
        _log_to_run(run_id, plan, manifest)
        if plan.quarantined is not None:
            log_quarantine(Quarantined(**plan.quarantined), stage_logger(), run_id=run_id)
    stage_logger().info(
        "corruption %s: %d rows (%s)", plan.key, manifest.rows, "cache hit" if plan.cached else "written"
    )
    return DatasetRef.of(root, manifest, cache_hit=plan.cached)


@contextmanager
def corruption_run(tokens_key: str, config: CorruptConfig) -> Iterator[str]:
    """The stage's MLflow run (experiment `data`, run name `corrupt`); yields its id. Fails → FAILED."""
    with stage_run("data", "corrupt", params={"tokens_key": tokens_key, **config.model_dump()}) as run:
        yield run.info.run_id
