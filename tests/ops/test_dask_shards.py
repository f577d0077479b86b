"""Tokenisation and corruption shards on Dask (prefect-dask's DaskTaskRunner) match the local run byte for byte.

The `corrupt` flow (ingest → tokenise → corrupt) runs twice on the head of the shared Wiki1M sample,
each time into its own data root: once with the default local runner, once with `CSE_DASK_ADDRESS`
pointing at a two-process `LocalCluster`, where both the tokenisation parts and the corruption shards
are Prefect tasks run by the Dask workers.
"""

from __future__ import annotations

import pytest
from distributed import Client, LocalCluster, get_task_stream
from prefect.task_runners import ThreadPoolTaskRunner
from prefect_dask import DaskTaskRunner

from cse.config.stages import CorruptConfig, TokenizeConfig, WikiSource
from cse.flows.corrupt import corrupt
from cse.storage.layout import DataRoot
from cse.storage.settings import ShardRunnerSettings, get_settings, shard_runner_settings, shard_task_runner

SENTENCES = 1_200
SHARD_SIZE = 350  # → 4 corruption shards, the last one short
TOKENIZE = TokenizeConfig(tokenizer="packaged:minilm", batch_size=500)  # → 3 tokens parts, the last one short


def _files(root: DataRoot, kind: str, key: str) -> list[bytes]:
    return [p.read_bytes() for p in root.require(kind, key).paths(root.dataset_dir(kind, key))]


def _run_corrupt(monkeypatch, data_root, ingest_config, config):
    monkeypatch.setenv("CSE_DATA_ROOT", str(data_root))
    ref = corrupt(None, config, "wiki1m", ingest_config, TOKENIZE)
    root = DataRoot(get_settings().data_root)
    manifest = root.require("corruption", ref.key)
    tokens = root.require("tokens", manifest.source["key"])
    assert not root.shards_dir("tokens", tokens.key).exists() and not root.shards_dir("corruption", ref.key).exists()
    return ref, manifest, tokens, _files(root, "corruption", ref.key), _files(root, "tokens", tokens.key)


def test_dask_shards_match_the_local_run_byte_for_byte(
    prefect_harness, monkeypatch, isolated_home, wiki_cut, tiny_generator_dir, local_ingest_config
):
    head = wiki_cut(SENTENCES, "wiki1m_head.txt")
    ingest_config = local_ingest_config.model_copy(update={"wiki": WikiSource(path=str(head))})
    config = CorruptConfig(generator=str(tiny_generator_dir), shard_size=SHARD_SIZE, batch_size=128, device="cpu")
    monkeypatch.delenv("CSE_TASK_RUNNER", raising=False)
    monkeypatch.delenv("CSE_DASK_ADDRESS", raising=False)
    assert shard_task_runner() is None

    local_ref, local_manifest, local_tokens, local_parts, local_token_parts = _run_corrupt(
        monkeypatch, isolated_home / "data-local", ingest_config, config
    )
    # the stage default: 4 variants (2 views x 2 epochs), generator dropout on: still identical on Dask
    assert not local_ref.cache_hit and local_ref.rows == SENTENCES * config.resolved_variants and len(local_parts) == 4
    assert local_manifest.stats["shards_computed"] == len(local_parts) and len(local_token_parts) == 3

    with (
        LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        monkeypatch.setenv("CSE_DASK_ADDRESS", cluster.scheduler_address)
        assert isinstance(shard_task_runner(), DaskTaskRunner)
        with get_task_stream(client) as stream:
            dask_ref, dask_manifest, dask_tokens, dask_parts, dask_token_parts = _run_corrupt(
                monkeypatch, isolated_home / "data-dask", ingest_config, config
            )
        workers = set(cluster.scheduler_info["workers"])
        generators_loaded = client.run(
            lambda: len(__import__("cse.models.generator_cache").models.generator_cache._CORRUPTORS)
        )

    assert dask_ref.path != local_ref.path and not dask_ref.cache_hit
    assert dask_ref.key == local_ref.key and dask_manifest.stats["shards_computed"] == len(dask_parts)
    assert len(dask_parts) == len(local_parts)
    for i, (a, b) in enumerate(zip(local_parts, dask_parts, strict=True)):
        assert a == b, f"shard {i} differs between the local and the Dask run"
    assert dask_ref.content_hash == local_ref.content_hash
    assert dask_token_parts == local_token_parts
    for field in ("key", "content_hash", "stats"):
        assert getattr(dask_tokens, field) == getattr(local_tokens, field), field

    # every shard task (tokens parts, then corruption shards) ran on a Dask worker process, none here
    keys = [str(r["key"]) for r in stream.data]
    assert sum("corrupt" in k for k in keys) == len(dask_parts), keys
    assert sum("tokenize" in k for k in keys) == len(dask_token_parts), keys
    assert len(keys) == len(dask_parts) + len(dask_token_parts) and {r["worker"] for r in stream.data} <= workers
    assert sum(generators_loaded.values()) >= 1


def test_the_task_runner_comes_from_the_environment(monkeypatch):
    for name in ("CSE_TASK_RUNNER", "CSE_DASK_ADDRESS", "CSE_DASK_WORKERS", "CSE_DASK_THREADS_PER_WORKER"):
        monkeypatch.delenv(name, raising=False)
    assert shard_runner_settings() == ShardRunnerSettings() and shard_task_runner() is None
    assert isinstance(corrupt.task_runner, ThreadPoolTaskRunner)

    monkeypatch.setenv("CSE_TASK_RUNNER", "dask-local")
    monkeypatch.setenv("CSE_DASK_WORKERS", "3")
    runner = shard_task_runner()  # built, not started: no cluster yet
    assert isinstance(runner, DaskTaskRunner) and runner.address is None
    assert runner.cluster_kwargs == {"processes": True, "threads_per_worker": 1, "n_workers": 3}

    monkeypatch.setenv("CSE_DASK_WORKERS", "0")
    with pytest.raises(ValueError, match="CSE_DASK_WORKERS"):
        shard_runner_settings()
    monkeypatch.delenv("CSE_DASK_WORKERS")

    monkeypatch.setenv("CSE_TASK_RUNNER", "ray")
    with pytest.raises(ValueError, match="CSE_TASK_RUNNER"):
        shard_runner_settings()
    monkeypatch.setenv("CSE_TASK_RUNNER", "dask")
    with pytest.raises(ValueError, match="CSE_DASK_ADDRESS"):
        shard_runner_settings()

    monkeypatch.delenv("CSE_TASK_RUNNER")
    monkeypatch.setenv("CSE_DASK_ADDRESS", "tcp://127.0.0.1:8786")
    runner = shard_task_runner()
    assert isinstance(runner, DaskTaskRunner) and runner.address == "tcp://127.0.0.1:8786"
    assert shard_runner_settings().kind == "dask"
