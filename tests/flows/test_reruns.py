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

from cse.config.methods import DEFAULT_METHOD
from cse.storage.layout import DataRoot
from cse.storage.settings import REPO_ROOT, get_settings

SMOKE = next(
    e
    for e in yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]
    if e["entrypoint"] == "cse.flows.corrupt:corrupt" and e["name"] == "smoke"
)
DEPLOYMENT = "corrupt/reruns-smoke"


def _run(deployment_id, parameters: dict):
    """Create a flow run of the deployment with `parameters` (as `prefect deployment run -p` does) and execute it."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    from cse.flows.corrupt import corrupt

    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(deployment_id, parameters=parameters)
    state = run_flow(corrupt, flow_run=run, parameters=run.parameters, return_type="state")
    assert state.is_completed(), state.message
    return state.result()


def _keys(kind: str) -> set[str]:
    return {m.key for _, m in DataRoot(get_settings().data_root).list(kind)}


def test_a_corrupt_rerun_changes_one_key_and_the_smoke_job_reads_it(
    prefect_harness, wiki_cut, shared_data, monkeypatch
):
    from cse.config.stages import IngestConfig, TokenizeConfig
    from cse.flows.corrupt import corrupt
    from cse.flows.tokenization import prepare_tokens
    from cse.flows.train import job_datasets
    from cse.ops.deployments import run_deployment_cli
    from cse.storage.manifest import Manifest

    monkeypatch.setenv("CSE_SOURCE_MIRROR", str(shared_data))  # the sts dataset a job reads, as scripts/env.sh sets it
    data = {"ingest_config": {"wiki": {"path": str(wiki_cut(128))}}}
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
    from cse.config.training import resolve_train_config

    cfg = resolve_train_config(
        "smoke", {"corrupt": {"mask_ratio": 0.15}, "ingest": data["ingest_config"]}, method=DEFAULT_METHOD
    )
    tokens, corruption, _, _ = job_datasets(cfg)
    assert tokens.key == tokens_key and tokens.cache_hit
    assert corruption.key == rerun.key and corruption.cache_hit
    assert _keys("corruption") == {rerun.key}

    # an unknown key: `cse run` is refused before any flow run exists, naming the key and the ones the field knows
    with pytest.raises(ValueError, match=r"Validation failed for field 'config'.*'mask_rato' was unexpected") as e:
        run_deployment_cli(DEPLOYMENT, ['config={"mask_rato": 0.15}'], out=print, err=print)
    assert "; known keys of config: generator, mask_ratio, mode," in str(e.value)
    with pytest.raises(ValueError, match="known keys of ingest_config.wiki: path, hf, url"):
        run_deployment_cli(DEPLOYMENT, ['ingest_config={"wiki": {"pth": "x"}}'], out=print, err=print)


def test_a_plain_call_refuses_an_unknown_key_by_name_before_any_work(prefect_harness):
    from prefect.exceptions import ParameterTypeError

    from cse.flows.corrupt import corrupt

    with pytest.raises(
        ParameterTypeError,
        match=r"config: Value error, unknown CorruptConfig key 'mask_rato' \(did you mean 'mask_ratio'\?\); known: "
        r"generator, mask_ratio",
    ):
        corrupt(config={"mask_rato": 0.15})
    assert not _keys("tokens") and not _keys("corruption")


def test_a_re_evaluation_scores_the_jobs_sts_dataset_nested_under_its_run(prefect_harness, shared_data, tiny_bert_dir):
    """Issue 24: re-evaluating a training job's checkpoint (by MLflow run, or its job folder's best/) reads the ingested
    `sts` dataset the job used (not the SentEval folder), with the job's `sts_hash`, in the job's experiment, nested
    under the job's run."""
    import mlflow
    import pyarrow.compute as pc

    from cse.config.evaluation import EvalConfig
    from cse.flows.evaluate import evaluate
    from cse.storage import schemas
    from cse.storage.datasets import write_dataset
    from cse.storage.readers import read_senteval
    from cse.storage.runs import RunDir
    from cse.tasks.evaluate_common import placement
    from cse.tracking.lineage import CONTEXT_EVAL, log_dataset_inputs
    from cse.tracking.store import configure_mlflow, ensure_experiment
    from tests.flows.test_evaluate import _d2cse_checkpoint

    root = DataRoot(get_settings().data_root)
    table, _ = read_senteval(shared_data / "senteval")
    dev = pc.and_(pc.equal(table["task"], "stsb"), pc.equal(table["split"], "dev"))
    table = table.filter(dev).slice(0, 200)  # a small sts dataset of the job's: 200 STS-B dev pairs to embed
    sts = write_dataset(root, "sts", "sts-of-the-job", [table], schemas.STS)
    job = RunDir(DEFAULT_METHOD, "job-key")
    _d2cse_checkpoint(tiny_bert_dir, job.best)
    configure_mlflow()  # the job's run as tasks/train.py leaves it: its job tags, the sts dataset it read, its checkpoint
    with mlflow.start_run(
        experiment_id=ensure_experiment(DEFAULT_METHOD),
        run_name=f"{DEFAULT_METHOD}-smoke",
        tags={"method": DEFAULT_METHOD, "run_dir": str(job.path)},
    ) as train_run:
        log_dataset_inputs(train_run.info.run_id, [(sts, CONTEXT_EVAL)])
        mlflow.log_artifacts(str(job.best), artifact_path="checkpoint")
    job.set_mlflow_run_id(train_run.info.run_id)

    parent = train_run.info.run_id
    summary = evaluate(EvalConfig(checkpoint=f"runs:/{parent}", mode="dev", tasks=("stsb",), progress=False))
    run = mlflow.get_run(summary.mlflow_run_id)
    assert run.info.experiment_id == train_run.info.experiment_id
    assert run.info.run_name == f"evaluate-dev-{DEFAULT_METHOD}-smoke"
    tags = run.data.tags
    assert tags["mlflow.parentRunId"] == parent and tags["cse.evaluates_run"] == parent
    assert (tags["sts_source"], tags["sts_hash"]) == ("dataset:sts-of-the-job", sts.content_hash)
    # the job folder's best/ is the same run's checkpoint: placed the same way
    assert placement(EvalConfig(checkpoint=str(job.best), mode="dev")) == placement(
        EvalConfig(checkpoint=f"runs:/{parent}", mode="dev")
    )
    assert mlflow.get_experiment_by_name("evaluation") is None  # nothing landed in the plain-model experiment

    import shutil

    shutil.rmtree(root.dataset_dir("sts", "sts-of-the-job"))
    with pytest.raises(FileNotFoundError, match="evaluated on the sts dataset sts-of-the-job, which is not under"):
        evaluate(EvalConfig(checkpoint=f"runs:/{parent}", mode="dev", progress=False))
