"""Item 1: a cache hit verifies what it reuses; a damaged dataset is quarantined (never deleted) and rebuilt."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from cse.ops.cli import main as cse
from cse.storage.integrity import DAMAGED_MARKER, QUARANTINE_DIR, QUARANTINE_RECORD, check_dataset
from tests.reliability.conftest import data_runs, flip_byte_in_data, ingest, part, truncate


def _quarantined(root, kind):
    d = root.root / QUARANTINE_DIR / kind
    return sorted(d.iterdir()) if d.is_dir() else []


def test_truncated_part_is_quarantined_and_rebuilt(ingest_config, root):
    first = ingest("wiki1m", ingest_config)
    damaged = part(root, "wiki1m", first.key)
    original = damaged.read_bytes()
    truncate(damaged)

    again = ingest("wiki1m", ingest_config)
    assert not again.cache_hit, "a truncated part must not be reused as a cache hit"
    assert (again.key, again.content_hash, again.rows) == (first.key, first.content_hash, first.rows)
    assert pq.read_table(part(root, "wiki1m", again.key)).num_rows == first.rows

    [moved] = _quarantined(root, "wiki1m")  # moved aside, not deleted
    assert moved.name.startswith(first.key) and (moved / "part-00000.parquet").stat().st_size == len(original) // 2
    record = json.loads((moved / QUARANTINE_RECORD).read_text())
    assert record["kind"] == "wiki1m" and record["key"] == first.key
    assert "part-00000.parquet" in record["problems"][0]["file"]
    run = data_runs("ingest-wiki1m")[-1]
    assert run.info.status == "FINISHED" and run.data.metrics["cache_hit"] == 0
    assert run.data.tags["quarantined"] == str(moved) and "part-00000.parquet" in run.data.tags["quarantine_reason"]


def test_flipped_byte_found_by_verify_and_rebuilt_by_next_run(ingest_config, root, capsys):
    first = ingest("nli", ingest_config)
    damaged = part(root, "nli", first.key)
    flip_byte_in_data(damaged)
    assert check_dataset(root.dataset_dir("nli", first.key), "nli", first.key) == []  # the cheap check cannot see it

    assert cse(["verify"]) == 1
    out = capsys.readouterr().out
    assert f"nli/{first.key}" in out and str(damaged) in out and "content hash" in out
    assert (root.dataset_dir("nli", first.key) / DAMAGED_MARKER).is_file()

    again = ingest("nli", ingest_config)  # the next stage run: quarantines what `cse verify` found, rebuilds it
    assert not again.cache_hit and again.content_hash == first.content_hash
    assert len(_quarantined(root, "nli")) == 1
    run = data_runs("ingest-nli")[-1]
    assert run.data.tags["quarantined"].startswith(str(root.root / QUARANTINE_DIR / "nli" / first.key))
    assert cse(["verify"]) == 0


def test_verify_option_checks_content_hash_on_a_cache_hit(ingest_config, root):
    first = ingest("nli", ingest_config)
    flip_byte_in_data(part(root, "nli", first.key))
    assert ingest("nli", ingest_config.model_copy(update={"verify": True})).cache_hit is False
    assert len(_quarantined(root, "nli")) == 1
    assert ingest("nli", ingest_config, verify=True).cache_hit is True  # intact now


def test_training_verifies_content_hashes_of_every_input(monkeypatch):
    """Before training, every dataset the job reads is verified down to its content hash (flows/train.py)."""
    from types import SimpleNamespace

    from cse.config.training import resolve_train_config
    from cse.flows import train

    calls = []
    ref = SimpleNamespace(key="k", content_hash="h")
    monkeypatch.setattr(train, "prepare_tokens", lambda *a, **k: calls.append(("tokens", k)) or ref)
    monkeypatch.setattr(train, "ingest_dataset", lambda *a, **k: calls.append(("sts", k)) or ref)
    monkeypatch.setattr(train, "corrupt", lambda *a, **k: calls.append(("corrupt", k)) or ref)
    result = SimpleNamespace(run_id="r", steps=0, best_stsb_dev=0.0, resumed_from=None, test_metrics={})
    monkeypatch.setattr(train, "train_job", lambda *a, **k: result)
    train.run_training(resolve_train_config("smoke", None, method="d2cse"))
    assert [name for name, _ in calls] == ["tokens", "sts", "corrupt"]
    assert all(k.get("verify") is True for _, k in calls)


def test_tokens_cache_hit_with_flipped_byte_is_rebuilt_when_verifying(ingest_config, root):
    from cse.config.stages import TokenizeConfig
    from cse.tasks.tokenize import tokenize_dataset

    src = ingest("nli", ingest_config)
    cfg = TokenizeConfig(tokenizer="packaged:minilm")
    tokens = tokenize_dataset.fn(src, cfg)
    flip_byte_in_data(part(root, "tokens", tokens.key))
    again = tokenize_dataset.fn(src, cfg, verify=True)
    assert not again.cache_hit and again.content_hash == tokens.content_hash
    assert len(_quarantined(root, "tokens")) == 1


def test_damaged_manifest_is_quarantined_not_overwritten(ingest_config, root):
    first = ingest("wiki1m", ingest_config)
    (root.dataset_dir("wiki1m", first.key) / "manifest.json").write_text('{"kind": "wiki1m", ')
    again = ingest("wiki1m", ingest_config)
    assert not again.cache_hit and again.content_hash == first.content_hash
    [moved] = _quarantined(root, "wiki1m")
    assert (moved / "part-00000.parquet").is_file()  # the data that was there is kept


def test_folder_without_manifest_is_reported_and_kept(ingest_config, root, capsys):
    first = ingest("wiki1m", ingest_config)
    (root.dataset_dir("wiki1m", first.key) / "manifest.json").unlink()
    assert cse(["verify"]) == 1
    assert f"wiki1m/{first.key}" in capsys.readouterr().out
    again = ingest("wiki1m", ingest_config)
    assert not again.cache_hit and again.content_hash == first.content_hash
    [moved] = _quarantined(root, "wiki1m")
    assert (moved / "part-00000.parquet").is_file()  # not overwritten by the rebuild


def test_corruption_damage_is_quarantined_under_the_lock_and_logged(ingest_config, root, tiny_generator_dir):
    from cse.config.stages import CorruptConfig, TokenizeConfig
    from cse.tasks.corrupt import corrupt_shard, corruption_run, plan_corruption, publish_corruption
    from cse.tasks.tokenize import tokenize_dataset

    tokens = tokenize_dataset.fn(ingest("nli", ingest_config), TokenizeConfig(tokenizer="packaged:minilm"))
    cfg = CorruptConfig(generator=str(tiny_generator_dir), shard_size=256, batch_size=64, device="cpu", variants=1)

    def run(verify: bool):
        with corruption_run(tokens.key, cfg) as run_id:
            plan = plan_corruption.fn(tokens.key, cfg, verify=verify)
            with root.building("corruption", plan.key):
                if not plan.cached:
                    plan = plan_corruption.fn(tokens.key, cfg, verify=verify, locked=True)
                shards = [] if plan.cached else [corrupt_shard.fn(plan, i) for i in range(plan.n_shards)]
                return publish_corruption.fn(plan, shards, run_id), run_id

    first, _ = run(verify=False)
    flip_byte_in_data(part(root, "corruption", first.key))
    assert run(verify=False)[0].cache_hit  # the cheap check cannot see a flipped byte ...
    again, run_id = run(verify=True)  # ... the full check (training always asks for it) can
    assert not again.cache_hit and again.content_hash == first.content_hash
    [moved] = _quarantined(root, "corruption")
    assert [r for r in data_runs("corrupt") if r.info.run_id == run_id][0].data.tags["quarantined"] == str(moved)


def test_evaluation_refuses_a_damaged_sts_dataset(ingest_config, root):
    import pytest

    from cse.storage.evaluations import load_sts_input
    from cse.storage.integrity import DatasetDamaged

    sts = ingest("sts", ingest_config)
    assert load_sts_input(sts.key, root).table.num_rows == sts.rows
    flip_byte_in_data(part(root, "sts", sts.key))
    with pytest.raises(DatasetDamaged, match=rf"dataset sts/{sts.key} is damaged: .*part-00000\.parquet: content hash"):
        load_sts_input(sts.key, root)
