"""Corruption shards on Dask (prefect-dask's DaskTaskRunner) match the local run byte for byte.

The `corrupt` flow runs twice on the shared Wiki1M sample, each time into its own data root: once with
the default local runner, once with `CSE_DASK_ADDRESS` pointing at a two-process `LocalCluster`.
"""

from __future__ import annotations

import pytest
from distributed import Client, LocalCluster, get_task_stream
from prefect.task_runners import ThreadPoolTaskRunner
from prefect_dask import DaskTaskRunner

from config.settings import ShardRunnerSettings, get_settings, shard_runner_settings, shard_task_runner
from config.stages import CorruptConfig, TokenizeConfig
from flows.corrupt import corrupt
from storage.layout import DataRoot

SHARD_SIZE = 4_000  # the 11,913-sentence sample → 3 shards


def _run_corrupt(monkeypatch, data_root, ingest_config, config):
    monkeypatch.setenv("CSE_DATA_ROOT", str(data_root))
    ref = corrupt(None, config, "wiki1m", ingest_config, TokenizeConfig(tokenizer="packaged:minilm"))
    root = DataRoot(get_settings().data_root)
    manifest = root.require("corruption", ref.key)
    return ref, manifest, [p.read_bytes() for p in manifest.paths(root.dataset_dir("corruption", ref.key))]


def test_dask_shards_match_the_local_run_byte_for_byte(prefect_harness, monkeypatch, isolated_home,
                                                        tiny_generator_dir, local_ingest_config):
    config = CorruptConfig(generator=str(tiny_generator_dir), shard_size=SHARD_SIZE, batch_size=128, device="cpu")
    monkeypatch.delenv("CSE_TASK_RUNNER", raising=False)
    monkeypatch.delenv("CSE_DASK_ADDRESS", raising=False)
    assert shard_task_runner() is None

    local_ref, local_manifest, local_parts = _run_corrupt(monkeypatch, isolated_home / "data-local",
                                                          local_ingest_config, config)
    assert not local_ref.cache_hit and len(local_parts) >= 3
    assert local_manifest.stats["shards_computed"] == len(local_parts)

    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        monkeypatch.setenv("CSE_DASK_ADDRESS", cluster.scheduler_address)
        assert isinstance(shard_task_runner(), DaskTaskRunner)
        with get_task_stream(client) as stream:
            dask_ref, dask_manifest, dask_parts = _run_corrupt(monkeypatch, isolated_home / "data-dask",
                                                               local_ingest_config, config)
        workers = set(cluster.scheduler_info["workers"])
        generators_loaded = client.run(lambda: len(__import__("tasks.corrupt").corrupt._CORRUPTORS))

    assert dask_ref.path != local_ref.path and not dask_ref.cache_hit
    assert dask_ref.key == local_ref.key and dask_manifest.stats["shards_computed"] == len(dask_parts)
    assert len(dask_parts) == len(local_parts)
    for i, (a, b) in enumerate(zip(local_parts, dask_parts, strict=True)):
        assert a == b, f"shard {i} differs between the local and the Dask run"
    assert dask_ref.content_hash == local_ref.content_hash

    # every shard task ran on a Dask worker process (which loaded the generator), none in this process
    ran = [r for r in stream.data if "corrupt" in str(r["key"])]
    assert len(ran) == len(dask_parts), [r["key"] for r in stream.data]
    assert {r["worker"] for r in ran} <= workers
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
