"""Preflight checks (tasks/preflight.py), each on its own and without network: the hub is either offline, a local
cache laid out by the test, or a stub that hangs (the probe's time budget is what is checked)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from cse.config.stages import IngestConfig, WikiSource
from cse.config.training import resolve_train_config
from cse.models.loading import PACKAGED_MINILM
from cse.storage.layout import DataRoot
from cse.tasks import preflight
from cse.tasks.preflight import (
    HubProbe,
    Preflight,
    PreflightError,
    check_device,
    check_generator,
    check_source,
    count_lines,
    model_status,
    training_checks,
)
from cse.tracking.data_warnings import DATA_WARNING_TAG, data_warning_tags


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache: a model some other run downloaded does not make a check pass."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def offline(monkeypatch, empty_hf_cache):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def root(isolated_home) -> DataRoot:
    return DataRoot(isolated_home / "data")


def _cache_model(cache: Path, repo_id: str, files: list[str]) -> None:
    """Lay out `files` of `repo_id` the way huggingface_hub caches them (refs/main → snapshots/<commit>/)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for name in files:
        path = repo / "snapshots" / commit / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")


def test_missing_hub_model_offline_names_it_and_every_fix(offline, shared_data, monkeypatch, root):
    monkeypatch.setenv("CSE_SOURCE_MIRROR", str(shared_data))
    pf = training_checks(resolve_train_config("default"), root=root)
    with pytest.raises(PreflightError) as e:
        pf.finish(logging.getLogger("test"))
    msg = str(e.value)
    assert msg.startswith("preflight: train-d2cse (preset default) cannot run on this machine, nothing was started")
    assert "2 things missing" in msg
    backbone, generator = msg.splitlines()[1:]
    assert backbone.startswith("1. backbone and tokenizer 'bert-base-uncased': not in the local Hugging Face cache")
    assert "HF_HUB_OFFLINE is set" in backbone
    assert """-p 'overrides={"backbone": "/path/to/bert-base-uncased"}'""" in backbone
    assert """-p 'overrides={"backbone": "packaged:minilm"}'""" in backbone
    assert "the deployment train-d2cse/smoke" in backbone
    assert generator.startswith("2. corruption generator 'distilbert-base-uncased'")
    assert """-p 'overrides={"corrupt": {"generator": "random-init:distilbert-tiny"}}'""" in generator
    assert "fit-generator/default" in generator


def test_a_hub_model_in_the_local_cache_passes_offline(offline, empty_hf_cache):
    probe = HubProbe()
    _cache_model(empty_hf_cache, "org/encoder", ["config.json", "model.safetensors", "tokenizer.json"])
    assert model_status("org/encoder", probe) is None
    _cache_model(empty_hf_cache, "org/config-only", ["config.json"])
    assert "not in the local Hugging Face cache" in model_status("org/config-only", probe)
    assert model_status("org/config-only", probe, weights=False, tokenizer=False) is None


