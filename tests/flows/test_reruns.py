"""Issue 24, stage reruns that compose: a deployment run's `config` merges into the deployment's own config, unknown
keys are refused by name with the known ones, and a corruption the stage wrote on its own is the one the training job
with the same settings reads.

The deployment is prefect.yaml's `corrupt/smoke` (its parameters read from the file), registered on the session's test
server; no worker polls it, so the test executes each scheduled flow run itself (`run_flow`), as a worker's flow-run
process does. The corpus is the first 128 lines of the Wiki1M sample, given as a run parameter.
"""

from __future__ import annotations

import pytest
import yaml

from config.methods import DEFAULT_METHOD
from config.settings import REPO_ROOT, get_settings
from storage.layout import DataRoot

SMOKE = next(
    e
    for e in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]
    if e["entrypoint"] == "flows/corrupt.py:corrupt" and e["name"] == "smoke"
)
DEPLOYMENT = "corrupt/reruns-smoke"


def _run(deployment_id, parameters: dict):
    """Create a flow run of the deployment with `parameters` (as `prefect deployment run -p` does) and execute it."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    from flows.corrupt import corrupt

    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(deployment_id, parameters=parameters)
    state = run_flow(corrupt, flow_run=run, parameters=run.parameters, return_type="state")
    assert state.is_completed(), state.message
    return state.result()


def _keys(kind: str) -> set[str]:
    return {m.key for _, m in DataRoot(get_settings().data_root).list(kind)}


def test_a_corrupt_rerun_changes_one_key_and_the_smoke_job_reads_it(
    prefect_harness, wiki_head, shared_data, tmp_path, monkeypatch, capsys
):
    from config.stages import IngestConfig, TokenizeConfig
    from flows.corrupt import corrupt
    from flows.tokenization import prepare_tokens
    from flows.train import job_datasets
    from ops.cli import main as cse
    from storage.manifest import Manifest

    monkeypatch.setenv("CSE_SOURCE_MIRROR", str(shared_data))  # the sts dataset a job reads, as scripts/env.sh sets it
    corpus = tmp_path / "wiki1m_first_128.txt"
    corpus.write_text("".join(wiki_head.read_text(encoding="utf-8").splitlines(keepends=True)[:128]), encoding="utf-8")
    data = {"ingest_config": {"wiki": {"path": str(corpus)}}}
    deployment_id = corrupt.to_deployment(name="reruns-smoke", parameters=SMOKE["parameters"]).apply()
    tokens_key = prepare_tokens(  # what an earlier smoke run left: the tokens of the smoke deployment's tokenizer
        "wiki1m",
        IngestConfig.model_validate(data["ingest_config"]),
        TokenizeConfig(**SMOKE["parameters"]["tokenize_config"]),
    ).key

    rerun = _run(deployment_id, {**data, "config": {"mask_ratio": 0.15}})
    assert _keys("tokens") == {tokens_key}  # the tokens were a cache hit: only the corruption was made
    assert not rerun.cache_hit and _keys("corruption") == {rerun.key}
    params = Manifest.read(rerun.path).params
    deployed = SMOKE["parameters"]["config"]
    assert params["mask_ratio"] == 0.15  # the one key given, the deployment's others kept (not the defaults)
    assert {k: params[k] for k in deployed} == deployed and params["variants"] == 2

    # the smoke training job asking for the same masking ratio finds that corruption: nothing new is written
    from config.training import resolve_train_config

    cfg = resolve_train_config(
        "smoke", {"corrupt": {"mask_ratio": 0.15}, "ingest": data["ingest_config"]}, method=DEFAULT_METHOD
    )
    tokens, corruption, _, _ = job_datasets(cfg)
    assert tokens.key == tokens_key and tokens.cache_hit
    assert corruption.key == rerun.key and corruption.cache_hit
    assert _keys("corruption") == {rerun.key}

    # an unknown key: refused before any flow run exists, naming the key and the ones the field knows
    capsys.readouterr()
    assert cse(["run", DEPLOYMENT, "-p", 'config={"mask_rato": 0.15}']) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "Validation failed for field 'config'" in err and "'mask_rato' was unexpected" in err, err
    assert "known keys of config: generator, mask_ratio, mode," in err, err
    assert cse(["run", DEPLOYMENT, "-p", 'ingest_config={"wiki": {"pth": "x"}}']) == 2
    assert "known keys of ingest_config.wiki: path, hf, url" in capsys.readouterr().err


def test_a_plain_call_refuses_an_unknown_key_by_name_before_any_work(prefect_harness):
    from prefect.exceptions import ParameterTypeError

    from flows.corrupt import corrupt

    with pytest.raises(
        ParameterTypeError,
        match=r"config: Value error, unknown CorruptConfig key 'mask_rato'; known: generator, mask_ratio",
    ):
        corrupt(config={"mask_rato": 0.15})
    assert not _keys("tokens") and not _keys("corruption")