def test_an_unanswering_hub_costs_the_probe_budget_once(monkeypatch, empty_hf_cache):
    """Online mode: the hub is asked once, within the budget; a hanging answer is not waited for, and the second
    model does not wait again."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    asked = []
    monkeypatch.setattr(
        huggingface_hub, "get_hf_file_metadata", lambda url, timeout: asked.append(url) or time.sleep(30)
    )
    probe = HubProbe(seconds=0.5)
    t0 = time.monotonic()
    first = model_status("bert-base-uncased", probe)
    second = model_status("distilbert-base-uncased", probe)
    assert time.monotonic() - t0 < 2.0
    assert len(asked) == 1 and "bert-base-uncased" in asked[0]
    assert (
        first
        == second
        == "not in the local Hugging Face cache, and the hub (https://huggingface.co) did not answer within 0.5 s"
    )


def test_hub_http_answers_are_told_apart(monkeypatch, empty_hf_cache):
    import huggingface_hub

    class Refused(Exception):
        def __init__(self, status):
            super().__init__(f"HTTP {status}")
            self.response = type("R", (), {"status_code": status})()

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    for status, words in ((404, "has no model of that name"), (401, "needs HF_TOKEN")):
        monkeypatch.setattr(
            huggingface_hub, "get_hf_file_metadata", lambda url, timeout, s=status: (_ for _ in ()).throw(Refused(s))
        )
        assert words in model_status("org/model", HubProbe(seconds=2))
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda url, timeout: object())
    assert model_status("org/model", HubProbe(seconds=2)) is None  # the hub answers: it will download


def test_local_folders_packaged_and_random_models(tiny_bert_dir, tmp_path, offline):
    probe = HubProbe()
    assert model_status(str(tiny_bert_dir), probe) is None
    assert model_status(PACKAGED_MINILM, probe) is None
    assert model_status("random-init:distilbert-tiny", probe) is None
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    (weights_only / "config.json").write_text("{}")
    (weights_only / "model.safetensors").write_text("")
    assert model_status(str(weights_only), probe, tokenizer=False) is None
    assert (
        model_status(str(weights_only), probe)
        == f"the folder {weights_only} has no tokenizer files (tokenizer.json, tokenizer_config.json, vocab.txt)"
    )
    assert model_status(str(tmp_path / "gone"), probe) == f"no such folder {tmp_path / 'gone'}"


def test_local_backbone_and_generator_pass_training_checks(
    tiny_bert_dir, tiny_generator_dir, local_ingest_config, offline, root
):
    cfg = resolve_train_config(
        "default",
        {
            "backbone": str(tiny_bert_dir),
            "corrupt": {"generator": str(tiny_generator_dir)},
            "ingest": local_ingest_config.model_dump(),
        },
    )
    pf = training_checks(cfg, root=root)
    assert pf.problems == []
    assert [w.split(":")[0] for w in pf.warnings] == ["Wiki1M is a sample"]


def test_generator_datasets_and_unigram(root, offline):
    probe = HubProbe()
    missing = check_generator("generator:abc123", "argmax", root, probe, "config", ("generator",))
    assert "generator dataset 'abc123' not found" in missing.why and "run the fit-generator stage first" in missing.why
    assert check_generator("distilbert-base-uncased", "unigram", root, probe, "config", ("generator",)) is None
    hub = check_generator("distilbert-base-uncased", "argmax", root, probe, "config", ("generator",))
    assert """-p 'config={"generator": "random-init:distilbert-tiny"}'""" in hub.text()


def test_cuda_asked_for_without_a_cuda_device(monkeypatch):
    monkeypatch.setattr(preflight.torch.cuda, "is_available", lambda: False)
    problem = check_device("device", "cuda", "overrides", ("device",))
    assert problem.text() == (
        "device 'cuda': no CUDA device is available on this machine (torch.cuda.is_available() is False). Fix: run on "
        """the CPU, -p 'overrides={"device": "auto"}'; or run the deployment on a worker with a GPU."""
    )
    assert check_device("device", "auto", "overrides", ("device",)) is None
    monkeypatch.setattr(preflight.torch.cuda, "is_available", lambda: True)
    assert check_device("device", "cuda", "overrides", ("device",)) is None


def test_wiki1m_sample_is_a_warning_and_the_full_file_is_not(shared_data, wiki_head, root, monkeypatch):
    probe = HubProbe()
    sample = IngestConfig(wiki=WikiSource(path=str(shared_data / "wiki1m_head.txt")))
    found = check_source("wiki1m", sample, root, probe, "overrides", ("ingest",))
    assert found.problem is None
    assert found.warning.startswith(
        f"Wiki1M is a sample: {shared_data / 'wiki1m_head.txt'} holds 11,913 lines, not the full 1,000,000"
    )
    monkeypatch.setenv("CSE_SOURCE_MIRROR", str(shared_data))  # the mirror's sample too
    assert "holds 11,913 lines" in check_source("wiki1m", IngestConfig(), root, probe, "overrides", ("ingest",)).warning
    monkeypatch.setattr(preflight, "FULL_WIKI1M_LINES", 512)  # a file of the full length: no warning
    full = IngestConfig(wiki=WikiSource(path=str(wiki_head)))
    assert check_source("wiki1m", full, root, probe, "x", ()) == preflight.SourceCheck()


def test_missing_sources_name_the_path_and_the_override(tmp_path, root, monkeypatch):
    probe = HubProbe()
    gone = IngestConfig(wiki=WikiSource(path=str(tmp_path / "wiki.txt")))
    problem = check_source("wiki1m", gone, root, probe, "ingest_config", ()).problem
    assert problem.why == f"{tmp_path / 'wiki.txt'} does not exist"
    assert """-p 'ingest_config={"wiki": {"path": "/path/to/wiki1m_for_simcse.txt"}}'""" in problem.text()
    monkeypatch.setenv("CSE_SOURCE_MIRROR", str(tmp_path))  # a mirror without the file
    assert (
        f"CSE_SOURCE_MIRROR={tmp_path} holds none of"
        in check_source("nli", IngestConfig(), root, probe, "o", ()).problem.why
    )
    monkeypatch.delenv("CSE_SOURCE_MIRROR")
    unreachable = HubProbe(seconds=1)
    unreachable.unreachable["huggingface.co"] = "could not be reached (ConnectError: no DNS)"
    problem = check_source("sts", IngestConfig(), root, unreachable, "overrides", ("ingest",)).problem
    assert problem.why == "no local copy, and huggingface.co could not be reached (ConnectError: no DNS)"
    (root.downloads / "senteval").mkdir(parents=True)  # the download cache answers first
    assert check_source("sts", IngestConfig(), root, unreachable, "overrides", ("ingest",)).problem is None


def test_finish_logs_warnings_and_data_warning_tags(root, caplog):
    pf = Preflight("job", "overrides", root, warnings=["Wiki1M is a sample"])
    with caplog.at_level(logging.INFO, logger="test-preflight"):
        assert pf.finish(logging.getLogger("test-preflight")) == ["Wiki1M is a sample"]
    assert "preflight: Wiki1M is a sample" in caplog.text
    assert data_warning_tags(pf.warnings) == {DATA_WARNING_TAG: "Wiki1M is a sample"}
    assert data_warning_tags([]) == {}


def test_count_lines_counts_a_last_line_without_newline(tmp_path):
    (tmp_path / "a").write_bytes(b"x\ny\n")
    (tmp_path / "b").write_bytes(b"x\ny")
    (tmp_path / "c").write_bytes(b"")
    assert [count_lines(tmp_path / n) for n in "abc"] == [2, 2, 0]


def test_cse_run_prints_a_preflight_reason_whole():
    """`cse run` cuts a long failure reason, but never the preflight's list of missing things and fixes."""
    from cse.ops.deployments import REASON_CHARS, one_line_reason

    long = "PreflightError: preflight: job cannot run\n1. " + "x" * 2 * REASON_CHARS
    assert one_line_reason(f"Flow run encountered an exception: {long}") == " ".join(long.split())
    assert one_line_reason("OSError: " + "x" * 2 * REASON_CHARS).endswith("…")
